"""The copy workers' queues: loads first, large jobs in pieces, both cores for a large job.

An engine waiting on a prefetch is waiting to run attention; an offload only frees device memory
a little sooner. So loads (host to device) and writes (device to host) wait in separate queues and
a free worker always takes a load's piece first. A job is cut into pieces (``Work``): a load that
arrives behind a 1 GiB offload waits for one piece of it, not for all of it. Pieces of a job whose
rows split (``parallel``) run on every idle worker at once; the others run one after another, in
order.

Writes are not starved: once ``WRITE_EVERY`` load pieces in a row have run while a write waited,
the next piece is a write's.

A job is dropped while none of its pieces has started (``Future.cancel`` on its future succeeds,
as with a ``ThreadPoolExecutor``); once started, it ends after its running pieces when
``stopping`` turns true for its next piece.
A work does not start before the works it follows (``ready``, from ``kvserver/copies/order.py``)
have ended: loads go first, but never past a copy of their client they depend on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

WRITE_EVERY = 8
# A piece copies about this much (~0.35 ms at this machine's memcpy speed): what a load may wait
# behind an offload.
CHUNK_BYTES = 2 << 20
# Loads from this size split every layer's rows over all workers, in ranges of at least
# MIN_RANGE_BYTES (below that the hand-offs cost more than a second core gives): on this
# project's 2-vCPU machine two workers copy 256 MiB 1.06-1.2x as fast as one kernel call
# (benchmarks/bench_pieces.py). None: never. Writes never split over workers (they leave a core).
PARALLEL_BYTES: int | None = 8 << 20
MIN_RANGE_BYTES = 1 << 20


@dataclass(eq=False)
class Work:
    """One copy job in ``pieces`` pieces. ``run(i)`` copies piece i in a worker thread;
    ``finish()`` runs once, in the thread of the last piece to end, when every piece has run or
    the work stopped or failed early: what it returns or raises is the future's outcome (a piece's
    error is the outcome instead, and ``finish`` is not called). ``stopping(i)`` is read before
    piece i: once true it does not start, nor any later piece (a work may keep it false for the
    rest of a layer it has begun, so that it stops at a layer boundary). ``ended`` turns true
    (under the queue's lock) once no piece of it runs or will run: what later work of its client
    waits for."""

    load: bool
    pieces: int
    run: Callable[[int], None]
    finish: Callable[[], object] = lambda: None
    parallel: bool = False
    stopping: Callable[[int], bool] = lambda i: False
    # Read before the first piece: false while work it must follow has not ended (kvserver.copies.order).
    ready: Callable[[], bool] = lambda: True
    future: Future = field(default_factory=Future)
    # The queue's bookkeeping, under its lock.
    next: int = 0
    running: int = 0
    error: BaseException | None = None
    ended: bool = False

    @property
    def started(self) -> bool:
        return self.next > 0


def single(load: bool, fn: Callable, *args, ready: Callable[[], bool] | None = None) -> Work:
    """A call as one piece of work: its result is the future's."""
    out: list = []
    work = Work(load, 1, lambda _: out.append(fn(*args)), finish=lambda: out[0])
    if ready is not None:
        work.ready = ready
    return work


class CopyQueue(Executor):
    """``threads`` copy workers over a load queue and a write queue."""

    def __init__(self, threads: int = 1, name: str = "kvcopy") -> None:
        self.threads = threads
        self._cond = threading.Condition()
        self._loads: deque[Work] = deque()
        self._writes: deque[Work] = deque()
        self._loads_in_a_row = 0
        self._loads_running = 0  # load pieces being copied: writes wait for them (the bandwidth)
        self._writes_running = 0
        # Writes leave a worker's core to the event loop and the engines: with every core copying
        # an offload, a prefetch's request waits for the CPU before it even reaches the queue.
        self.write_workers = max(1, threads - 1)
        self._closed = False
        self._workers = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._workers:
            t.start()

    # ---- submitting ---------------------------------------------------------------------------

    def submit_work(self, work: Work) -> Future:
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new copies after shutdown")
            (self._loads if work.load else self._writes).append(work)
            self._cond.notify_all()
        # Cancelled while it waits: work of its client held behind it may go now.
        work.future.add_done_callback(lambda f: f.cancelled() and self._wake())
        return work.future

    def submit(self, fn: Callable, /, *args) -> Future:
        """A plain call, queued as a write (``Executor`` interface)."""
        return self.submit_work(single(False, fn, *args))

    def submit_as(self, load: bool, fn: Callable, /, *args,
                  ready: Callable[[], bool] | None = None) -> Future:
        return self.submit_work(single(load, fn, *args, ready=ready))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def recheck(self) -> None:
        """A copy that ran elsewhere (the data plane's thread) ended: work held behind it may go.
        With nothing queued no worker is woken: each would wake only to take the GIL from the
        event loop and find nothing (on a 2-core machine that made every numpy call of the loop's
        several times slower, the loop taking the GIL back after each)."""
        with self._cond:
            if self._loads or self._writes:
                self._cond.notify_all()

    def depth(self) -> tuple[int, int]:
        """Jobs with pieces not handed to a worker yet: (loads, writes)."""
        with self._cond:
            return tuple(sum(not w.future.cancelled() for w in q) for q in (self._loads, self._writes))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops taking work; the queued work still runs (enqueued copies must end), then the
        workers end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            for t in self._workers:
                t.join()

    # ---- the workers --------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cond:
                got = self._take()
                while got is None:
                    if self._closed and not self._loads and not self._writes:
                        self._cond.notify_all()  # the others may be waiting for this moment
                        return
                    self._cond.wait()
                    got = self._take()
            work, i = got
            if i < 0:
                self._end(work)
                continue
            try:
                work.run(i)
            except BaseException as exc:  # the work's outcome; the worker goes on
                with self._cond:
                    if work.error is None:
                        work.error = exc
            with self._cond:
                work.running -= 1
                if work.load:
                    self._loads_running -= 1
                    if not self._loads_running:
                        self._cond.notify_all()  # writes may go again
                else:
                    self._writes_running -= 1
                last = work.running == 0 and (work.next == work.pieces or work.error is not None
                                              or work.stopping(work.next))
                if last:
                    self._forget(work)
                elif work.parallel:
                    self._cond.notify()
            if last:
                self._end(work)

    def _take(self) -> tuple[Work, int] | None:
        """The next piece to run (under the lock): (work, piece), or (work, -1) for work that
        ended before its next piece (to finish outside the lock), or None."""
        writes_ok = self._writes_running < self.write_workers
        queues = (self._loads, self._writes)
        if self._writes and writes_ok and self._loads_in_a_row >= WRITE_EVERY:
            queues = (self._writes, self._loads)
        elif self._loads_running or not writes_ok:
            queues = (self._loads,)  # a load is copying (no write competes for the bandwidth)
        for q in queues:
            for work in list(q):
                if not work.started:
                    if work.future.cancelled():
                        q.remove(work)  # cancelled while it waited: nothing of it ran
                        continue
                    if not work.ready():
                        continue  # behind an earlier copy of its client
                    if not work.future.set_running_or_notify_cancel():
                        q.remove(work)
                        continue
                if work.error is not None or work.stopping(work.next):
                    if work.running == 0:
                        q.remove(work)
                        return work, -1
                    continue  # its last running piece ends it
                if work.running and not work.parallel:
                    continue
                if work.next >= work.pieces:  # no pieces at all
                    q.remove(work)
                    return work, -1
                i = work.next
                work.next += 1
                work.running += 1
                if work.next == work.pieces:
                    q.remove(work)  # nothing more to hand out; its running pieces end it
                if q is self._loads:
                    self._loads_in_a_row = self._loads_in_a_row + 1 if self._writes else 0
                    self._loads_running += 1
                else:
                    self._loads_in_a_row = 0
                    self._writes_running += 1
                return work, i
        return None

    def _forget(self, work: Work) -> None:
        for q in (self._loads, self._writes):
            if work in q:
                q.remove(work)

    def _end(self, work: Work) -> None:
        """Settles the work's future, then wakes the workers: work held behind it may go."""
        if work.error is not None:
            work.future.set_exception(work.error)
        else:
            try:
                result = work.finish()
            except BaseException as exc:
                work.future.set_exception(exc)
            else:
                work.future.set_result(result)
        with self._cond:
            work.ended = True
            self._cond.notify_all()
