"""The disk tier's bounds when the disk falls behind or its files lie: a backlog that names no more
pages than host memory holds and is walked a bounded turn at a time, a clean stop that writes what
is queued within its grace (and says what it could not), and a header whose capacity no file
system could hold, which is started over at the size asked for (docs/design.md, "The disk tier")."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time

from test_disk_tier import MiB, keys_of

from kvserver.core.kvcore import KVCore
from kvserver.disk import io
from kvserver.disk import tier as disk_tier
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys
from kvserver.store.keep import kept_shape
from kvserver.store.spaces import PartKey, SpaceKey

PAGE = 32 * 1024
SPACE = SpaceKey("t", "m", KVLayout.mha(2, 64), dtype_named("float16"), 16, 4, 1, 1)


def stuck_writes(monkeypatch) -> threading.Event:
    """Disk writes wait until the event returned is set (a device stuck, a server gone)."""
    gate = threading.Event()
    real = io.write_pages

    def stuck(*args):
        gate.wait(60)
        return real(*args)

    monkeypatch.setattr(io, "write_pages", stuck)
    return gate


def part_of(core: KVCore, space: SpaceKey = SPACE):
    """The space's one part (all 4 layers, pages of PAGE bytes) in the core's host cache."""
    return core.cache.part(core.cache.space(space), PartKey(0, 0, 0, 4, PAGE))


def put(core: KVCore, part, prefix: str, n: int) -> int:
    """Commits ``n`` new pages in ``part`` and queues them for the disk, as a Put does."""
    c = core.cache
    keys = Keys.of(keys_of(prefix, n))
    c.complete_put(c.prepare_put(part, keys), True)
    ids = c.pages.find(part.gid, keys)
    ids = ids[ids >= 0]
    core.disk.demote(part, ids)
    return len(ids)


def test_a_stuck_disk_s_backlog_names_no_more_than_host_memory_holds(tmp_path, monkeypatch):
    gate = stuck_writes(monkeypatch)

    async def body() -> None:
        core = KVCore(16 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        try:
            d = core.disk
            part = part_of(core)
            committed = 0
            for r in range(100):  # 100 Puts of 64 pages: 200 MiB through 16 MiB of host memory
                committed += put(core, part, f"p{r}-", 64)
                await asyncio.sleep(0)
            named = sum(len(ids) for _, ids, _ in d._backlog) * PAGE
            assert named <= core.arena.capacity, (named, core.arena.capacity)
            assert d.queued_bytes <= core.arena.capacity * (1 + disk_tier.MAX_QUEUED_SHARE)
            # What the backlog let go of is counted, not lost silently.
            queued = sum(len(ids) for _, ids, _ in d._queue) + sum(len(ids) for _, ids, _ in d._backlog)
            assert d.counters.skipped_pages >= committed - queued - core.arena.capacity // PAGE
            assert d.counters.skipped_pages > 0
        finally:
            gate.set()
            await core.close()

    asyncio.run(body())


def test_a_long_backlog_is_walked_a_bounded_turn_at_a_time(tmp_path, monkeypatch):
    """Every entry of a backlog of evicted pages is looked at, a few per turn of the loop, while
    another task keeps its turns; none of its pages is written."""
    monkeypatch.setattr(disk_tier, "REFILL_ENTRIES", 4)
    gate = stuck_writes(monkeypatch)

    async def body() -> None:
        core = KVCore(16 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        try:
            c, d = core.cache, core.disk
            part = part_of(core)
            other = part_of(core, dataclasses.replace(SPACE, tenant="u"))
            put(core, other, "first-", 128)  # 4 MiB queued, stuck: the next Puts go to the backlog
            for r in range(200):
                put(core, part, f"b{r}-", 1)
            entries = len(d._backlog)
            assert entries >= 150
            c.evict_all()  # the backlog's pages are gone from host memory
            gate.set()
            turns, longest = 0, 0
            while d._backlog:
                before = len(d._backlog)
                await asyncio.sleep(0)
                turns += 1
                longest = max(longest, before - len(d._backlog))
                assert turns < 10_000
            assert longest <= 4 and turns >= entries // 4
            assert d.counters.skipped_pages >= entries
        finally:
            gate.set()
            await core.close()

    asyncio.run(body())


def test_a_clean_stop_writes_what_is_queued_within_its_grace(tmp_path, monkeypatch):
    real = io.write_pages
    late = threading.Event()

    def slow(*args):  # a disk behind the Puts when the stop comes
        late.wait(0.05)
        return real(*args)

    monkeypatch.setattr(io, "write_pages", slow)
    path = str(tmp_path / "disk")

    async def fill(drain: float) -> tuple[int, int, int]:
        core = KVCore(16 * MiB, disk_cache=path, disk_size=128 * MiB)
        d = core.disk
        part = part_of(core)
        n = sum([put(core, part, f"s{r}-", 32) for r in range(12)])  # 12 MiB: queue and backlog
        await core.close(drain)
        return n, d.counters.written_pages, d.counters.skipped_pages

    async def found() -> int:
        core = KVCore(16 * MiB, disk_cache=path, disk_size=128 * MiB)
        try:
            return core.disk.recovery.adopted_pages
        finally:
            await core.close()

    n, written, skipped = asyncio.run(fill(30.0))
    assert (written, skipped) == (n, 0)
    assert asyncio.run(found()) == n


def test_a_stop_without_grace_says_how_many_pages_have_no_disk_copy(tmp_path, monkeypatch, caplog):
    gate = stuck_writes(monkeypatch)

    async def body() -> tuple[int, int]:
        core = KVCore(16 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        d = core.disk
        part = part_of(core)
        put(core, part, "a-", 64)
        await asyncio.sleep(0.05)  # the writer takes its batches: they wait on the disk
        put(core, part, "b-", 64)
        waiting = sum(len(ids) for _, ids, _ in d._queue) + sum(len(ids) for _, ids, _ in d._backlog)
        gate.set()
        with caplog.at_level(logging.WARNING, logger="kvserver.disk.tier"):
            await core.close(0.0)
        return waiting, d.counters.skipped_pages

    waiting, skipped = asyncio.run(body())
    assert waiting > 0 and skipped == waiting
    assert any(f"stops with {waiting} pages" in r.getMessage() for r in caplog.records)


def test_a_header_with_a_capacity_past_its_file_system_starts_over_at_the_size_asked(tmp_path, caplog):
    path = tmp_path / "disk"

    async def start() -> tuple[bool, int]:
        core = KVCore(16 * MiB, disk_cache=str(path), disk_size=64 * MiB, disk_size_share=True)
        try:
            return core.disk is not None, core.disk.arena.capacity if core.disk else 0
        finally:
            await core.close()

    assert asyncio.run(start()) == (True, 64 * MiB)
    header = path / "format.json"
    for capacity in (10**20, 1 << 62):  # past any file system; past what a file may hold
        found = json.loads(header.read_text())
        header.write_text(json.dumps({"format": found["format"], **kept_shape(capacity, "disk")}))
        with caplog.at_level(logging.WARNING):
            assert asyncio.run(start()) == (True, 64 * MiB)
        assert any("starts empty" in r.getMessage() for r in caplog.records)



def test_a_stop_counts_the_batch_the_writer_was_taking_disk_pages_for(tmp_path, caplog):
    """The writer takes a batch's disk pages in steps of keys; a stop between two steps leaves the
    batch unwritten, and counts and logs it with the rest."""
    n = 1200  # past one step of keys (1024)

    async def body() -> tuple[int, int]:
        core = KVCore(160 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        d = core.disk
        part = part_of(core)
        assert put(core, part, "x-", n) == n
        await asyncio.sleep(0)  # the writer took the batch and waits between two steps
        with caplog.at_level(logging.WARNING, logger="kvserver.disk.tier"):
            await core.close(0.0)
        return d.counters.written_pages, d.counters.skipped_pages

    written, skipped = asyncio.run(body())
    assert written + skipped == n, (written, skipped)
    if skipped:
        assert any(f"stops with {skipped} pages" in r.getMessage() for r in caplog.records)


def test_the_writer_takes_the_blocks_of_the_next_slabs_off_the_event_loop(tmp_path, monkeypatch):
    """A disk slab's fallocate ran on the event loop as the slab was reserved: it waits on the file
    system's journal, which the tier's own writes keep busy (up to 100 ms on ext4 here, eight
    writer threads running). The writer takes the next slabs' blocks ahead in a worker thread;
    the slabs reserved over them take none on the loop."""
    from kvserver.host.kept import KeptDir

    on_loop: list[int] = []
    ahead: list[int] = []
    real = KeptDir.allocate

    def allocate(self, name, start, nbytes):
        if name == "data":  # (the page tables' own files grow on the loop: a few bytes a page)
            (on_loop if threading.current_thread() is threading.main_thread() else ahead).append(nbytes)
        return real(self, name, start, nbytes)

    monkeypatch.setattr(KeptDir, "allocate", allocate)

    async def body() -> None:
        core = KVCore(64 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=256 * MiB)
        try:
            d = core.disk
            part = part_of(core)
            before = len(on_loop)  # (the files' own, at the start)
            for r in range(24):  # 24 MiB a round, 576 MiB in all: the disk's slabs all made
                put(core, part, f"a{r}-", 768)
                while d.queued_bytes or d._backlog:
                    await asyncio.sleep(0.01)
            assert d.counters.written_pages > 0 and d.cache.slabs.bytes >= d.arena.capacity // 2
            assert len(on_loop) == before, f"{len(on_loop) - before} fallocates on the loop"
            assert sum(ahead) >= d.cache.slabs.bytes
        finally:
            await core.close()

    asyncio.run(body())


def test_a_backlog_entry_of_many_pages_is_taken_a_bounded_number_of_pages_a_turn(tmp_path, monkeypatch):
    """A kept host cache adopted at start is one backlog entry of every page it holds: a turn of
    the writer looked up as many as a quarter of host memory holds at once (3.7 M pages of 1 KiB:
    the loop held 280-350 ms). A turn now takes at most ``REFILL_PAGES`` of it."""
    monkeypatch.setattr(disk_tier, "REFILL_PAGES", 16)
    gate = stuck_writes(monkeypatch)

    async def body() -> None:
        core = KVCore(16 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        try:
            d = core.disk
            part = part_of(core)
            put(core, part, "first-", 128)  # 4 MiB queued, stuck: the next Put goes to the backlog
            put(core, part, "big-", 256)
            assert len(d._backlog) == 1 and len(d._backlog[0][1]) == 256
            gate.set()
            longest, turns = 0, 0
            while d._backlog:
                before = sum(len(ids) for _, ids, _ in d._backlog)
                await asyncio.sleep(0)
                longest = max(longest, before - sum(len(ids) for _, ids, _ in d._backlog))
                turns += 1
                assert turns < 10_000
            assert longest <= 16 and turns >= 256 // 16
            while d.queued_bytes:
                await asyncio.sleep(0.01)
            assert d.counters.written_pages == 128 + 256
        finally:
            gate.set()
            await core.close()

    asyncio.run(body())


def test_a_full_file_system_pauses_taking_blocks_ahead_then_it_is_tried_again(tmp_path, monkeypatch):
    """A take ahead that met a full file system turned taking blocks ahead off for the daemon's
    life (every slab's fallocate on the loop again, even once room came back): it pauses for
    ``FULL_PAUSE_SECONDS`` and is tried again."""
    from kvserver.disk import arena as disk_arena
    from kvserver.host.kept import KeptDir

    full = [True]
    real = KeptDir.allocate

    def allocate(self, name, start, nbytes):
        return False if full[0] and name == "data" else real(self, name, start, nbytes)

    monkeypatch.setattr(KeptDir, "allocate", allocate)

    async def body() -> None:
        core = KVCore(16 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=128 * MiB)
        try:
            a = core.disk.arena
            slab = core.disk._slab_bytes
            (start, size), *_ = a.ahead(slab, slab)
            assert not a.take_ahead(start, size)  # the file system is full
            assert a.ahead(slab, slab) == []  # paused
            assert a.full_until >= time.monotonic() + disk_arena.FULL_PAUSE_SECONDS - 5
            full[0] = False  # room again
            a.full_until = time.monotonic() - 1  # (the pause over)
            (start, size), *_ = a.ahead(slab, slab)
            assert a.take_ahead(start, size)
        finally:
            await core.close()

    asyncio.run(body())
