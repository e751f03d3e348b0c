"""A Register that needs room the cache holds: it evicts only the slabs of one window of the arena
that then holds its region, and nothing at all when no such window exists (docs/cache.md)."""

from __future__ import annotations

import os

import grpc
import numpy as np
from cache_engine import CacheEngine, prompt_keys, scattered
from checks import error_of
from conftest import DaemonThread

from kvserver.config import ServerConfig
from kvserver.store import Keys

MIB = 1 << 20


def _cached_pages(d: DaemonThread, keys: Keys) -> int:
    def count() -> int:
        cache = d.core.cache
        part = next(iter(cache._parts.values()))
        return int((cache.pages.find(part.gid, keys) >= 0).sum())

    return d.run(count)


def _key_in_slab_at(d: DaemonThread, keys: list[bytes], offset: int) -> int:
    """The position of a key whose page lies in the slab at ``offset``."""
    def find() -> int:
        cache = d.core.cache
        part = next(iter(cache._parts.values()))
        ids = cache.pages.find(part.gid, Keys.of(keys))
        slab_at = {s.sid: s.offset for s in cache.slabs.slabs.values()}
        return next(i for i, p in enumerate(ids.tolist()) if p >= 0
                    and slab_at.get(int(cache.pages.slab[p])) == offset)

    return d.run(find)


def _filled(d: DaemonThread, eng: CacheEngine) -> tuple[Keys, np.ndarray]:
    """Four Puts of 250 pages of 32 KiB (four 8 MiB slabs, taken from the top of the arena down),
    the first Put's slab the least recently used."""
    rng = np.random.default_rng(0)
    keys = prompt_keys(rng.integers(0, 1 << 30, 1000 * 16))
    for c in range(0, 1000, 250):
        pages = scattered(rng, 250, eng.num_pages)
        eng.fill(keys[c:c + 250], pages)
        assert eng.put(keys[c:c + 250], pages).stored == 250
    slabs = d.run(lambda: sorted((s.offset, s.nbytes) for s in d.core.cache.slabs.slabs.values()))
    assert [n for _, n in slabs] == [8 * MIB] * 4, slabs
    return Keys.of(keys), keys


def test_a_register_that_cannot_fit_evicts_nothing(socket_dir) -> None:
    """A page pinned in the slab at 16 MiB: no window of free space and unpinned slabs holds 20 MiB
    (14 below it, 16 above), so the Register is refused, and every cached page is still there."""
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=40 * MIB))
    try:
        with CacheEngine(d.address, pages=1024) as eng:
            stored, keys = _filled(d, eng)
            k = _key_in_slab_at(d, keys, 16 * MIB)
            lease = eng.lookup([keys[k]], pin_ms=30_000)
            assert lease.pages == 1
            code, message = error_of(lambda: CacheEngine(d.address, pages=16, host_tokens=640 * 16))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
            assert _cached_pages(d, stored) == 1000
    finally:
        d.stop()


def test_a_register_evicts_one_window_not_the_least_recent_slabs(socket_dir) -> None:
    """10 MiB: the slab next to the arena's free 6 MiB makes room alone; evicting least recently
    used slabs first would take the top two (neither next to free space) before one range held it."""
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=40 * MIB))
    try:
        with CacheEngine(d.address, pages=1024) as eng:
            stored, _ = _filled(d, eng)
            with CacheEngine(d.address, pages=16, host_tokens=320 * 16):
                assert _cached_pages(d, stored) == 750
    finally:
        d.stop()
