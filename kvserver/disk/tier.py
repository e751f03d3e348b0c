"""The disk tier: a second cache index over a local file, written behind the host cache.

Every page a Put commits to the host cache is queued to be written to disk as well (``demote``),
by a writer task whose reads of host memory and writes to the file run in worker threads; a
queued host page is held (never evicted) until its disk copy is written, so that when the host
cache evicts a page its disk copy is there: eviction costs no I/O at the moment a Put needs room.
Past a quarter of host memory queued, pages wait in a backlog, not held, for room in the queue;
a backlog naming more pages than host memory holds (a disk slower than the Puts, or stuck) drops
its oldest entries, which host memory has evicted or soon will (``skipped``).
A Lookup counts the keys the disk holds as hits (``holds``); a Get reads those pages back into
host pages first (``take_steps`` and ``read``, the core's ``_promote``), checking each against the
check written with it, and then loads them to the device as any host page.

The index is a ``KVCache`` of its own over the file's regions (``DiskArena``): its own slabs, its
own LRU (a page read back or written is used), its own quota per tenant (the host's share of host
memory as a share of the disk), its own records, kept in the directory beside the file so that
what was on disk is found again after any restart (``kvserver.store.keep``), with each page's check.

What goes wrong costs misses, never wrong KV and never the daemon: a full disk or a tenant at its
disk quota writes fewer pages (``skipped``); a failed write leaves the page unstored; a failed or
short read, or a check that does not match, drops the disk page and ends the hit there.

Primitives: ``DiskTier`` (``holds``, ``demote``, ``take_steps`` / ``read`` / ``finish``, ``start``,
``close``, ``stats``) and ``DiskCounters``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvserver.config import format_size
from kvserver.disk import io
from kvserver.disk.arena import DiskArena
from kvserver.errors import KVError
from kvserver.host.kept import FORMAT, KeptDir
from kvserver.host.regions import REGION_ALIGN, aligned_capacity
from kvserver.store import GetPlan, Keys, KVCache, Part, PartKey, SpaceKey
from kvserver.store.keep import Recovery, kept_shape, part_identity
from kvserver.store.pages import COMMITTED

logger = logging.getLogger(__name__)

MAX_QUEUED_SHARE = 0.25  # of host memory, at most, held by pages waiting for their disk write
MAX_BACKLOG_SHARE = 1.0  # of host memory, at most, named by pages in the backlog (older: evicted)
REFILL_ENTRIES = 256  # backlog entries looked at per turn of the writer (a turn of the loop)
REFILL_PAGES = 16384  # backlog pages looked up per turn, at most (~1.5 ms of the index; one batch)
DISK_SLAB_BYTES = 32 << 20  # at most; a small disk has slabs of 1/64 of it
PIECE_BYTES = 16 << 20  # one worker thread's share of a read or write
AHEAD_SLABS = 2  # slabs' worth of the file whose blocks the writer takes ahead of time


@dataclass(slots=True)
class DiskCounters:
    hits: int = 0  # looked-up pages found on disk only
    written_pages: int = 0  # pages written behind the host cache
    written_bytes: int = 0
    promoted_pages: int = 0  # pages read back into host memory
    promoted_bytes: int = 0
    skipped_pages: int = 0  # pages with no disk copy: evicted or dropped in the backlog, unwritten at a
    # stop, disk or quota full
    write_errors: int = 0  # pages whose write failed
    read_errors: int = 0  # pages whose read failed (or came short)
    bad_checks: int = 0  # pages read whole whose check did not match: dropped
    write_seconds: float = 0.0  # time the worker threads spent writing
    read_seconds: float = 0.0


class DiskTier:
    """The disk tier under ``host`` (the host cache), in directory ``path``, of ``size`` bytes.
    ``resizable``: the size is a share of the file system, found again at each start: files made
    for another size are adopted at the size they have (a file system's reported size moves)."""

    def __init__(self, path: str, size: int, host: KVCache, host_base: Callable[[], int], *,
                 default_quota: int = 0, quotas: Mapping[str, int] = {},  # noqa: B006
                 threads: int = 8, resizable: bool = False) -> None:
        if io.page_sums is None:
            raise ValueError("the disk tier needs kvserver's compiled copy kernel (_kvcopy) for its checks")

        # Files of another size are adopted if no larger than their file system (a header changed
        # by hand, or corrupted, is not taken at its word).
        def same_kind(found: dict[str, Any]) -> bool:
            cap = found.get("capacity")
            return (resizable and isinstance(cap, int) and REGION_ALIGN <= cap <= _fs_bytes(path)
                    and found == {"format": FORMAT, **kept_shape(cap, "disk")})

        # KeptDirError (another uid's directory, a second daemon): the caller goes on without.
        self.kept = KeptDir(path, kept_shape(aligned_capacity(size), "disk"), same_kind)
        capacity = int(self.kept.shape["capacity"])
        if capacity != aligned_capacity(size):
            logger.info("the disk cache in %s keeps the size it was made with, %s (--disk-size is a "
                        "share of its file system, which reports another size now)", path,
                        format_size(capacity))
        try:
            self._build(capacity, default_quota, quotas)
        except Exception as exc:  # files no check foresaw: started over
            logger.warning("the disk cache in %s cannot be adopted (%s: %s): starting it over",
                           path, type(exc).__name__, exc)
            try:
                self.kept.start_over(f"adopting it failed ({type(exc).__name__}: {exc})")
                capacity = int(self.kept.shape["capacity"])  # (the size asked for, not the one found)
                self._build(capacity, default_quota, quotas)
            except BaseException:
                self.kept.close()
                raise
        self.host = host
        self._base = host_base  # the host arena's address in this process
        self.counters = DiskCounters()
        # Reads have threads of their own: a Get waiting on a read never queues behind writes.
        self._write_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvserver-disk-write")
        self._read_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvserver-disk-read")
        self._threads = threads
        self._queue: deque[tuple[Part, np.ndarray, Keys]] = deque()  # held host pages to write
        self._queued_bytes = 0  # bytes of host pages held for writing: queued or being written
        # Host pages to write once the queue has room, not held: a Put's past the queue's bound,
        # and those a kept host cache holds with no disk copy at start.
        self._backlog: deque[tuple[Part, np.ndarray, Keys]] = deque()
        self._backlog_bytes = 0  # bytes of host pages the backlog names
        self._preparing = 0  # pages of the batches taken from the queue whose disk pages are being taken
        self._wake: asyncio.Event | None = None
        self._inflight: set[asyncio.Future] = set()
        self._writer: asyncio.Task | None = None  # ``run``, started by ``start`` or the first ``demote``
        self._closed = False
        rec = self.recovery
        if rec.reason and self.kept.found:
            logger.warning("%s", rec.line())
        else:
            logger.info("%s", rec.line())

    def _build(self, capacity: int, default_quota: int, quotas: Mapping[str, int]) -> None:
        self.arena = DiskArena(capacity, self.kept)
        slab = max(REGION_ALIGN, min(DISK_SLAB_BYTES, capacity // 64 // REGION_ALIGN * REGION_ALIGN))
        self._slab_bytes = slab
        self.cache = KVCache(self.arena, default_quota=default_quota, quotas=quotas,
                             slab_bytes=slab, sums=True, what="disk cache")
        rec = self.cache.adopt()
        assert rec is not None
        self.recovery: Recovery = rec

    @property
    def path(self) -> str:
        return self.kept.path

    @property
    def queued_bytes(self) -> int:
        """Bytes of host pages waiting for their disk write (or being written), backlog included."""
        return self._queued_bytes + self._backlog_bytes

    @property
    def direct(self) -> bool:
        """Whether the file system does direct I/O (pages of whole blocks then bypass its cache)."""
        return self.arena.direct_fd >= 0

    # Which keys are on disk

    def _part(self, part: Part, create: bool) -> Part | None:
        """The disk's part for a host part (made if ``create``); None if it has none, or one of
        another shape (layers or page size changed under the same space and rank)."""
        key = part.space.key
        space = self.cache.space(key) if create else self.cache.find_space(key)
        if space is None:
            return None
        mine = space.parts.get((part.key.tp_shard, part.key.pp_rank))
        if mine is None:
            if not create:
                return None
            mine = self.cache.part(space, part.key)
        return mine if mine.key == part.key else None

    def part_keys(self, key: SpaceKey) -> list[PartKey]:
        """The parts the disk holds of space ``key`` (a whole-space Lookup needs them all, those
        host memory has no page of included)."""
        space = None if self._closed else self.cache.find_space(key)
        return [p.key for p in space.parts.values()] if space is not None else []

    def holds(self, part: Part, keys: Keys) -> np.ndarray:
        """Mask of ``keys`` whose pages the disk holds for the host part ``part``; those are made
        the disk's most recently used (a hit that a Get may read back soon)."""
        mine = None if self._closed else self._part(part, False)
        if mine is None:
            return np.zeros(len(keys), bool)
        ids = self.cache.pages.find(mine.gid, keys)
        found = (ids >= 0) & (self.cache.pages.state[ids] == COMMITTED)
        self.cache.pages.touch(ids[found])
        return found

    # Writing behind the host cache

    def _limit(self) -> float:
        return self.host.arena.capacity * MAX_QUEUED_SHARE

    def demote(self, part: Part, ids: np.ndarray) -> None:
        """Queues host pages just committed in ``part`` to be written to disk, held (never
        evicted) until written, so that a page leaves host memory only with its disk copy made.
        Past ``MAX_QUEUED_SHARE`` of host memory held so, they wait in the backlog, not held."""
        if self._closed or not len(ids):
            return
        keys = self.host.pages.keys_of(ids)
        if self._backlog or (self._queued_bytes
                             and self._queued_bytes + len(ids) * part.key.page_bytes > self._limit()):
            self._to_backlog(part, ids.copy(), keys)
        else:
            self._enqueue(part, ids.copy(), keys)
        self._start_writer()
        assert self._wake is not None
        self._wake.set()

    def _to_backlog(self, part: Part, ids: np.ndarray, keys: Keys) -> None:
        """Adds host pages to the backlog's end; past ``MAX_BACKLOG_SHARE`` of host memory named
        there, its oldest entries are dropped (skipped): host memory, which evicts its least
        recently used pages first, has let those go or will before their turn comes."""
        self._backlog.append((part, ids, keys))
        self._backlog_bytes += len(ids) * part.key.page_bytes
        bound = self.host.arena.capacity * MAX_BACKLOG_SHARE
        while self._backlog_bytes > bound and len(self._backlog) > 1:
            self._drop_backlog_head(count=True)

    def _drop_backlog_head(self, count: bool) -> tuple[Part, np.ndarray, Keys]:
        part, ids, keys = self._backlog.popleft()
        self._backlog_bytes -= len(ids) * part.key.page_bytes
        if count:
            self.counters.skipped_pages += len(ids)
        return part, ids, keys

    def _enqueue(self, part: Part, ids: np.ndarray, keys: Keys) -> None:
        self.host.hold(ids)
        self._queue.append((part, ids, keys))
        self._queued_bytes += len(ids) * part.key.page_bytes

    def _unqueue(self, part: Part, ids: np.ndarray) -> None:
        """Host pages queued are written (or given up): they may be evicted again."""
        self.host.hold(ids, -1)
        self._queued_bytes -= len(ids) * part.key.page_bytes
        if self._backlog and self._wake is not None:
            self._wake.set()

    def start(self) -> None:
        """Starts the writer, and puts in the backlog the host pages the disk holds no copy of
        (those of a kept host cache adopted at start), least recently used first: from then on
        every host page gets its disk copy unless it is evicted before its turn."""
        h = self.host
        committed = np.flatnonzero(h.pages.state[: h.pages.high] == COMMITTED)
        committed = committed[np.argsort(h.pages.stamp[committed], kind="stable")]
        if len(committed):
            gids = h.pages.part[committed]
            order = np.argsort(gids, kind="stable")
            uniq, first = np.unique(gids[order], return_index=True)
            for gid, ids in zip(uniq.tolist(), np.split(committed[order], first[1:]), strict=True):
                part = h.part_of(gid)
                if part is None:
                    continue
                keys = h.pages.keys_of(ids)
                mine = self._part(part, False)
                if mine is not None:
                    dids = self.cache.pages.find(mine.gid, keys)
                    missing = ~((dids >= 0) & (self.cache.pages.state[dids] == COMMITTED))
                    ids, keys = ids[missing], keys.take(np.flatnonzero(missing))
                if len(ids):
                    self._to_backlog(part, ids, keys)
            if self._backlog:
                logger.info("the disk cache copies %d pages of host memory it does not hold yet",
                            sum(len(ids) for _, ids, _ in self._backlog))
        self._start_writer()

    def _start_writer(self) -> None:
        if self._writer is None:
            self._wake = asyncio.Event()
            self._writer = asyncio.get_running_loop().create_task(self.run())

    def _refill(self) -> bool:
        """Moves backlog pages into the queue while it has room (at least one batch when it is
        empty); those evicted meanwhile have no disk copy: skipped. Looks at ``REFILL_ENTRIES``
        entries and ``REFILL_PAGES`` pages at most (a kept host cache adopted at start is one
        entry of millions of pages); True if it stopped there, backlog and room left (another turn
        goes on)."""
        h = self.host
        budget = REFILL_PAGES
        for _ in range(REFILL_ENTRIES):
            if not self._backlog:
                return False
            if budget <= 0:
                return True
            part, ids, keys = self._backlog[0]
            room = int((self._limit() - self._queued_bytes) // part.key.page_bytes)
            if room <= 0:
                if self._queued_bytes:
                    return False
                room = 1
            room = min(room, budget)
            budget -= min(room, len(ids))
            self._drop_backlog_head(count=False)
            if len(ids) > room:
                self._backlog.appendleft((part, ids[room:], keys[room:]))
                self._backlog_bytes += (len(ids) - room) * part.key.page_bytes
                ids, keys = ids[:room], keys[:room]
            alive = (h.pages.find(part.gid, keys) == ids) & (h.pages.state[ids] == COMMITTED)
            self.counters.skipped_pages += int(np.count_nonzero(~alive))
            if alive.any():
                if not alive.all():
                    ids, keys = ids[alive], keys.take(np.flatnonzero(alive))
                self._enqueue(part, ids, keys)
        return bool(self._backlog)

    async def run(self) -> None:
        """The writer: writes what is queued, ``threads`` batches at a time, until closed."""
        assert self._wake is not None
        slots = asyncio.Semaphore(self._threads)
        while not self._closed:
            more = self._refill() if self._backlog else False
            if not self._queue:
                if more:  # the rest of the backlog at the loop's next turn
                    await asyncio.sleep(0)
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            part, ids, _ = self._queue[0]  # (still queued while blocks are taken: a stop counts it)
            await self._take_ahead(len(ids) * part.key.page_bytes)
            await slots.acquire()
            if self._closed or not self._queue:
                slots.release()
                continue
            part, ids, keys = self._queue.popleft()
            try:
                done = await self._write(part, ids, keys)
            except BaseException as exc:
                self._unqueue(part, ids)
                slots.release()
                if not isinstance(exc, Exception):
                    raise
                logger.exception("the disk cache could not write %d pages", len(ids))
                continue
            if done is None:
                slots.release()
            else:
                done.add_done_callback(lambda _: slots.release())
            if self._backlog:  # one batch of the backlog a turn of the loop: others' calls between
                await asyncio.sleep(0)

    async def _take_ahead(self, nbytes: int) -> None:
        """Takes the blocks of the next slabs' ranges, for ``nbytes`` of pages and ``AHEAD_SLABS``
        slabs more, in a worker thread, so that reserving them costs the loop no ``fallocate``
        (``DiskArena.ahead``)."""
        arena = self.arena
        for start, size in arena.ahead(nbytes + AHEAD_SLABS * self._slab_bytes, self._slab_bytes):
            punches = arena.punches
            took = await asyncio.get_running_loop().run_in_executor(self._write_pool, arena.take_ahead,
                                                                    start, size)
            if not took:
                return
            arena.took_ahead(start, size, punches)

    async def _write(self, part: Part, ids: np.ndarray, keys: Keys) -> asyncio.Future | None:
        """Starts writing the host pages ``ids`` of ``part`` (held since queued: they still hold
        ``keys``); the future settles once their records are written and they are let go. If it
        raises, the caller lets them go."""
        try:
            mine = self._part(part, True)
        except KVError:  # the tenant's disk spaces are at their limit
            mine = None
        if mine is None:
            self.counters.skipped_pages += len(ids)
            self._unqueue(part, ids)
            return None
        self._preparing += len(ids)
        try:
            plan = await _stepped(self.cache.prepare_put_steps(mine, keys))
        finally:
            self._preparing -= len(ids)
        self.counters.skipped_pages += plan.dropped
        if self._closed or not len(plan.page_ids):
            self.cache.complete_put(plan, not self._closed)
            self._unqueue(part, ids)
            return None
        src = ids[plan.positions]
        nbytes = part.key.page_bytes
        seed = io.seeds(keys.words[plan.positions], keys.lens[plan.positions], part_identity(mine))
        fd, direct, base = self.arena.fd, self.arena.direct_fd, self._base()
        host_off, disk_off = self.host.pages.offset[src], plan.offsets

        def args(sl: slice) -> tuple:
            return (io.write_pages, fd, direct, base, host_off[sl], disk_off[sl], nbytes, seed[sl])

        def settled(results: list) -> None:  # on the loop, whatever became of the writer task
            try:
                n = len(plan.page_ids)
                ok = np.concatenate([r[0][0] if r[1] is None else np.zeros(r[3], bool) for r in results])
                checks = np.concatenate([r[0][1] if r[1] is None else np.zeros(r[3], np.uint32)
                                         for r in results])
                for r in results:
                    if r[1] is not None:
                        logger.warning("writing %d pages to the disk cache failed: %s", r[3], r[1])
                self.cache.pages.sum[plan.page_ids[ok]] = checks[ok]  # before the pages count
                self.cache.complete_put(plan, ok)
                good = int(np.count_nonzero(ok))
                c = self.counters
                c.written_pages += good
                c.written_bytes += good * nbytes
                c.write_errors += n - good
                c.write_seconds += sum(r[2] for r in results)
            finally:
                self._unqueue(part, ids)

        return self._pieces(self._write_pool, len(src), nbytes, args, settled)

    def _pieces(self, pool: ThreadPoolExecutor, n: int, nbytes: int, args: Callable[[slice], tuple],
                settled: Callable[[list], None]) -> asyncio.Future:
        """Runs a read or write of ``n`` pages of ``nbytes`` in pieces of ``PIECE_BYTES`` on the
        pool's threads (one piece's check computed while another's I/O waits); once every piece
        is over, calls ``settled`` on the loop with each piece's (result, error, seconds, pages),
        in order. The returned future is done after that; nothing but this settles it, so no
        page is let go while a thread may still use it."""
        loop = asyncio.get_running_loop()
        per = max(1, PIECE_BYTES // nbytes)
        futs = [loop.run_in_executor(pool, _run, min(per, n - i), *args(slice(i, i + per)))
                for i in range(0, n, per)]
        done: asyncio.Future = loop.create_future()
        left = [len(futs)]

        def one(_: asyncio.Future) -> None:
            left[0] -= 1
            if left[0]:
                return
            self._inflight.discard(done)
            try:
                settled([f.result() for f in futs])
            finally:
                done.set_result(None)

        self._inflight.add(done)
        for f in futs:
            f.add_done_callback(one)
        return done

    # Reading back

    def take_steps(self, part: Part, keys: Keys) -> Generator[None, None, GetPlan | None]:
        """Marks the disk pages of the leading ``keys`` it holds as being read (``finish`` ends
        that), a step of keys at a time; None if it holds none for the part."""
        mine = None if self._closed else self._part(part, False)
        if mine is None:
            return None
        plan = yield from self.cache.prepare_get_steps(mine, keys)
        if not plan.pages:
            self.cache.complete_get(plan, True)
            return None
        return plan

    def read(self, plan: GetPlan, keys: Keys, positions: np.ndarray, host_offsets: np.ndarray,
             on_settled: Callable[[np.ndarray], None]) -> asyncio.Future:
        """Reads the disk pages of ``plan`` at ``positions`` (of ``keys``, the plan's keys) into
        host pages at ``host_offsets``; once the read is over (whatever became of the caller)
        calls ``on_settled`` with the mask of pages read whole and checked, drops from the disk
        the pages that were not, and ends the plan's reading. The future settles after that.
        RuntimeError, nothing started, once the tier is closing."""
        if self._closed:
            raise RuntimeError("the disk cache is closing")
        ids = plan.page_ids[positions]
        nbytes = plan.part.key.page_bytes
        seed = io.seeds(keys.words[positions], keys.lens[positions], part_identity(plan.part))
        fd, direct, base = self.arena.fd, self.arena.direct_fd, self._base()
        disk_off, expected = self.cache.pages.offset[ids], self.cache.pages.sum[ids].copy()

        def args(sl: slice) -> tuple:
            return (io.read_pages, fd, direct, base, host_offsets[sl], disk_off[sl], nbytes, seed[sl],
                    expected[sl])

        outcome: asyncio.Future = asyncio.get_running_loop().create_future()

        def settled(results: list) -> None:
            n = len(ids)
            ok = np.concatenate([r[0][0] if r[1] is None else np.zeros(r[3], bool) for r in results])
            bad = sum(r[0][1] for r in results if r[1] is None)
            try:
                for r in results:
                    if r[1] is not None:
                        logger.warning("reading %d pages of the disk cache failed: %s", r[3], r[1])
                on_settled(ok)
            finally:
                try:
                    self.finish(plan, ids[~ok])
                finally:
                    good = int(np.count_nonzero(ok))
                    c = self.counters
                    c.promoted_pages += good
                    c.promoted_bytes += good * nbytes
                    c.bad_checks += bad
                    c.read_errors += n - good - bad
                    c.read_seconds += sum(r[2] for r in results)
                    outcome.set_result(ok)

        self._pieces(self._read_pool, len(ids), nbytes, args, settled)
        return outcome

    def finish(self, plan: GetPlan, bad: np.ndarray = np.empty(0, np.int64)) -> None:  # noqa: B008
        """Ends the reading ``take_steps`` marked; the pages of ``bad`` (ids), which could not be
        read or failed their check, are dropped from disk (once no other read holds them)."""
        self.cache.complete_get(plan, True)
        if len(bad):
            self.cache.discard(bad)

    # Stats and the end

    def stats(self) -> tuple[DiskCounters, int, int]:
        """(counters, pages stored, bytes of pages stored)."""
        pages = sum(t.counters.pages for t in self.cache.tenants.by_name.values())
        nbytes = sum(t.counters.bytes for t in self.cache.tenants.by_name.values())
        return replace(self.counters), pages, nbytes

    async def close(self, drain: float = 0.0) -> None:
        """Stops writing and waits for the I/O under way. What is queued or in the backlog is
        written first for up to ``drain`` seconds; what is left then has no disk copy, logged."""
        if drain > 0 and self._writer is not None and not self._writer.done():
            deadline = time.monotonic() + drain
            while (self._queue or self._backlog or self._queued_bytes) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        left = (sum(len(ids) for _, ids, _ in self._queue) + sum(len(ids) for _, ids, _ in self._backlog)
                + self._preparing)  # (a batch between its steps sees the tier closed: not written)
        if left:
            logger.warning("the disk cache stops with %d pages of host memory not written to it "
                           "(queued or in its backlog%s): they have no disk copy", left,
                           f", after {drain:g} s of writing them" if drain > 0 else "")
            self.counters.skipped_pages += left
        self._closed = True
        self._backlog.clear()
        self._backlog_bytes = 0
        while self._queue:
            part, ids, _ = self._queue.popleft()
            self._unqueue(part, ids)
        if self._wake is not None:
            self._wake.set()
        if self._writer is not None:
            try:
                await self._writer
            except Exception:
                logger.exception("the disk cache's writer had failed")
        while self._inflight:  # (shielded: a thread's pages are let go only once it is done)
            await asyncio.shield(asyncio.gather(*list(self._inflight), return_exceptions=True))
        self._write_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        try:
            self.kept.flush()  # the records written back: a reboot after a stop finds them too
        except OSError as exc:
            logger.warning("the disk cache's records in %s were not written back: %s", self.path, exc)
        self.kept.close()

    def describe(self) -> str:
        return (f"disk cache in {self.path}: {format_size(self.arena.capacity)}, "
                f"{'direct' if self.direct else 'buffered'} I/O")


async def _stepped(steps: Generator[None, None, Any]) -> Any:
    """Runs a cache operation's steps, letting the event loop serve others between two."""
    try:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            await asyncio.sleep(0)
    finally:
        steps.close()


def _run(pages: int, fn, *args) -> tuple:
    """In a worker thread: (result, None, seconds, pages), or (None, the error, seconds, pages)."""
    t0 = time.perf_counter()
    try:
        return fn(*args), None, time.perf_counter() - t0, pages
    except Exception as exc:
        return None, exc, time.perf_counter() - t0, pages


def _fs_bytes(path: str) -> int:
    """The size of the file system that holds directory ``path`` (0 if it cannot be told)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize
