"""A KV pool made of an engine's own per-layer views, registered where they lie (no copy).

vLLM 0.33 gives every attention layer a 4D ``[B, H, N, C]`` view (blocks, KV heads, token slots
of a block, content) of one raw buffer, in one of six physical orders (docs/layouts.md, "vLLM
0.33's per-layer views"). ``KVViewsPool`` describes such views to the daemon with the BufferRef
block, head and token strides. A CPU engine allocates its raw buffer in a ``SharedKVMemory`` (a
sealed memfd) so that the daemon can map it; CUDA views are exported by IPC as ``CudaKVPool``
exports its tensors.
"""

from __future__ import annotations

import os
import secrets
import weakref

import torch

from kvclient.cuda_pool import buffer_ref, device_identity
from kvserver.protocol.layout import KVLayout
from kvserver.protocol.shared_memory import create_memfd
from kvserver.v1 import kvserver_pb2 as pb

_LIVE: weakref.WeakSet[SharedKVMemory] = weakref.WeakSet()


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) of the bytes ``t`` can address (any strides, any sign)."""
    lo = hi = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    w = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride >= 0:
            hi += (size - 1) * stride * w
        else:
            lo += (size - 1) * stride * w
    return lo, hi + w


class SharedKVMemory:
    """``size`` bytes of shared memory (an anonymous memfd sealed against resizing, as ShmKVPool
    makes) seen as the flat uint8 tensor ``tensor``: a CPU engine allocates its KV cache in it
    (vLLM: as the raw buffer its create_kv_cache_views carves per-layer views from) so that the
    daemon can map it. Keep it alive (and open) while views of it are used or registered.

    ``name`` is only the memfd's label in /proc (a random one by default); nothing appears in /dev/shm."""

    def __init__(self, size: int, *, name: str | None = None) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size = size
        self.name = name or f"kvviews-{secrets.token_hex(8)}"
        self._fd, self._shm = create_memfd(self.name, size)
        self.tensor: torch.Tensor = torch.frombuffer(self._shm.mm, dtype=torch.uint8)
        self._base = self.tensor.data_ptr()
        _LIVE.add(self)

    @property
    def closed(self) -> bool:
        return self._shm is None

    @property
    def base(self) -> int:
        """The address of byte 0 of the mapping."""
        return self._base

    @property
    def fds(self) -> list[int]:
        """[memfd]: what a Register sends with its peer ticket."""
        return [] if self._fd < 0 else [self._fd]

    def contains(self, t: torch.Tensor) -> bool:
        """Whether every byte ``t`` can address lies inside this (open) memory."""
        if self.closed or t.device.type != "cpu":
            return False
        lo, hi = _byte_range(t)
        return self._base <= lo and hi <= self._base + self.size

    def close(self) -> None:
        """Unmaps and closes the memfd; tensors taken from it must not be used afterwards."""
        _LIVE.discard(self)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SharedKVMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared_memory_of(t: torch.Tensor) -> SharedKVMemory | None:
    """The live (not closed) SharedKVMemory whose mapping holds all of ``t``, or None (a registry of live
    objects, weak references)."""
    for mem in list(_LIVE):
        if mem.contains(t):
            return mem
    return None


def view_fields(view: torch.Tensor) -> dict[str, int]:
    """The BufferRef addressing fields of one [B, H, N, D] view, its offset relative to the start
    of its storage (CPU and CUDA alike; plain computation, no device needed): ``offset``,
    ``block_tokens`` = N, ``block_stride`` = stride(0), ``head_stride`` = stride(1) and
    ``token_stride`` = stride(2), all in bytes."""
    w = view.element_size()
    return {
        "offset": view.data_ptr() - view.untyped_storage().data_ptr(),
        "block_tokens": view.shape[2],
        "block_stride": view.stride(0) * w,
        "head_stride": view.stride(1) * w,
        "token_stride": view.stride(2) * w,
    }


