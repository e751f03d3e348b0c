"""Puts a full cache leaves unstored: counted in their ``dropped`` and logged, at once and then at
most once a minute, with why room was short (docs/cache.md)."""

from __future__ import annotations

import asyncio
import logging

import torch
from test_disk_tier import MiB, keys_of

from kvserver.core.kvcore import KVCore
from kvserver.protocol.layout import KVLayout
from kvserver.store import Keys
from kvserver.store.spaces import PartKey, SpaceKey

PAGE = 32 * 1024
SPACE = SpaceKey("t", "m", KVLayout.mha(2, 64), torch.float16, 16, 4, 1, 1)


def test_puts_a_full_cache_leaves_unstored_are_logged_at_once_then_rarely(caplog):
    """A small daemon whose engines' regions leave the cache less than a slab: its Puts store
    nothing, which the Puts' ``dropped`` count says and a warning too (once a minute at most)."""
    from kvserver.store import cache as cache_mod

    async def body() -> list[int]:
        core = KVCore(16 * MiB)
        try:
            core.arena.reserve(core.arena.capacity - (1 << 20), commit=False)  # engines' regions
            c = core.cache
            part = c.part(c.space(SPACE), PartKey(0, 0, 0, 4, PAGE))
            drops = []
            for r in range(3):
                plan = c.prepare_put(part, Keys.of(keys_of(f"d{r}-", 64)))
                drops.append(plan.dropped)
                c.complete_put(plan, True)
            return drops
        finally:
            await core.close()

    with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
        drops = asyncio.run(body())
    assert drops == [64, 64, 64]
    logged = [r.getMessage() for r in caplog.records if "unstored" in r.getMessage()]
    assert len(logged) == 1 and "left 64 pages of Puts unstored" in logged[0], logged
    assert "bytes of" in logged[0] and "are free" in logged[0]
