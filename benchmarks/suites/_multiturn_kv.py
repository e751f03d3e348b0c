"""Real KV bytes for the multi-turn benchmark: a shared-memory "device" pool of the model's
geometry whose pages hold bytes that are a pure function of (client, page), so any process can
check that a page loaded from a host tier holds what was stored for it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from _multiturn_model import ModelConfig

from kvclient import KVLayout, ShmKVPool


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page: int

    @classmethod
    def of(cls, cfg: ModelConfig, page: int) -> Geometry:
        return cls(cfg.layers, cfg.kv_heads, cfg.head_dim, getattr(torch, cfg.dtype), page)

    @property
    def layout(self) -> KVLayout:
        return KVLayout.mha(self.kv_heads, self.head_dim)

    @property
    def chunk(self) -> int:
        """Bytes of one page in one (layer, part)."""
        return self.page * self.layout.token_bytes(self.dtype)

    @property
    def page_bytes(self) -> int:
        return self.chunk * 2 * self.layers


def content(seed: int, client: int, page: int, geom: Geometry) -> np.ndarray:
    """The bytes page ``page`` of client ``client`` holds: uint8 [layers, 2, chunk]."""
    return np.random.default_rng([seed, client, page]).integers(
        0, 256, (geom.layers, 2, geom.chunk), dtype=np.uint8)


class DevicePool:
    """``raw[l][q]``: layer l part q as uint8 [pages, chunk]."""

    def __init__(self, geom: Geometry, pages: int, seed: int) -> None:
        self.geom, self.pages, self.seed = geom, pages, seed
        self.pool = ShmKVPool(geom.layout, geom.dtype, geom.layers, pages * geom.page)
        self.raw = [[b.view(torch.uint8).view(pages, geom.chunk) for b in layer]
                    for layer in self.pool.buffers]
        self.checked = 0
        self.wrong = 0

    def fill(self, client: int, first_page: int, slots: list[int]) -> None:
        """Writes pages first_page.. of the client into ``slots`` (what a prefill would compute)."""
        for i, slot in enumerate(slots):
            kv = torch.from_numpy(content(self.seed, client, first_page + i, self.geom))
            for layer in range(self.geom.layers):
                for q in range(2):
                    self.raw[layer][q][slot].copy_(kv[layer, q])

    def digest(self, slot: int) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for layer in self.raw:
            for buf in layer:
                h.update(buf[slot].numpy().tobytes())
        return h.digest()

    def verify(self, client: int, first_page: int, slots: list[int]) -> None:
        """Checks the first and last of ``slots`` (pages first_page..) against the bytes stored."""
        if not slots:
            return
        for i in sorted({0, len(slots) - 1}):
            want = hashlib.blake2b(content(self.seed, client, first_page + i, self.geom).tobytes(),
                                   digest_size=16).digest()
            self.checked += 1
            self.wrong += self.digest(slots[i]) != want

    def tokens(self, slots: list[int]) -> np.ndarray:
        s = np.asarray(slots, dtype=np.int64)
        return (s[:, None] * self.geom.page + np.arange(self.geom.page, dtype=np.int64)).reshape(-1)

    def close(self) -> None:
        self.raw = []
        self.pool.close()
