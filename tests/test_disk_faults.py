"""The disk tier under faults and races: Gets racing for the same read-back, a read past its Get's
deadline, a file system that cannot punch holes or take direct I/O, a bad page two reads hold, the
backlog a kept host cache brings, a size given as a share, a daemon without the compiled check.
Each costs misses or nothing, never wrong KV, never a stuck call, never the daemon."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import threading
import time

import numpy as np
import pytest
from cache_engine import CacheEngine
from test_disk_tier import MiB, keys_of, load_checked, store, tiers, written

from kvserver.config import ServerConfig
from kvserver.core.kvcore import KVCore
from kvserver.disk import io
from kvserver.disk.arena import DiskArena
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys
from kvserver.store.keep import kept_shape
from kvserver.store.spaces import PartKey, SpaceKey


def on_disk_only(d, eng: CacheEngine, keys: list[bytes]) -> None:
    """Stores ``keys``, waits for their disk copies, then empties host memory of them."""
    store(eng, keys, d=d)
    written(d, len(keys))
    d.run(lambda: d.core.cache.evict_all())
    assert eng.lookup(keys).disk_pages == len(keys)


def slow_reads(monkeypatch, seconds: float) -> None:
    real = io.read_pages

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(io, "read_pages", slow)


def test_gets_racing_for_one_read_back_both_end_with_it(daemon_factory, tmp_path, monkeypatch):
    """Two engines of one part (an MLA model's ranks) Get the same pages on disk at once: one
    reads them back, the other waits for that read, not for its deadline."""
    d = daemon_factory(host_memory=24 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
    keys = keys_of("race", 60)
    with CacheEngine(d.address, pages=64) as a, CacheEngine(d.address, pages=64) as b:
        on_disk_only(d, a, keys)
        slow_reads(monkeypatch, 0.5)
        got, took = {}, {}

        def get(name: str, eng: CacheEngine) -> None:
            t0 = time.monotonic()
            eng.wipe()
            got[name] = eng.get(keys, np.arange(60))
            took[name] = time.monotonic() - t0

        threads = [threading.Thread(target=get, args=(n, e)) for n, e in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == {"a": 60, "b": 60}, got
        assert max(took.values()) < 2.5, took  # not the 5 s deadline
        assert a.wrong(keys, np.arange(60)) == [] and b.wrong(keys, np.arange(60)) == []


def test_a_read_back_past_the_gets_deadline_is_a_miss_then_a_hit(daemon_factory, tmp_path, monkeypatch):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
    keys = keys_of("late", 40)
    with CacheEngine(d.address, pages=64, timeout=1.0) as eng:
        on_disk_only(d, eng, keys)
        slow_reads(monkeypatch, 2.0)
        eng.wipe()
        t0 = time.monotonic()
        assert eng.get(keys, np.arange(40)) == 0  # the read is not over by the deadline: a miss
        assert time.monotonic() - t0 < 1.8
        assert eng.zero(np.arange(40))
        deadline = time.monotonic() + 10
        while d.run(lambda: d.core.disk.counters.promoted_pages) < 40:  # the read ends meanwhile
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert eng.lookup(keys).disk_pages == 0  # in host memory now
        assert load_checked(eng, keys, np.random.default_rng(0)) == 40


def test_a_file_system_that_cannot_punch_holes_costs_nothing(daemon_factory, tmp_path, monkeypatch):
    def refuse(self, start, size):
        raise OSError(errno.EOPNOTSUPP, "no hole punching here")

    monkeypatch.setattr(DiskArena, "_punch", refuse)
    d = daemon_factory(host_memory=24 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=24 * MiB)
    rng = np.random.default_rng(1)
    # Two page sizes take turns: the disk's slabs of one are released for the other's.
    with CacheEngine(d.address, pages=256) as a, CacheEngine(d.address, pages=256, page_size=32) as b:
        total = 0
        for round_ in range(6):
            eng = (a, b)[round_ % 2]
            keys = keys_of(f"punch{round_}", 350)
            assert store(eng, keys, d=d) == 350
            total += 350
            written(d, total)
            assert load_checked(eng, keys[-150:], rng) == 150

    def consistent():
        disk, host = d.core.disk, d.core.cache
        slabs = sum(s.nbytes for s in disk.cache.slabs.slabs.values())
        return (disk.arena.reserved == slabs == disk.cache.bytes, int(host.pages.readers.sum()),
                int(disk.cache.pages.readers.sum()), disk.queued_bytes)

    assert d.run(consistent) == (True, 0, 0, 0)
    assert tiers_of(d)["disk"].evicted_pages > 0


def tiers_of(d) -> dict:
    with CacheEngine(d.address, pages=8) as eng:
        return tiers(eng)


def test_direct_io_the_file_system_refuses_goes_through_the_page_cache(daemon_factory, tmp_path, monkeypatch):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
    direct = d.run(lambda: d.core.disk.arena.direct_fd)
    assert direct >= 0

    class Libc:  # as a file system wanting another alignment answers direct I/O
        def __init__(self, real) -> None:
            self.real = real

        def _call(self, fn, fd, *args):
            if fd == direct:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return fn(fd, *args)

        def pwrite(self, *args):
            return self._call(self.real.pwrite, *args)

        def pread(self, *args):
            return self._call(self.real.pread, *args)

    monkeypatch.setattr(io, "_libc", Libc(io._libc))
    keys = keys_of("einval", 300)
    with CacheEngine(d.address, pages=256) as eng:
        on_disk_only(d, eng, keys)
        assert load_checked(eng, keys, np.random.default_rng(2)) == 300
        t = tiers(eng)
        assert t["disk"].write_errors == t["disk"].read_errors == 0


def test_a_bad_page_two_reads_hold_is_dropped_by_the_last(tmp_path):
    async def body() -> None:
        core = KVCore(64 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=64 * MiB)
        try:
            disk, c = core.disk, core.cache
            space = SpaceKey("t", "m", KVLayout.mha(2, 64), dtype_named("float16"), 16, 4, 1, 1)
            part = c.part(c.space(space), PartKey(0, 0, 0, 4, 32 * 1024))
            keys = Keys.of(keys_of("two", 8))
            plan = c.prepare_put(part, keys)
            c.complete_put(plan, True)
            disk.demote(part, plan.page_ids if len(plan.page_ids) else c.pages.find(part.gid, keys))
            while disk.counters.written_pages < 8:
                await asyncio.sleep(0.01)
            one = disk.cache.prepare_get(disk._part(part, False), keys)
            two = disk.cache.prepare_get(disk._part(part, False), keys)
            ids = one.page_ids.copy()
            disk.finish(one, ids)  # the first read found them bad: the second still reads them
            assert disk.holds(part, keys).all() and (disk.cache.pages.readers[ids] == 1).all()
            disk.finish(two, ids)  # the last one lets go: now they are dropped
            assert not disk.holds(part, keys).any()
            p = disk.cache.pages
            assert int(p.readers.sum()) == 0 and int(p.slab_holds.sum()) == 0
        finally:
            await core.close()

    asyncio.run(body())


def test_a_kept_host_caches_pages_get_their_disk_copies_all_of_them(tmp_path):
    """A kept host cache of 400 pages of 40 KiB (their bytes not a divisor of the write queue's
    bound) meets a disk tier at start: every page is written, none skipped."""
    kept = f"/dev/shm/kvserver-test-backlog-{os.getpid()}-{os.urandom(3).hex()}"
    page = 40 * 1024
    space = SpaceKey("t", "m", KVLayout.mha(2, 64), dtype_named("float16"), 16, 4, 1, 1)
    keys = Keys.of(keys_of("backlog", 400))

    async def fill() -> None:
        core = KVCore(24 * MiB, host_memory_dir=kept)
        c = core.cache
        part = c.part(c.space(space), PartKey(0, 0, 0, 4, page))
        plan = c.prepare_put(part, keys)
        assert len(plan.positions) == 400
        c.complete_put(plan, True)
        await core.close()

    async def with_disk() -> tuple[int, int]:
        core = KVCore(24 * MiB, host_memory_dir=kept, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        try:
            assert core.recovery.adopted_pages == 400
            core.start()
            deadline = time.monotonic() + 20
            c = core.disk.counters
            while c.written_pages + c.skipped_pages < 400:
                assert time.monotonic() < deadline, c
                await asyncio.sleep(0.01)
            return c.written_pages, c.skipped_pages
        finally:
            await core.close()

    try:
        asyncio.run(fill())
        assert asyncio.run(with_disk()) == (400, 0)
    finally:
        import shutil

        shutil.rmtree(kept, ignore_errors=True)


def test_a_size_given_as_a_share_keeps_the_size_the_disk_was_made_with(tmp_path, caplog):
    path = str(tmp_path / "disk")
    space = SpaceKey("t", "m", KVLayout.mha(2, 64), dtype_named("float16"), 16, 4, 1, 1)
    keys = Keys.of(keys_of("share", 50))

    async def run(size: int, share: bool, fill: bool) -> tuple[int, int]:
        core = KVCore(64 * MiB, disk_cache=path, disk_size=size, disk_size_share=share)
        try:
            disk, c = core.disk, core.cache
            if fill:
                part = c.part(c.space(space), PartKey(0, 0, 0, 4, 32 * 1024))
                plan = c.prepare_put(part, keys)
                c.complete_put(plan, True)
                disk.demote(part, c.pages.find(part.gid, keys))
                while disk.counters.written_pages < 50:
                    await asyncio.sleep(0.01)
            return disk.arena.capacity, disk.recovery.adopted_pages
        finally:
            await core.close()

    assert asyncio.run(run(64 * MiB, True, True)) == (64 * MiB, 0)
    with caplog.at_level(logging.INFO, logger="kvserver.disk.tier"):
        assert asyncio.run(run(80 * MiB, True, False)) == (64 * MiB, 50)  # the file system "grew"
    assert any("keeps the size it was made with" in r.getMessage() for r in caplog.records)
    assert asyncio.run(run(80 * MiB, False, False)) == (80 * MiB, 0)  # a size asked for: that size


def test_the_host_shape_is_the_one_before_the_disk_tier():
    """A host cache kept by the daemon before the disk tier existed is adopted by this one."""
    assert set(kept_shape(64 * MiB)) == {"capacity", "pages", "slab_record"}
    assert kept_shape(64 * MiB, "disk")["kind"] == "disk"


def test_a_daemon_without_the_compiled_check_serves_without_a_disk(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(io, "page_sums", None)
    with caplog.at_level(logging.ERROR, logger="kvserver.core.kvcore"):
        core = KVCore(32 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=64 * MiB)
    try:
        assert core.disk is None
        assert any("compiled" in r.getMessage() for r in caplog.records)
    finally:
        asyncio.run(core.close())


def test_one_directory_for_both_tiers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="two directories"):
        ServerConfig(socket=str(tmp_path / "s"), host_memory_dir=str(tmp_path / "d"),
                     disk_cache=str(tmp_path / "d"), disk_size=64 * MiB)


def test_a_whole_space_lookup_pins_each_parts_own_pages_in_memory():
    """A key in memory for one TP shard and on disk only for the other: the Lookup counts it and
    pins the first shard's page, which its Get will load from memory."""
    from store_support import make_cache, part_of, space_key

    cache, _, _ = make_cache(capacity=32 * MiB)
    space = cache.space(space_key(tp=2))
    a, b = part_of(cache, space, 0), part_of(cache, space, 1)
    keys = Keys.of([b"k1", b"k2"])
    plan = cache.prepare_put(a, keys)
    cache.complete_put(plan, True)

    def lower(part, ks):  # the disk holds both keys of shard 1 only
        return np.full(len(ks), part is b)

    found = run_steps_of(cache.lookup_steps(space, keys, pin_ms=1000, lower=lower))
    assert (found.pages, found.lower) == (2, 2) and found.lease_id
    assert (cache.pages.pins[cache.pages.find(a.gid, keys)] == 1).all()


def run_steps_of(gen):
    from kvserver.store.steps import run_steps

    return run_steps(gen)


def test_a_reads_back_hold_on_the_hit_never_lands_on_ids_reused_meanwhile(tmp_path, monkeypatch):
    """The host pages a Get found in its first step are evicted while its later steps run, and
    their ids reused by its own read back: it holds the pages as they are then, never the ids it
    saw, so no page ends with fewer holds than it has."""
    from kvserver.core.cache_ops import CacheOps

    async def body() -> None:
        core = KVCore(48 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        try:
            c, disk = core.cache, core.disk
            space = c.space(SpaceKey("t", "m", KVLayout.mha(2, 64), dtype_named("float16"), 16, 4, 1, 1))
            part = c.part(space, PartKey(0, 0, 0, 4, 8192))
            keys = Keys.of(keys_of("stale", 1100))  # two steps of keys
            plan = c.prepare_put(part, keys)
            c.complete_put(plan, True)
            disk.demote(part, c.pages.find(part.gid, keys))
            while disk.counters.written_pages < 1100:
                await asyncio.sleep(0.01)
            c.evict_all()  # host memory empty: everything on disk only
            plan = c.prepare_put(part, keys[:1024])  # the first step's keys in memory again
            c.complete_put(plan, True)
            real = disk.holds
            calls = [0]

            def holds(p, ks):
                calls[0] += 1
                if calls[0] == 1 and p is part:  # between the Get's first and second step
                    c.evict_all()  # its first step's pages go, their ids free for the read back
                return real(p, ks)

            monkeypatch.setattr(disk, "holds", holds)
            ops = CacheOps(core)
            held = await ops._promote(part, keys, 0.0)
            if held is not None:  # the Get lets its hit go once its own marks hold it
                c.hold(held, -1)
            p = c.pages
            assert int(p.readers.min()) == 0 and int(p.slab_holds.min()) == 0
        finally:
            await core.close()

    asyncio.run(body())
