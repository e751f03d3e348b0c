"""Running copies: the copy workers' queues, small copies inline, streamed load progress.

How a job's bytes move is its pool's medium's (``kvserver/media``: the CPU for shared memory, the
GPU for CUDA, ``DevicePool.start``); the copier keeps what is the same for all: queueing,
deadlines, stop words, busy marks and progress.

Copies run on ``copy_threads`` worker threads (``kvserver.copies.workers``): loads before writes, in
arrival order within each, every job in pieces of a few MiB, so that a prefetch an engine waits on
is held up by at most a piece of someone's offload; a large job's pieces use every idle worker.
A CUDA job only takes a worker while it is enqueued on its client's stream; a waiter thread then
waits for the GPU and reports its layers, so engines on other GPUs (or other clients on one GPU)
are not queued behind it. While a copy
runs, its host pages are marked busy, so that a Free or Unregister of those pages waits for it,
and the mark is cleared by the copy's own completion, never by the RPC that asked: a cancelled
call cannot free pages a copy still touches.

A job never outlives what asked for it. Each has a stop word that the copy reads before every
layer: a job whose call ended (deadline, disconnect), whose ``timeout_ms`` passed, or whose client
is being released is dropped if still queued and ends at its next layer boundary if running. Its
call is answered only once the job is dead, so a client told "this load failed" knows the daemon
will not write those slots later. A CUDA job that is already on the GPU cannot be stopped: its
call is answered once the GPU is done with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserver.copies import transfer, workers
from kvserver.copies.job import Job
from kvserver.copies.order import JobOrder, mark
from kvserver.copies.progress import LayerSignal
from kvserver.copies.workers import CopyQueue
from kvserver.core.client_state import ClientState, public_id
from kvserver.errors import UnknownClient
from kvserver.media.base import INLINE

# Copies up to this size run on the event loop when the worker is idle (~50 us at memcpy speed).
INLINE_COPY_BYTES = 256 << 10
PLANE_POLL_SECONDS = 0.0005  # how often a copy waiting on the data plane's copies looks again
# From this size a cache load goes to the copy workers, split over both cores, not to the data
# plane's one thread: 16 and 32 MiB Gets took 0.94-0.98x as long on the plane, 64 MiB ones
# 1.08-1.17x (two daemons side by side, the calls interleaved, on this project's 2-core VM).
SPLIT_LOAD_BYTES = 64 << 20
# Threads that wait for enqueued device copies (one per copy in flight, sleeping in the driver).
DEVICE_WAITERS = 64


@dataclass(frozen=True, slots=True)
class LoadStep:
    """One or more layers landed: every requested layer up to ``last_layer`` (global). A CUDA
    load first yields a step with ``events_recorded`` and no layer done yet."""

    last_layer: int
    layers_done: int
    bytes: int
    events_recorded: bool = False


@dataclass(slots=True, eq=False, init=False)
class ClientJob(Job):
    """A job of a registered client: the copier holds its pages busy, orders it among the client's
    copies and adds it to the client's counters. Its host rows are the client's region pages, or
    ``host_table``'s rows (cache pages in the arena)."""

    client: ClientState
    alone: bool  # run by the data plane's thread for the loop (``run_alone``), not yet ended

    def __init__(self, client: ClientState, plan: transfer.CopyPlan, local_layers: list[int],
                 pages: np.ndarray, ready_event: bytes = b"", event_slot: int = 0, deadline: float = 0.0,
                 host_table: transfer.BufferTable | None = None) -> None:
        # The region's table and views are the client's from Register until its release, which
        # clears them only once no copy of it is in flight (inflight == 0), so reading them now
        # is reading them when the copy runs.
        spec = client.spec
        Job.__init__(self, plan, local_layers, pages, client.host_table, client.host_views,
                     spec.token_bytes * spec.layout.num_parts, ready_event, event_slot, deadline,
                     host_table=host_table)
        self.client = client
        self.alone = False


