"""Puts a full cache leaves unstored: counted in their ``dropped`` and logged, at once and then at
most once a minute, with why room was short (docs/cache.md)."""

from __future__ import annotations

import asyncio
import logging

from test_disk_tier import MiB, keys_of

from kvserver.core.kvcore import KVCore
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys
from kvserver.store.spaces import PartKey, SpaceKey

PAGE = 32 * 1024
SPACE = SpaceKey("t", "m", KVLayout.mha(2, 64), dtype_named("float16"), 16, 4, 1, 1)


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
    # the first Put's at once; the two others' within the minute after it, at the core's close
    assert len(logged) == 2 and "left 64 pages of Puts unstored" in logged[0], logged
    assert "left 128 pages of Puts unstored" in logged[1], logged
    assert "bytes of" in logged[0] and "are free" in logged[0]


def _unstored_warnings(body) -> list[str]:
    """``asyncio.run(body())``: the cache's warnings of Puts' pages left unstored, as logged."""
    from kvserver.store import cache as cache_mod

    logged: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "unstored" in record.getMessage():
                logged.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logging.getLogger(cache_mod.__name__).addHandler(handler)
    try:
        asyncio.run(body())
    finally:
        logging.getLogger(cache_mod.__name__).removeHandler(handler)
    return logged


def _pages_said(logged: list[str]) -> list[str]:
    """The page counts the warnings name, in order."""
    return [m.split(" pages")[0].split("left ")[1] for m in logged]


def _dropping_puts(monkeypatch, window: float, wait: float) -> list[str]:
    """Three Puts that store nothing, ``DROPS_LOG_SECONDS`` set to ``window``, then ``wait``
    seconds on the loop and the core's close: the warnings logged."""
    from kvserver.store import cache as cache_mod

    monkeypatch.setattr(cache_mod, "DROPS_LOG_SECONDS", window)

    async def body() -> None:
        core = KVCore(16 * MiB)
        try:
            core.arena.reserve(core.arena.capacity - (1 << 20), commit=False)
            c = core.cache
            part = c.part(c.space(SPACE), PartKey(0, 0, 0, 4, PAGE))
            for r in range(3):
                c.complete_put(c.prepare_put(part, Keys.of(keys_of(f"w{r}-", 64))), True)
            await asyncio.sleep(wait)
        finally:
            await core.close()

    return _unstored_warnings(body)


def test_drops_after_a_warning_are_logged_once_its_minute_is_over(monkeypatch):
    """Before, the drops of the minute after a warning were logged only if another drop came after
    that minute: the 128 pages of the second and third Puts never were."""
    logged = _dropping_puts(monkeypatch, 0.3, 0.6)
    assert _pages_said(logged) == ["64", "128"], logged


def test_drops_not_logged_yet_are_logged_at_the_stop(monkeypatch):
    logged = _dropping_puts(monkeypatch, 60.0, 0.0)
    assert _pages_said(logged) == ["64", "128"], logged


def test_the_disk_tiers_drops_not_logged_yet_are_logged_at_the_stop(tmp_path):
    """The disk tier's cache logs its Puts' drops as the host cache does: those of the minute after
    a warning are logged at the stop, not left with a timer on a loop that closes."""

    async def body() -> None:
        core = KVCore(64 * MiB, disk_cache=str(tmp_path), disk_size=128 * MiB)
        try:
            dc = core.disk.cache
            dc.arena.reserve_high(dc.arena.capacity)  # the disk has no room for a slab
            part = dc.part(dc.space(SPACE), PartKey(0, 0, 0, 4, PAGE))
            for r in range(3):
                dc.complete_put(dc.prepare_put(part, Keys.of(keys_of(f"k{r}-", 64))), True)
        finally:
            await core.close()

    logged = _unstored_warnings(body)
    assert _pages_said(logged) == ["64", "128"], logged
    assert all("disk" in m for m in logged), logged