class KVViewsPool:
    """A device pool made of per-layer views, registered as they lie (no copy).

    ``buffers[layer][part]``: 4D views [num_blocks, heads, block_tokens, head_dim] (vLLM's
    per-layer [B, H, N, C] order; for full attention part 0 = K = view[..., :head_size] and part
    1 = V = view[..., head_size:]; for MLA one part, heads 1), element stride 1 in the last dim,
    every layer and part the same shape and strides (offsets differ). Token t of the pool is block
    t // block_tokens, slot t % block_tokens (so a kvserver page of page_size = block_tokens is
    one vLLM block). CPU views must all lie in one SharedKVMemory (found with shared_memory_of);
    CUDA views are exported by IPC as CudaKVPool exports its tensors (same storage handling,
    device identity, release_exports)."""

    def __init__(self, layout: KVLayout, dtype: torch.dtype, buffers: list[list[torch.Tensor]]) -> None:
        if not buffers or any(len(parts) != layout.num_parts for parts in buffers):
            raise ValueError(f"each layer needs {layout.num_parts} view(s) for this layout "
                             f"({'MLA: the latent' if layout.is_mla else 'K and V'})")
        first = buffers[0][0]
        if first.dim() != 4:
            raise ValueError(f"views must be 4D [num_blocks, heads, block_tokens, head_dim], got shape "
                             f"{tuple(first.shape)}")
        heads, dim = layout.token_shape
        if (first.shape[1], first.shape[3]) != (heads, dim):
            raise ValueError(f"view shape {tuple(first.shape)} does not match the layout: heads {heads} and "
                             f"head_dim {dim} in [num_blocks, heads, block_tokens, head_dim]")
        if first.stride(3) != 1 and first.shape[3] > 1:
            raise ValueError(f"a view's last dim must have element stride 1, got strides {first.stride()}")
        if any(s < 0 for s in first.stride()):
            raise ValueError(f"negative strides are not supported, got {first.stride()}")
        for layer, parts in enumerate(buffers):
            for part, t in enumerate(parts):
                where = f"view [{layer}][{part}]"
                if t.dtype != dtype:
                    raise ValueError(f"{where} is {t.dtype}, the pool's dtype is {dtype}")
                if t.device != first.device:
                    raise ValueError(f"{where} is on {t.device}, view [0][0] on {first.device}: one device")
                if t.shape != first.shape or t.stride() != first.stride():
                    raise ValueError(f"{where} has shape {tuple(t.shape)}, strides {t.stride()}; every view "
                                     f"must have view [0][0]'s {tuple(first.shape)}, {first.stride()}")
        self.memory: SharedKVMemory | None = None
        if first.device.type == "cpu":
            mem = shared_memory_of(first)
            if mem is None:
                raise ValueError("CPU views must lie in a SharedKVMemory (allocate the KV cache in "
                                 "SharedKVMemory(...).tensor) for the daemon to map them")
            for layer, parts in enumerate(buffers):
                for part, t in enumerate(parts):
                    if not mem.contains(t):
                        raise ValueError(f"view [{layer}][{part}] is not in the SharedKVMemory of view "
                                         "[0][0]: all views must lie in one")
            self.memory = mem
        elif first.device.type != "cuda":
            raise ValueError(f"views must be CPU (in a SharedKVMemory) or CUDA tensors, not {first.device}")
        self.layout = layout
        self.dtype = dtype
        self.buffers = buffers
        self.num_layers = len(buffers)
        self.block_tokens = first.shape[2]
        self.num_tokens = first.shape[0] * first.shape[2]
        self._exports: list[tuple[bytes, int]] = []  # CUDA: torch IPC reference counters (file, offset)

    @property
    def fds(self) -> list[int]:
        """The memfd (CPU), [] (CUDA)."""
        return self.memory.fds if self.memory is not None else []

    def descriptor(self) -> pb.DevicePool:
        layers = []
        for parts in self.buffers:
            layer = pb.LayerBuffers()
            for t in parts:
                f = view_fields(t)
                if self.memory is not None:
                    if self.memory.closed:
                        raise ValueError("the pool's SharedKVMemory is closed")
                    f["offset"] = t.data_ptr() - self.memory.base
                    layer.parts.append(pb.BufferRef(fd=pb.FdLocation(index=0), **f))
                    continue
                uuid, pci = device_identity(t.device)
                share = t.untyped_storage()._share_cuda_()
                self._exports.append((share[4], share[5]))
                layer.parts.append(buffer_ref(share, f["offset"], f["token_stride"], uuid, pci,
                                              block_tokens=f["block_tokens"], block_stride=f["block_stride"],
                                              head_stride=f["head_stride"]))
            layers.append(layer)
        return pb.DevicePool(num_tokens=self.num_tokens, layers=layers)

    def release_exports(self) -> int:
        """CUDA: drops torch's IPC reference counts taken by ``descriptor`` (once no daemon maps the
        pool), as CudaKVPool does; returns how many. CPU: 0."""
        exports, self._exports = self._exports, []
        for ref_counter, offset in exports:
            torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, offset)
        if exports:
            torch.cuda.ipc_collect()
        return len(exports)