class Copier:
    def __init__(self, copy_threads: int = 1, progress_interval: float = 0.0) -> None:
        self.progress_interval = progress_interval
        self.queued = 0  # copies handed to the worker and not yet released
        # The compiled data plane (kvserver.lane.plane.DataPlane), where it runs, and the arena's
        # (address, bytes): a cache copy of a client whose plane turn it holds is copied there.
        self.plane: Any = None
        self.arena_span: tuple[int, int] = (0, 0)
        self.alone_copies = 0  # copies run_alone handed to the data plane
        self.alone_inflight = 0  # of those, the ones not ended yet
        self._executor = CopyQueue(copy_threads)
        self._waiters = ThreadPoolExecutor(DEVICE_WAITERS, thread_name_prefix="kvdev-wait")

    def waiting(self) -> tuple[int, int]:
        """Jobs whose pieces the workers have not all taken yet: (loads, writes)."""
        return self._executor.depth()

    async def write(self, job: ClientJob) -> int:
        await _take_turn(job)
        fut = self._submit(job, False, None)  # from here its release ends its turn
        try:
            await _until_done(fut, job)
        finally:
            job.client.jobs.discard(job)
        nbytes = job.bytes_per_layer * len(job.local_layers)
        job.client.counters.bytes_written += nbytes
        job.client.counters.write_ops += 1
        return nbytes

    async def load(self, job: ClientJob) -> AsyncIterator[LoadStep]:
        """Runs the copy in the worker and yields progress as layers land.

        Steps are at least ``progress_interval`` seconds apart (the last one is never held
        back): each message costs both processes CPU time, which on a busy node comes out of
        the copy. A step covers every layer landed since the previous one.
        """
        await _take_turn(job)
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        signal = LayerSignal(self.progress_interval, len(job.local_layers))
        signal.watch(loop, changed)
        try:
            fut = self._submit(job, True, signal)
        except BaseException:
            signal.unwatch(loop)
            signal.release()  # the job's share: it never started
            raise
        start = job.client.spec.layers.start
        total = len(job.local_layers)
        sent, sent_at = 0, -math.inf
        told_recorded = not job.client.device.records_events
        waiter = None
        try:
            while sent < total:
                if fut.done():
                    if fut.exception() is not None and signal.layers_done > sent:
                        # Stopped or failed after some layers: say which landed, then why.
                        sent = signal.layers_done
                        yield LoadStep(start + job.local_layers[sent - 1], sent, sent * job.bytes_per_layer)
                    fut.result()  # raises the worker's error, if any
                if not told_recorded and signal.recorded:
                    told_recorded = True
                    yield LoadStep(0, 0, 0, events_recorded=True)  # no layer yet: layers_done is 0
                done = signal.layers_done
                wait = self.progress_interval - (time.monotonic() - sent_at)
                if done > sent and (done == total or wait <= 0):
                    yield LoadStep(start + job.local_layers[done - 1], done, done * job.bytes_per_layer)
                    sent, sent_at = done, time.monotonic()
                    continue
                changed.clear()
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait({waiter, fut}, timeout=wait if done > sent else None,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            await _until_done(fut, job)
        except BaseException:
            if not fut.done():  # the call ended (its deadline, a disconnect): so does the job
                job.stop("cancelled")
            _forget(fut)
            raise
        finally:
            if waiter is not None:
                waiter.cancel()
            signal.unwatch(loop)
            job.client.jobs.discard(job)
        job.client.counters.bytes_loaded += total * job.bytes_per_layer
        job.client.counters.load_ops += 1

    def _submit(self, job: ClientJob, to_device: bool, signal: LayerSignal | None) -> asyncio.Future[None]:
        """Starts a copy; its pages stay busy (and its signal open) until the worker thread is
        really done with them, even when the RPC that asked for it is cancelled first. The
        future fails with ``JobStopped`` if the job was stopped before its last layer.

        A small copy while no other copy is queued runs right here on the loop: it takes less
        time than handing it to the worker and back would, and still keeps arrival order.
        """
        loop = asyncio.get_running_loop()
        client = job.client
        if client.order is None:
            client.order = JobOrder(client.busy.size, client.device.num_tokens, client.spec.page_size)
        job.after = client.order.admit(job, to_device)
        # (cache jobs: no pages, the cache marks its own)
        mark(client.busy, job.pages, job.dense[0] if job.dense else None, 1)
        client.inflight += 1
        client.jobs.add(job)
        small = job.bytes_per_layer * len(job.local_layers) <= INLINE_COPY_BYTES
        if self.queued == 0 and small and client.device.inline_ok:
            fut = loop.create_future()
            try:
                cf = client.device.start(job, to_device, signal, INLINE, INLINE)
            except BaseException:
                job.queued = None
                self._release(job, None)  # the caller releases the signal: the job never started
                client.jobs.discard(job)
                raise
            job.submitted = True
            job.queued = None
            self._release(job, signal)
            if cf.exception() is not None:
                fut.set_exception(cf.exception())
            else:
                fut.set_result(None)
            _settle(job, cf, loop)
            return fut
        self.queued += 1
        try:
            cf = client.device.start(job, to_device, signal, self._executor, self._waiters,
                                     self._on_plane(job, to_device))
        except BaseException:
            self._release(job, None, True)  # the caller releases the signal: it never started
            client.jobs.discard(job)
            raise
        job.submitted = True
        fut = loop.create_future()
        timer = loop.call_at(job.deadline, job.stop, "deadline") if job.deadline > 0 else None

        def finish(_: Future) -> None:
            if timer is not None:
                timer.cancel()
            job.queued = None
            self._release(job, signal, True)
            _settle(job, cf, loop)
            if fut.done():  # the caller stopped waiting (its task was cancelled)
                return
            if cf.cancelled():  # dropped from the queue: nothing was copied
                fut.set_exception(job.stopped(0))
            elif cf.exception() is not None:
                fut.set_exception(cf.exception())
            else:
                fut.set_result(None)

        cf.add_done_callback(lambda f: loop.call_soon_threadsafe(finish, f))
        return fut

    def alone(self, client: ClientState, answers: bool = False, since: bool = False) -> bool:
        """Whether nothing of ``client`` is in flight besides the one request the data plane handed
        over to the loop: no copy of the loop's or the plane's, no other handed-over request. A
        copy started then has nothing to be ordered behind (``run_alone``). ``answers``: for a
        copy that answers its slot (a Get's), which the plane runs after all of the gate's earlier
        jobs, the plane's own copies of the client may still be running. ``since``: for the copy
        of a request found alone earlier in the same step of the loop (``run_alone``,
        ``copy_now``): requests handed over since then may count too. While that request counts
        in the gate's ``py_inflight`` the plane's thread takes no turn of the registration and
        hands each of its requests over, all later ones, which the loop orders behind this copy
        (an engine putting on one thread while it loads on another hands one over meanwhile)."""
        gate = client.gate
        return (self.plane is not None and gate is not None and not gate.cuda and not client.inflight
                and (answers or not gate.inflight) and not gate.x_inflight
                and (gate.py_inflight >= 1 if since else gate.py_inflight == 1))

    def takes_rows(self, table: Any, page_size: int) -> bool:
        """Whether the data plane copies host rows laid out as ``table`` (a client's cache table)."""
        return self.plane is not None and self.plane.host_rows(table, page_size, self.arena_span) is not None

    def run_alone(self, job: ClientJob, to_device: bool, answer: Any = None) -> Future | None:
        """Has the data plane's thread copy ``job``, which the loop planned for a request the plane
        handed over (a Get's load, a Put's write), with no task or step of the loop in between;
        ``answer`` (a load's): the plane also answers the lane slot it names
        (``kvserver.lane.plane.Answer``) as it answers its own Loads. Only for a request the caller
        found ``alone`` in this step of the loop, while the client still is (``since``), and where
        the plane would copy the job whole (not a load the copy workers split). None: not taken,
        nothing changed. Else the future settles on the loop once the
        copy has ended; ``ended_alone`` then ends the job. (A small answering copy is made at once
        by ``copy_now``, with no job; this path takes those it could not make.)"""
        client = job.client
        if not self.alone(client, answer is not None, since=True) or self._splits(job, to_device):
            return None
        if client.order is None:
            client.order = JobOrder(client.busy.size, client.device.num_tokens, client.spec.page_size)
        job.after = client.order.admit(job, to_device)  # none: nothing is in flight
        client.inflight += 1
        client.jobs.add(job)
        try:
            fut = self.plane.copy(client.gate, job, to_device, None, self.arena_span, self._executor.recheck,
                                  answer)
        except BaseException:
            self.ended_alone(job)
            raise
        if fut is None:
            self.ended_alone(job)
            return None
        job.submitted = True
        job.alone = True
        self.alone_copies += 1
        self.alone_inflight += 1
        return fut

    def copy_now(self, client: ClientState, offsets: np.ndarray, device_pages: np.ndarray,
                 local_layers: list[int], host_table: Any, answer: Any) -> int:
        """A small answering copy (a lane Get's: ``INLINE_COPY_BYTES`` at most) for a client
        ``alone``, copied and answered right here by the data plane's code
        (``DataPlane.copy_now``), with no job, order or future: nothing of the loop's for the
        client is in flight, the plane has no copy of it running (else it is not copied here), and
        the copy is over on return. The status its slot was answered with; -1: not copied,
        nothing changed (``run_alone`` then)."""
        if not self.alone(client, True, since=True):
            return -1
        code = self.plane.copy_now(client.gate, host_table, client.spec.page_size, self.arena_span, offsets,
                                   device_pages, np.array(local_layers, np.int64), answer)
        self.alone_copies += code >= 0
        return code

    def ended_alone(self, job: ClientJob) -> None:
        """``run_alone``'s job is over: later copies of its client need not wait for it."""
        if job.alone:
            job.alone = False
            self.alone_inflight -= 1
        client = job.client
        if client.order is not None:
            client.order.finished(job)
        client.inflight -= 1
        client.jobs.discard(job)
        client.changed.set()
        client.changed = asyncio.Event()

    def _on_plane(self, job: ClientJob, to_device: bool) -> Callable | None:
        """Where the medium may have the job copied by the data plane's thread, in C: a job that
        holds its client's plane turn (``job.turn``) and waits for no earlier copy, unless the copy
        workers would split it (``_splits``). The medium calls it with (job, to_device, signal);
        it answers None where the plane does not take the job (host rows other than cache pages,
        a closed gate)."""
        if (self.plane is None or job.turn is None or not job.ready() or self._splits(job, to_device)
                or job.turn.cuda):  # a CUDA pool's copies of the loop's are the GPU's (the medium's)
            return None
        gate, span, recheck = job.turn, self.arena_span, self._executor.recheck
        return lambda j, load, signal: self.plane.copy(gate, j, load, signal, span, recheck)

    def _splits(self, job: ClientJob, to_device: bool) -> bool:
        return self.splits(job.bytes_per_layer * len(job.local_layers), to_device)

    def splits(self, nbytes: int, to_device: bool) -> bool:
        """Whether the copy workers, splitting a copy of ``nbytes`` over all of them, copy it sooner
        than the plane's one thread does: a load of ``SPLIT_LOAD_BYTES`` or more."""
        least = self.split_load_bytes()
        return to_device and least > 0 and nbytes >= least

    def split_load_bytes(self) -> int:
        """The bytes from which the copy workers split a load (``splits``); 0: they never do."""
        big = workers.PARALLEL_BYTES
        if big is None or self._executor.threads <= 1:
            return 0
        return max(big, SPLIT_LOAD_BYTES)

    def _release(self, job: ClientJob, signal: LayerSignal | None, queued: bool = False) -> None:
        self.queued -= queued
        client = job.client
        if job.turn is not None:  # its turn among the data plane's copies ends with it
            job.turn.py_exit()
            job.turn = None
        if client.order is not None:
            client.order.finished(job)
        mark(client.busy, job.pages, job.dense[0] if job.dense else None, -1)
        client.inflight -= 1
        if signal is not None:
            signal.release()
        client.changed.set()
        client.changed = asyncio.Event()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)  # enqueued CUDA copies have their waiters by now
        self._waiters.shutdown(wait=True)


