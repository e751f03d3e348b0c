"""A KV pool in shared memory, as torch tensors: the "device" pool of a CPU engine.

One shared-memory object holds every layer, layer-first: layer l, part p (K, V, or the MLA
latent) is a [num_tokens, num_heads, head_dim] tensor at a fixed offset, like the per-layer
buffers of SGLang's and vLLM's device pools. ``descriptor()`` tells the daemon where each is.

By default the object is an anonymous memfd sealed against resizing: the clients hand its
descriptor (``fds``) to the daemon with each Register, nothing appears in /dev/shm, and the
memory goes when the engine and the daemon have both let go of it. ``name=...`` makes a named
/dev/shm object instead (for setups where other processes open the pool by name); the daemon
takes those only with --allow-named-shm.
"""

from __future__ import annotations

import os
import secrets

import torch

from kvserver.protocol.layout import KVLayout
from kvserver.protocol.shared_memory import ShmMapping, create_memfd, create_shm, unlink_shm
from kvserver.v1 import kvserver_pb2 as pb

# vLLM's layouts: a layer's tensor shape from (blocks, block size, heads, head size).
_VLLM_SHAPES = {
    "flash_attn": lambda nb, block, heads, dim: (2, nb, block, heads, dim),
    "flash_attn_hnd": lambda nb, block, heads, dim: (2, nb, heads, block, dim),
    "flashinfer": lambda nb, block, heads, dim: (nb, 2, block, heads, dim),
    "flashinfer_hnd": lambda nb, block, heads, dim: (nb, 2, heads, block, dim),
    "mla": lambda nb, block, heads, dim: (nb, block, heads, dim),
}
VLLM_LAYOUTS = tuple(_VLLM_SHAPES)


def _check_vllm_layout(layout: KVLayout, kind: str, num_tokens: int, block: int, token_padding: int) -> None:
    """Raises ValueError unless a pool of ``layout`` can be laid out as vLLM's ``kind``."""
    if kind not in VLLM_LAYOUTS:
        raise ValueError(f"unknown vLLM layout {kind!r}; one of {sorted(VLLM_LAYOUTS)}")
    if block < 1:
        raise ValueError(f"block_size must be at least 1, not {block}")
    if token_padding or num_tokens % block:
        raise ValueError("a vLLM layout has no token padding and whole blocks")
    if (kind == "mla") != layout.is_mla:
        raise ValueError(f"layout {kind!r} does not fit a {'MLA' if layout.is_mla else 'MHA'} pool")


