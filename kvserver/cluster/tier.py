"""The cluster tier: the node-wide cache shared across nodes through Mooncake Store.

Written through: every page a Put commits is queued (held in host memory, never evicted meanwhile)
and stored in the cluster by a publisher task, in batches, from worker threads: names the cluster
holds already are skipped (first writer wins), the rest go from the arena to this node's segment
with no copy of ours. Past a quarter of host memory queued, pages are not published (``skipped``).

Read on a miss: a Lookup whose prefix ends locally asks the cluster for the rest in one batched
call (``count``); a Get pulls the leading pages the cluster holds into new host pages (``pull``),
which then load to the device as any host page. Local pages always win; the cluster is never asked
about a local hit.

Never a stall: every call runs in a worker thread and is waited for only until its deadline (the
tier's, or the Get's if sooner); a call past it is a miss, and its pages stay being written until
its thread returns (Mooncake cannot cancel a transfer); pages of a pull that failed in transfer
stay out of use for ``QUARANTINE_SECONDS`` more (Mooncake gives up waiting on a transfer after 60 s
without stopping it): only those of a call that ran ``UNSAFE_AFTER_SECONDS`` or more, and whose
page failed in a transfer (not a key the store lacks, nor a master that did not answer: no
transfer then); a dead peer's pages fail in milliseconds and are misses at once. A call
refused because every thread is busy is a miss at once. A failure of
the store itself (its master unreachable or not answering) opens a circuit breaker: no call is
made, every question a miss and the publish queue emptied, until a probe finds the store
answering again. The tier joins the cluster in the background, again after a failed join; until
then it is a miss too.

Primitives: ``ClusterTier`` (``start``, ``deadline``, ``count``, ``pull``, ``publish``, ``close``,
``describe``) and ``ClusterCounters``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvserver.cluster.breaker import Breaker
from kvserver.cluster.names import VERSION, names, part_prefix
from kvserver.cluster.store import NOT_FOUND, RPC_FAILED, RPC_TIMEOUT, JoinError, MooncakeClient
from kvserver.cluster.threads import DaemonThreads
from kvserver.config import format_size
from kvserver.store import Keys, KVCache, Part

logger = logging.getLogger(__name__)

MAX_QUEUED_SHARE = 0.25  # of host memory, at most, held by pages waiting to be published
BATCH_BYTES = 16 << 20  # pages of one put call, at most
MAX_COUNT_NAMES = 16384  # names one question asks about (all parts of a whole-space Lookup)
QUARANTINE_SECONDS = 120.0  # a failed pull's pages stay unused this long (Mooncake waits 60 s)
# A pull that failed sooner than this gave up waiting on no transfer (Mooncake does after its
# transfer timeout, 60 s by default): its pages are free at once. A dead peer fails in milliseconds.
UNSAFE_AFTER_SECONDS = 1.0
_NO_TRANSFER = (NOT_FOUND, RPC_FAILED, RPC_TIMEOUT)  # no transfer was started: nothing can land
PROBE_NAME = f"{VERSION}/.probe"
JOIN_RETRY = 2.0  # seconds between two tries to join, doubled after a failed setup (up to a minute)
_STORE_DOWN = frozenset((RPC_FAILED, RPC_TIMEOUT))  # (isdisjoint: one pass in C over a call's codes)


@dataclass(slots=True)
class ClusterCounters:
    hits: int = 0  # looked-up pages found in the cluster only
    published_pages: int = 0  # pages this node stored in the cluster
    published_bytes: int = 0
    present_pages: int = 0  # pages not published: the cluster held them already
    pulled_pages: int = 0  # pages read from the cluster into host memory
    pulled_bytes: int = 0
    skipped_pages: int = 0  # pages not published: queue full, tier not joined or breaker open
    put_errors: int = 0  # pages whose put failed
    get_errors: int = 0  # pages whose pull failed (or came short): misses
    quarantined_pages: int = 0  # pages of failed pulls kept out of use for QUARANTINE_SECONDS
    timeouts: int = 0  # calls past their deadline
    busy: int = 0  # calls refused because every worker thread was busy: misses
    joins: int = 0  # times the tier joined the cluster
    put_seconds: float = 0.0
    get_seconds: float = 0.0


class ClusterTier:
    """The cluster tier of the host cache ``host`` (its arena at ``host_base()``, ``arena_bytes``
    long), through ``client``. ``timeout``: seconds a Lookup or a Get waits for the cluster."""

    def __init__(self, client: MooncakeClient, host: KVCache, host_base: Callable[[], int],
                 arena_bytes: int, *, timeout: float = 1.0, threads: int = 4) -> None:
        self.client = client
        self.host = host
        self._base = host_base
        self._arena_bytes = arena_bytes
        self.timeout = timeout
        self.counters = ClusterCounters()
        self.breaker = Breaker()
        self.joined = False
        self._threads = threads
        # Questions (which names are stored) touch no memory of ours: threads the exit leaves
        # behind. Pulls and puts move arena pages: threads the close waits for. Pulls have threads
        # of their own: a Get never queues behind the publisher.
        self._ask_threads = DaemonThreads(threads, "kvserver-cluster-ask")
        self._pull_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvserver-cluster-pull")
        self._put_pool = ThreadPoolExecutor(2, thread_name_prefix="kvserver-cluster-put")
        self._asking = 0  # questions in threads now
        self._pulling = 0  # pulls in threads now
        self._probing: asyncio.Future | None = None
        self._prefixes: dict[tuple, str] = {}
        self._queue: deque[tuple[Part, np.ndarray, Keys]] = deque()
        self._queued_bytes = 0
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._moving: set[asyncio.Future] = set()  # pulls and puts: they use arena pages
        self._closed = False
        self._lock = threading.Lock()  # between closing and a join that ends meanwhile
        self._joining = False  # a join is in its thread now (under the lock)
        # Told of pages this node stored in the cluster (KV events: the cluster's evictions are
        # its master's, and not observed here).
        self.on_published: Callable[[Part, Keys], None] | None = None

    @property
    def ready(self) -> bool:
        """Whether calls are made now: joined, and the breaker closed."""
        return self.joined and not self._closed and self.breaker.allow()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def deadline(self, deadline: float = 0.0) -> float:
        """The loop time by which a call made now must be over: the tier's timeout from now, or
        ``deadline`` (a Get's, 0: none) if sooner."""
        until = asyncio.get_running_loop().time() + self.timeout
        return min(until, deadline) if deadline else until

    def _prefix(self, part: Part) -> str:
        k = (part.space.key, part.key)
        p = self._prefixes.get(k)
        if p is None:
            if len(self._prefixes) > 4096:
                self._prefixes.clear()
            p = self._prefixes[k] = part_prefix(part)
        return p

    def _store_down(self, codes: list[int], epoch: int) -> bool:
        """Whether the codes say the store's master was unreachable or silent (the breaker then
        opens, unless the call predates its last closing)."""
        if not _STORE_DOWN.isdisjoint(codes):
            self._trip(epoch)
            return True
        return False

    def _trip(self, epoch: int) -> None:
        if self.breaker.failed(epoch):
            self._drop_queue()
        self._start_probe()

    # ---- questions and pulls --------------------------------------------------------------

    async def count(self, parts: list[Part], keys: Keys, deadline: float = 0.0, hits: bool = True) -> int:
        """How many leading ``keys`` the cluster holds in every one of ``parts``; 0 whenever it
        cannot say by ``deadline`` (loop time; 0: the tier's timeout from now). ``hits``: a
        Lookup's question (counted as hits)."""
        if not self.ready or not len(keys) or not parts:
            return 0
        if self._asking >= self._threads:
            self.counters.busy += 1
            return 0
        loop = asyncio.get_running_loop()
        own = loop.time() + self.timeout
        until = min(own, deadline) if deadline else own
        keys = keys[: max(1, MAX_COUNT_NAMES // len(parts))]
        prefixes = [self._prefix(p) for p in parts]
        epoch = self.breaker.epoch

        def ask() -> list[int]:
            return self.client.exists([n for prefix in prefixes for n in names(prefix, keys)])

        self._asking += 1
        fut = self._ask_threads.submit(ask)
        # The question itself says whether the store is down, whoever still waits for it (a
        # Lookup or Get may give up sooner than the tier's timeout): unanswered by then, or its
        # codes once it ends.
        overdue = loop.call_at(own, self._overdue, fut, epoch)
        fut.add_done_callback(functools.partial(self._asked, overdue, epoch))
        try:
            codes = await asyncio.wait_for(asyncio.shield(fut), max(0.0, until - loop.time()))
        except TimeoutError:
            self.counters.timeouts += 1
            return 0
        except Exception as exc:
            logger.warning("a question to the cluster failed: %s", exc)
            return 0
        if len(codes) != len(parts) * len(keys) or not _STORE_DOWN.isdisjoint(codes):  # (_asked trips it)
            return 0
        there = (np.asarray(codes, np.int64) == 1).reshape(len(parts), len(keys)).all(axis=0)
        m = int(np.argmin(there)) if not there.all() else len(keys)
        if hits:
            self.counters.hits += m
        return m

    def _overdue(self, fut: asyncio.Future, epoch: int) -> None:
        """A question still unanswered at the tier's timeout: the store does not answer."""
        if not fut.done():
            self._trip(epoch)

    def _asked(self, overdue: asyncio.TimerHandle, epoch: int, fut: asyncio.Future) -> None:
        """A question ended (on the loop): its codes may say the store is down."""
        self._asking -= 1
        overdue.cancel()
        if not fut.cancelled() and fut.exception() is None:
            self._store_down(fut.result(), epoch)

    async def pull(self, part: Part, keys: Keys, host_offsets: np.ndarray, deadline: float,
                   on_settled: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Reads the cluster's pages of ``keys`` of ``part`` into the host pages at
        ``host_offsets`` (being written, of the arena), waiting until ``deadline`` (loop time).
        Once the thread has returned, whatever became of this wait, calls ``on_settled(ok,
        unsafe)`` on the loop: ``ok`` marks the pages read whole, ``unsafe`` those whose transfer
        failed and may still land (they must stay out of use a while). It is called exactly once,
        at once if nothing was started."""
        nbytes, n = part.key.page_bytes, len(keys)
        nothing = np.zeros(n, bool)
        if not self.ready or asyncio.get_running_loop().time() >= deadline:
            on_settled(nothing, nothing)
            return
        if self._pulling >= self._threads:
            self.counters.busy += 1
            on_settled(nothing, nothing)
            return
        prefix = self._prefix(part)
        addresses = (host_offsets.astype(np.int64) + self._base()).tolist()
        epoch = self.breaker.epoch

        def read() -> tuple[list[int], float]:
            t0 = time.perf_counter()
            got = self.client.get(names(prefix, keys), addresses, nbytes)
            return got, time.perf_counter() - t0

        def settled(f: asyncio.Future) -> None:
            self._pulling -= 1
            self._moving.discard(f)
            ok, unsafe = nothing.copy(), np.ones(n, bool)  # a failed thread: nothing known
            try:
                if not f.cancelled() and f.exception() is None:
                    got, seconds = f.result()
                    if len(got) == n:
                        codes = np.asarray(got, np.int64)
                        ok = codes == nbytes
                        # Only a transfer Mooncake stopped waiting on may still land.
                        unsafe = (~ok & ~np.isin(codes, _NO_TRANSFER) if seconds >= UNSAFE_AFTER_SECONDS
                                  else nothing.copy())
                    self.counters.get_seconds += seconds
                    if not ok.all():
                        logger.debug("%d of %d cluster pages did not come (%s)", n - int(ok.sum()), n,
                                     sorted({c for c in got if c != nbytes}))
                        self._store_down(list(got), epoch)
                else:
                    logger.warning("a pull from the cluster failed: %s",
                                   None if f.cancelled() else f.exception())
            finally:
                good = int(np.count_nonzero(ok))
                c = self.counters
                c.pulled_pages += good
                c.pulled_bytes += good * nbytes
                c.get_errors += n - good
                c.quarantined_pages += int(np.count_nonzero(unsafe))
                on_settled(ok, unsafe)

        self._pulling += 1
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pull_pool, read)
        except BaseException:
            self._pulling -= 1
            on_settled(nothing, nothing)
            raise
        self._moving.add(fut)
        fut.add_done_callback(settled)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - loop.time()))
        except TimeoutError:  # a slow transfer is not the store's failure: no breaker here
            self.counters.timeouts += 1
        except Exception:
            pass  # settled has counted it

    # ---- publishing -------------------------------------------------------------------------

    def publish(self, part: Part, ids: np.ndarray) -> None:
        """Queues host pages just committed in ``part`` to be stored in the cluster, held (never
        evicted) until then. Those past the queue's bound (one batch at least when it is empty),
        or all while the tier cannot publish, are skipped."""
        if self._closed or not len(ids):
            return
        if not self.ready:
            self.counters.skipped_pages += len(ids)
            return
        page = part.key.page_bytes
        room = int((self.host.arena.capacity * MAX_QUEUED_SHARE - self._queued_bytes) // page)
        if not self._queue:
            room = max(room, BATCH_BYTES // page, 1)
        if room < len(ids):
            self.counters.skipped_pages += len(ids) - max(room, 0)
            ids = ids[: max(room, 0)]
            if not len(ids):
                return
        self.host.hold(ids)
        self._queue.append((part, ids.copy(), self.host.pages.keys_of(ids)))
        self._queued_bytes += len(ids) * page
        if self._wake is not None:
            self._wake.set()

    def _unqueue(self, part: Part, ids: np.ndarray) -> None:
        self.host.hold(ids, -1)
        self._queued_bytes -= len(ids) * part.key.page_bytes

    def _drop_queue(self) -> None:
        """Lets go of every queued page (the store does not answer: they are not held for it)."""
        while self._queue:
            part, ids, _ = self._queue.popleft()
            self.counters.skipped_pages += len(ids)
            self._unqueue(part, ids)

    async def _publisher(self) -> None:
        """Stores what is queued, a batch at a time, two batches in flight at most."""
        assert self._wake is not None
        slots = asyncio.Semaphore(2)
        while not self._closed:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            await slots.acquire()
            if self._closed or not self._queue:
                slots.release()
                continue
            part, ids, keys = self._take_batch()
            if not self.ready:  # the breaker opened meanwhile: not held for seconds
                self.counters.skipped_pages += len(ids)
                self._unqueue(part, ids)
                slots.release()
                continue
            try:
                fut = self._put(part, ids, keys)
            except Exception:
                logger.exception("storing %d pages in the cluster could not start", len(ids))
                self.counters.put_errors += len(ids)
                self._unqueue(part, ids)
                slots.release()
                continue
            fut.add_done_callback(lambda _: slots.release())

    def _take_batch(self) -> tuple[Part, np.ndarray, Keys]:
        part, ids, keys = self._queue.popleft()
        per = max(1, BATCH_BYTES // part.key.page_bytes)
        if len(ids) > per:
            self._queue.appendleft((part, ids[per:], keys[per:]))
            ids, keys = ids[:per], keys[:per]
        return part, ids, keys

    def _put(self, part: Part, ids: np.ndarray, keys: Keys) -> asyncio.Future:
        """Stores the held host pages ``ids`` of ``part`` (still holding ``keys``) that the cluster
        does not hold; they are let go once the thread has returned."""
        loop = asyncio.get_running_loop()
        nbytes = part.key.page_bytes
        prefix = self._prefix(part)
        addresses = (self.host.pages.offset[ids].astype(np.int64) + self._base()).tolist()
        epoch = self.breaker.epoch

        def store() -> tuple[int, int, int, list[int], list[int], float]:
            t0 = time.perf_counter()
            all_names = names(prefix, keys)
            there = self.client.exists(all_names)
            if len(there) != len(all_names) or min(there, default=0) < 0:  # no answer: no put
                return 0, 0, len(all_names), list(there), [], time.perf_counter() - t0
            todo = [i for i, c in enumerate(there) if c != 1]
            codes: list[int] = []
            if todo:
                codes = self.client.put([all_names[i] for i in todo], [addresses[i] for i in todo], nbytes)
            new = [i for i, c in zip(todo, codes, strict=False) if c == 0]
            stored = len(new)
            return stored, len(there) - len(todo), len(todo) - stored, codes, new, time.perf_counter() - t0

        fut = loop.run_in_executor(self._put_pool, store)
        self._moving.add(fut)

        def settled(f: asyncio.Future) -> None:
            self._moving.discard(f)
            try:
                c = self.counters
                if f.cancelled() or f.exception() is not None:
                    c.put_errors += len(ids)
                    logger.warning("storing %d pages in the cluster failed: %s", len(ids),
                                   None if f.cancelled() else f.exception())
                    return
                stored, present, failed, codes, new, seconds = f.result()
                if new and self.on_published is not None:  # the cluster holds them now
                    self.on_published(part, keys.take(np.asarray(new, np.int64)))
                c.published_pages += stored
                c.published_bytes += stored * nbytes
                c.present_pages += present
                c.put_errors += failed
                c.put_seconds += seconds
                if failed:
                    logger.debug("%d of %d pages were not stored in the cluster (%s)", failed, len(ids),
                                 sorted({x for x in codes if x < 0}))
                    self._store_down(codes, epoch)
            finally:
                self._unqueue(part, ids)

        fut.add_done_callback(settled)
        return fut

    # ---- joining and probing ------------------------------------------------------------------

    def start(self) -> None:
        """Starts joining the cluster (in the background) and the publisher. On the loop."""
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._join()))
        self._tasks.append(loop.create_task(self._publisher()))

    async def _join(self) -> None:
        """Joins the cluster, trying again while it cannot. A join blocks its thread for as long
        as Mooncake retries an absent master (minutes): it runs in a thread of its own that the
        daemon's exit does not wait for (one of the question threads: no question is asked before
        the tier has joined), and a daemon closed meanwhile leaves the cluster there."""
        wait = JOIN_RETRY
        while not self._closed:
            try:
                await self._ask_threads.submit(self._join_once)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                probed = isinstance(exc, JoinError) and exc.probed  # the master answered, setup failed
                wait = min(60.0, wait * 2) if probed else JOIN_RETRY
                logger.warning("the cluster tier cannot join %s yet (%s); trying again in %.0f s",
                               self.client.master, exc, wait)
                await asyncio.sleep(wait)
                continue
            self.joined = True
            self.counters.joins += 1
            logger.info("the cluster tier joined Mooncake Store at %s as %s", self.client.master,
                        self.client.hostname)
            return

    def _join_once(self) -> None:
        """In a question thread: joins the cluster; if the daemon closed meanwhile, leaves it
        (joined, or half-joined: its registration refused)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the daemon is closing")
            self._joining = True
        try:
            self.client.join(self._base(), self._arena_bytes)
        except BaseException:
            with self._lock:
                self._joining = False
                closed = self._closed
            if closed:  # ``close`` left it to this thread: nothing else will leave
                self.client.close()
            raise
        with self._lock:
            self._joining = False
            if self._closed:  # nothing else will leave
                self.client.close()
                raise RuntimeError("the daemon is closing")

    def _start_probe(self) -> None:
        probing = any(t.get_name() == "cluster-probe" and not t.done() for t in self._tasks)
        if not self._closed and not probing:
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.get_running_loop().create_task(self._probe(), name="cluster-probe"))

    async def _probe(self) -> None:
        """While the breaker is open: asks the store about one name whenever a probe is due (one
        question at a time), closing the breaker once it answers."""
        logger.warning("the cluster store does not answer: cluster lookups are misses until it does")
        while not self._closed and self.breaker.open:
            if not self.breaker.probe_due():
                await asyncio.sleep(0.05)
                continue
            if self._probing is None or self._probing.done():  # a hung question is not asked twice
                self._probing = self._ask_threads.submit(self.client.exists, [PROBE_NAME])
            try:
                codes = await asyncio.wait_for(asyncio.shield(self._probing), self.timeout)
            except Exception:
                codes = None
            if codes and codes[0] >= 0:
                self.breaker.succeeded()
                logger.warning("the cluster store answers again: cluster lookups resume")
            else:
                self.breaker.failed(probe=True)

    async def close(self, grace: float | None = None) -> bool:
        """Stops publishing (what is queued is not), waits for the pulls and puts under way (not
        for questions), leaves. ``grace``: seconds to wait for those and for leaving, at most (a
        hung master holds a Mooncake call 30 s and its leaving twice that); None: as long as they
        take. False if a transfer may still use host memory then: the caller must not unmap it
        (the process's exit frees it; the master's client TTL reaps this node's segment)."""
        with self._lock:
            self._closed = True
            # A half-joined client (its registration refused) leaves here too, unless a join
            # of it is under way (that thread leaves it).
            joined = self.client.open or (self.client.half_open and not self._joining)
        while self._queue:
            part, ids, _ = self._queue.popleft()
            self._unqueue(part, ids)
        if self._wake is not None:
            self._wake.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        end = None if grace is None else loop.time() + grace
        while self._moving:  # a thread's pages are let go only once it is done
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                logger.warning("the cluster's transfers under way did not end within %.0f s of the stop: "
                               "leaving them running, and host memory mapped for them", grace)
                return False
            await asyncio.wait([asyncio.shield(asyncio.gather(*list(self._moving), return_exceptions=True))],
                               timeout=left)
        if joined and end is not None and not await self._answers(max(1.0, end - loop.time())):
            # Leaving holds the interpreter's lock for as long as Mooncake waits on the master
            # (twice 30 s when it hangs): the daemon stops without it, as a killed one would.
            logger.warning("the cluster's master does not answer: this node stops without leaving it, "
                           "and the master reaps it after its client TTL")
            return False
        if joined:
            await loop.run_in_executor(self._put_pool, self.client.close)
        self._ask_threads.shutdown()
        self._pull_pool.shutdown(wait=grace is None)
        self._put_pool.shutdown(wait=grace is None)
        return True

    async def _answers(self, timeout: float) -> bool:
        """Whether the store answers a question about one name within ``timeout`` seconds (asked
        on a thread of its own, which the process's exit does not wait for: Mooncake's calls let
        the interpreter's lock go while they wait)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bool] = loop.create_future()

        def ask() -> None:
            try:
                ok = self.client.exists([PROBE_NAME])[0] not in _STORE_DOWN
            except Exception:
                ok = False
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile: nobody waits)
                loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(ok))

        threading.Thread(target=ask, name="kvserver-cluster-ask", daemon=True).start()
        done, _ = await asyncio.wait([answer], timeout=timeout)
        return bool(done) and answer.result()

    def describe(self) -> str:
        c = self.client
        return (f"cluster tier: Mooncake Store at {c.master} ({c.protocol}, metadata {c.metadata}), "
                f"this node {c.local_host}, contributing {format_size(c.segment_bytes)}")
