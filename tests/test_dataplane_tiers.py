"""The data plane in a daemon with a disk tier: its thread serves whole the lane Gets, Lookups and
Puts of stored keys whose every key host memory holds, and hands the loop every other one, which
reads the disk's pages back (or counts them) as before. The same pages, bit exact, and the same
counters and disk recency either way (against the same calls over gRPC); no hold left behind.
Real daemon, real engines, real files."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE, CacheEngine
from test_dataplane_alone import _readers, _until
from test_disk_tier import MiB, keys_of, store, tiers, written

from kvclient import CacheView
from kvserver.lane import plane
from kvserver.store.keys import as_keys


@pytest.fixture
def tiered(daemon_factory, tmp_path):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
    if d.core.plane is None or not plane.GETS:
        if os.environ.get("KVSERVER_EXPECT_PLANE"):  # scripts/sanitize.sh: a skip would hide the job
            pytest.fail("the compiled data plane is not running")
        pytest.skip("the data plane does not serve cache calls here (not built, or turned off)")
    assert d.core.disk is not None and d.core.plane.cache.whole  # a tier may hold what host memory misses
    return d


def _counts(d) -> tuple[int, int, int]:
    p = d.core.plane
    return p.plane_gets, p.plane_lookups, p.plane_puts


def _ledger(eng: CacheEngine) -> np.ndarray:
    """The daemon's counters a cache call moves: the spaces' hits, misses and pages a Put found
    stored, and the tiers' hits and pages read back from disk."""
    t = {x.name: x for x in eng.client.stats(True).tiers}
    spaces = [sp.counters for sp in eng.client.stats().spaces]  # (the caller's: its tenant's)
    assert spaces
    return np.array([sum(c.hits for c in spaces), sum(c.misses for c in spaces),
                     sum(c.dedup_pages for c in spaces), t["host"].hits, t["disk"].hits,
                     t["disk"].promoted_pages])


def _disk_stamps(d, keys: list[bytes]) -> np.ndarray:
    """The disk tier's LRU stamps of its copies of ``keys`` (all on disk), the plane's ends settled."""
    def read() -> np.ndarray:
        d.core.plane.settle_gets()
        cache = d.core.disk.cache
        (part,) = [p for s in cache._spaces.values() for p in s.parts.values()]
        ids = cache.pages.find(part.gid, as_keys(keys))
        assert (ids >= 0).all()
        return cache.pages.stamp[ids].copy()

    return d.run(read)


def _settled(eng: CacheEngine) -> None:
    """A Stats, which the loop answers once it has settled the plane's ends: the loop holds the
    cache's lock no more, and the next call's walk does not meet it (a walk that did would be
    handed to the loop, and the plane's counts below would be one short)."""
    eng.client.stats()


def _host_hits(eng: CacheEngine, keys: list[bytes], rng) -> None:
    """A Get, a Lookup, a Lookup of host memory only and a Put of ``keys``, all in host memory."""
    _settled(eng)
    assert eng.load_checked(keys, rng) == len(keys)
    _settled(eng)
    found = eng.lookup(keys)
    assert (found.pages, found.disk_pages) == (len(keys), 0)
    _settled(eng)
    assert eng.lookup(keys, memory_only=True).pages == len(keys)
    _settled(eng)
    assert eng.put(keys[:10], np.arange(10)).present == 10


def test_with_a_disk_tier_the_plane_serves_host_hits_and_the_loop_reads_the_rest_back(tiered) -> None:
    d = tiered
    rng = np.random.default_rng(5)
    with CacheEngine(d.address, pages=256) as eng, CacheEngine(d.address, pages=256, lane="grpc") as rpc:
        old, new = keys_of("old", 600), keys_of("new", 300)
        store(eng, old, d=d)  # (its first Puts give the engine's gate its part)
        store(eng, new, d=d)
        written(d, 900)
        assert eng.lookup(old[:50]).disk_pages == 50  # the oldest: on disk only

        # Every key in host memory: the plane's, bit exact, counted as the same calls over gRPC
        # count them, and their disk copies made recent as the loop's walk makes them.
        counts, before = _counts(d), _ledger(eng)
        stamps = _disk_stamps(d, new[:40])
        _host_hits(eng, new[:40], rng)
        assert _counts(d) == (counts[0] + 1, counts[1] + 2, counts[2] + 1), \
            "host memory held every key: the plane serves them"
        assert eng.client.lane.plane_gets and eng.client.lane.gets_on_plane == 1
        on_plane, mid = _disk_stamps(d, new[:40]), _ledger(eng)
        assert (on_plane > stamps).all(), "the plane's hits left their disk copies stale"
        _host_hits(rpc, new[:40], rng)
        assert _counts(d) == (counts[0] + 1, counts[1] + 2, counts[2] + 1)
        assert (_disk_stamps(d, new[:40]) > on_plane).all()
        assert list(mid - before) == list(_ledger(eng) - mid), "the plane counted otherwise than the loop"
        assert (mid - before)[5] == 0  # nothing read back
        # A Lookup of host memory only leaves the disk's order alone, on the plane as on the loop;
        # it asks no tier, so its partial hit is the plane's too.
        stamps = _disk_stamps(d, new[:40])
        assert eng.lookup(new[:40], memory_only=True).pages == 40
        assert rpc.lookup(new[:40], memory_only=True).pages == 40
        assert (_disk_stamps(d, new[:40]) == stamps).all()
        lookups, before = _counts(d)[1], _ledger(eng)
        assert eng.lookup(old[:50], memory_only=True).pages == 0  # (on disk only)
        assert _counts(d)[1] == lookups + 1
        mid = _ledger(eng)
        assert rpc.lookup(old[:50], memory_only=True).pages == 0
        assert list(mid - before) == list(_ledger(eng) - mid) == [0, 50, 0, 0, 0, 0]

        # Keys on disk only, or stored nowhere: the loop's, which counts and reads back the disk's.
        counts = _counts(d)
        found = eng.lookup(old[:50])
        assert (found.pages, found.disk_pages) == (50, 50)
        assert eng.lookup(new[:5] + [b"neverstore"] + new[5:8]).pages == 5
        assert eng.load_checked(old[:50], rng) == 50
        assert eng.load_checked(new[:5] + [b"neverstore"], rng) == 5
        lane = eng.client.lane
        assert (lane.gets_on_plane, lane.gets_on_loop) == (1, 2)
        assert not lane.plane_gets  # two in a row the loop's: the next Get sleeps first
        assert eng.put(new[:3] + [b"storednow!"], np.arange(4)).stored == 1
        assert _counts(d) == counts, "a call with a key host memory lacks was served on the plane"
        t = tiers(eng)
        assert t["disk"].promoted_pages >= 50 and t["disk"].bad_checks == 0

        # Read back, they are host memory's now: the plane serves them.
        written(d, 0)  # (the new key's write behind is over: the loop takes the cache's lock no more)
        _settled(eng)
        assert eng.load_checked(old[:50], rng) == 50
        _settled(eng)
        assert eng.lookup(old[:50]).disk_pages == 0
        assert _counts(d)[:2] == (counts[0] + 1, counts[1] + 1)
        assert lane.plane_gets
    _until(lambda: _readers(d) == (0, 0))  # every hold let go, the plane's and the loop's


def test_with_a_disk_tier_the_plane_answers_a_schedulers_lookups_of_host_hits(tiered) -> None:
    """A scheduler's Lookups of the whole space on its space's lane, in a daemon with a disk tier:
    those whose every key host memory holds are answered on the plane, counted as gRPC counts
    them, their disk copies made recent; one of keys on disk only is the loop's, which counts them."""
    d = tiered
    space = dict(model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=4)
    with CacheEngine(d.address, pages=256) as eng, CacheView(d.address, **space) as v, \
            CacheView(d.address, lane="grpc", **space) as g:
        old, new = keys_of("old", 600), keys_of("new", 300)
        store(eng, old, d=d)
        store(eng, new, d=d)
        written(d, 900)
        assert v.lookup(new[:1]).pages == 1  # the loop's: it gives the lane's gate the space's parts
        _settled(eng)
        space_lookups = d.core.plane.plane_space_lookups
        stamps, before = _disk_stamps(d, new[:40]), _ledger(eng)
        found = v.lookup(new[:40])
        assert (found.pages, found.disk_pages) == (40, 0)
        assert d.core.plane.plane_space_lookups == space_lookups + 1, "host memory held every key"
        on_plane, mid = _disk_stamps(d, new[:40]), _ledger(eng)
        assert (on_plane > stamps).all(), "the plane's hits left their disk copies stale"
        assert g.lookup(new[:40]).pages == 40
        assert (_disk_stamps(d, new[:40]) > on_plane).all()
        assert list(mid - before) == list(_ledger(eng) - mid), "the plane counted otherwise than the loop"
        # On disk only: the loop's, which counts the disk's pages.
        found = v.lookup(old[:50])
        assert (found.pages, found.disk_pages) == (50, 50)
        assert d.core.plane.plane_space_lookups == space_lookups + 1