class PlaneTurn:
    """A copy's turn among the data plane's copies of its client (``plane_turn``)."""

    def __init__(self, gate) -> None:
        self.gate = gate
        self.held = True

    def take(self):
        """The job takes the turn over: it ends when the job is released (``Copier._release``)."""
        self.held = False
        return self.gate


@contextlib.asynccontextmanager
async def plane_turn(client: ClientState) -> AsyncIterator[PlaneTurn]:
    """For a client whose lane the compiled data plane serves: this copy counts as the loop's from
    now on (the plane hands the client's new requests to the loop, behind it), and the body runs
    once none of the plane's copies of the client runs. Turns are taken in arrival order (one lock
    per client), and the body checks and admits the job before the next turn begins, so the
    client's copies keep their order across the two sides. A turn not taken over by a job ends
    with the body."""
    gate = client.gate
    async with client.plane_lock:
        gate.py_enter()
        turn = PlaneTurn(gate)
        try:
            while gate.inflight:
                # A CUDA pool's copies the plane gave up on hold their pages until the release:
                # the loop's copy would wait for them, so it fails as they did.
                client.device.check_plane()
                await asyncio.sleep(PLANE_POLL_SECONDS)
            yield turn
        finally:
            if turn.held:
                gate.py_exit()


async def _take_turn(job: ClientJob) -> None:
    """A job built without its turn (the cache's): takes it now, and refuses to start for a client
    released meanwhile (its pool may be closed): with a gate or without (a client on gRPC alone,
    whose Get paused at its first message while an Unregister closed its pool)."""
    client = job.client
    if client.closing:
        raise UnknownClient(f"client {public_id(client.client_id)} was released while its copy waited")
    if client.gate is None or job.turn is not None:
        return
    async with plane_turn(client) as turn:
        if client.closing:
            raise UnknownClient(f"client {public_id(client.client_id)} was released while its copy waited")
        job.turn = turn.take()


def _settle(job: ClientJob, cf: Future, loop: asyncio.AbstractEventLoop) -> None:
    """Calls the job's ``on_settled`` now, or once the device work it was given up on has drained."""
    if job.on_settled is None:
        return
    if job.held is not None and not job.held.done():
        job.held.add_done_callback(lambda _: loop.call_soon_threadsafe(job.on_settled, False))
    else:
        job.on_settled(not cf.cancelled() and cf.exception() is None)


async def _until_done(fut: asyncio.Future, job: ClientJob) -> None:
    """Awaits the job's future; if the caller is cancelled meanwhile, the job is told to stop
    and the cancellation goes on (the job's own completion still releases its pages)."""
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        if not fut.done():
            job.stop("cancelled")
            _forget(fut)
        raise


def _forget(fut: asyncio.Future) -> None:
    """Nobody will await ``fut`` now: its outcome is read so that asyncio does not log it."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


async def wait_until(client: ClientState, predicate: Callable[[], bool]) -> None:
    """Waits on the loop until ``predicate`` holds; re-checked whenever one of the client's
    copies is released."""
    while not predicate():
        await client.changed.wait()