class ShmKVPool:
    def __init__(
        self,
        layout: KVLayout,
        dtype: torch.dtype,
        num_layers: int,
        num_tokens: int,
        *,
        name: str | None = None,
        token_padding: int = 0,
        vllm_layout: str | None = None,
        block_size: int = 16,
    ) -> None:
        """Creates the object (a sealed memfd, or the named object ``name``); ``token_padding``
        extra bytes per token exercise strided pools.

        ``vllm_layout`` lays each layer out as one of vLLM's attention backends does (one tensor
        per layer, ``block_size`` tokens a block; docs/layouts.md): "flash_attn" [2, blocks, block,
        H, D], "flashinfer" [blocks, 2, block, H, D], "flash_attn_hnd" [2, blocks, H, block, D],
        "flashinfer_hnd" [blocks, 2, H, block, D], or "mla" [blocks, block, latent]. ``buffers``
        then holds [blocks, block, H, D] views (token t at [t // block, t % block]) and
        ``layer_tensors`` the layers' own tensors. Arguments are checked before anything is
        created; a construction that fails after leaves no descriptor, mapping or named object."""
        self.layout = layout
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_tokens = num_tokens
        self.named = name is not None
        self.name = name or f"kvpool-{secrets.token_hex(8)}"  # a memfd's is only its /proc label
        token_bytes = layout.token_bytes(dtype)
        if token_padding % dtype.itemsize:
            raise ValueError("token_padding must be a multiple of the dtype size")
        if vllm_layout is not None:
            _check_vllm_layout(layout, vllm_layout, num_tokens, block_size, token_padding)
        self.token_stride = token_bytes + token_padding
        self.buffer_bytes = self.token_stride * num_tokens
        size = self.buffer_bytes * num_layers * layout.num_parts
        self._fd = -1
        self._shm: ShmMapping | None = None
        self.buffers: list[list[torch.Tensor]] = []
        self.layer_tensors: list[torch.Tensor] = []
        self.vllm_layout = vllm_layout
        self._refs: list[list[dict]] | None = None
        if self.named:
            self._shm = create_shm(self.name, size)
        else:
            self._fd, self._shm = create_memfd(self.name, size)
        try:
            self._lay_out(vllm_layout, block_size)
        except BaseException:
            self.close()  # (views of the mapping made so far go with this frame)
            raise

    def _lay_out(self, vllm_layout: str | None, block_size: int) -> None:
        assert self._shm is not None
        layout, dtype, num_tokens = self.layout, self.dtype, self.num_tokens
        flat = torch.frombuffer(self._shm.mm, dtype=torch.uint8).view(dtype)
        if vllm_layout is not None:
            self._lay_out_as_vllm(flat, vllm_layout, block_size)
            return
        stride = self.token_stride // dtype.itemsize
        heads, dim = layout.token_shape
        self.buffers = [
            [
                torch.as_strided(
                    flat,
                    (num_tokens, heads, dim),
                    (stride, dim, 1),
                    self._offset(layer, part) // dtype.itemsize,
                )
                for part in range(layout.num_parts)
            ]
            for layer in range(self.num_layers)
        ]

    def _lay_out_as_vllm(self, flat: torch.Tensor, kind: str, block: int) -> None:
        layout, n = self.layout, self.num_tokens
        heads, dim = layout.token_shape
        nb, per_layer = n // block, self.buffer_bytes * layout.num_parts // self.dtype.itemsize
        shape = _VLLM_SHAPES[kind](nb, block, heads, dim)
        self.layer_tensors = [flat[i * per_layer:(i + 1) * per_layer].view(shape)
                              for i in range(self.num_layers)]

        def part_view(t: torch.Tensor, p: int) -> torch.Tensor:
            v = {"flash_attn": lambda: t[p], "flashinfer": lambda: t[:, p], "mla": lambda: t,
                 "flash_attn_hnd": lambda: t[p].transpose(1, 2),
                 "flashinfer_hnd": lambda: t[:, p].transpose(1, 2)}[kind]()
            return v

        w, base = self.dtype.itemsize, flat.data_ptr()
        self.buffers = [[part_view(t, p) for p in range(layout.num_parts)] for t in self.layer_tensors]
        self._refs = [[{"offset": v.data_ptr() - base, "block_tokens": block, "block_stride": v.stride(0) * w,
                        "token_stride": v.stride(1) * w, "head_stride": v.stride(2) * w} for v in layer]
                      for layer in self.buffers]

    def _offset(self, layer: int, part: int) -> int:
        return (layer * self.layout.num_parts + part) * self.buffer_bytes

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffers[layer][0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        if self.layout.is_mla:
            raise ValueError("an MLA pool has one latent buffer per layer; use buffers[layer][0]")
        return self.buffers[layer][1]

    @property
    def fds(self) -> list[int]:
        """The descriptors a Register sends with its peer ticket (none for a named object)."""
        return [] if self._fd < 0 else [self._fd]

    def _location(self) -> dict:
        if self.named:
            return {"shm": pb.ShmLocation(name=self.name)}
        return {"fd": pb.FdLocation(index=0)}

    def descriptor(self) -> pb.DevicePool:
        return pb.DevicePool(
            num_tokens=self.num_tokens,
            layers=[
                pb.LayerBuffers(
                    parts=[
                        pb.BufferRef(**self._location(), **self._refs[layer][part]) if self._refs else
                        pb.BufferRef(
                            **self._location(),
                            offset=self._offset(layer, part),
                            token_stride=self.token_stride,
                        )
                        for part in range(self.layout.num_parts)
                    ]
                )
                for layer in range(self.num_layers)
            ],
        )

    def unmap(self) -> None:
        """Drops this process's mapping but keeps the object (a memfd: its descriptor), so the
        pool can still be registered. Tensors taken from ``buffers`` must not be used afterwards."""
        self.buffers = []
        self.layer_tensors = []
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def close(self, unlink: bool = True) -> None:
        """Unmaps the pool and closes its memfd, or unlinks its named object unless told not to.
        Tensors taken from ``buffers`` must not be used afterwards: they point into unmapped memory."""
        self.unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.named and unlink:
            unlink_shm(self.name)

    def __enter__(self) -> ShmKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
