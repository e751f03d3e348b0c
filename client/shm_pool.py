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

from kvserver.layout import KVLayout
from kvserver.shm import ShmMapping, create_memfd, create_shm, unlink_shm
from kvserver.v1 import kvserver_pb2 as pb


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
    ) -> None:
        """Creates the object (a sealed memfd, or the named object ``name``); ``token_padding``
        extra bytes per token exercise strided pools."""
        self.layout = layout
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_tokens = num_tokens
        self.named = name is not None
        self.name = name or f"kvpool-{secrets.token_hex(8)}"  # a memfd's is only its /proc label
        token_bytes = layout.token_bytes(dtype)
        if token_padding % dtype.itemsize:
            raise ValueError("token_padding must be a multiple of the dtype size")
        self.token_stride = token_bytes + token_padding
        self.buffer_bytes = self.token_stride * num_tokens
        size = self.buffer_bytes * num_layers * layout.num_parts
        self._fd = -1
        if self.named:
            self._shm: ShmMapping | None = create_shm(self.name, size)
        else:
            self._fd, self._shm = create_memfd(self.name, size)
        flat = torch.frombuffer(self._shm.mm, dtype=torch.uint8).view(dtype)
        stride = self.token_stride // dtype.itemsize
        heads, dim = layout.token_shape
        self.buffers: list[list[torch.Tensor]] = [
            [
                torch.as_strided(
                    flat,
                    (num_tokens, heads, dim),
                    (stride, dim, 1),
                    self._offset(layer, part) // dtype.itemsize,
                )
                for part in range(layout.num_parts)
            ]
            for layer in range(num_layers)
        ]

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
