"""An engine's device pool opened through CUDA IPC, and the copies between it and pinned host memory.

Lifetime, per registration: each allocation is opened once per device (shared by every client
that exports it) and closed with its last user; the client's host region is registered with
cudaHostRegister (Portable | Mapped, chunks of at most 64 GiB) so the copy kernel reads and
writes it directly; a non-blocking stream and ``event_slots x layers`` interprocess events are
created. ``close`` waits for the stream and releases all of it: a dead engine's memory is not
held by the daemon. The stream is CuPy's own (``cupy.cuda.Stream``), so kernels, the uploads of
their offset tables and the DMA all run on it, on CuPy 13 and 14 alike.

The host side of a copy is the client's region or, for the node-wide cache, pages anywhere in the
cache's slabs, which ``slabs.SlabPinner`` keeps pinned; the GPU reaches those by their host address
(unified addressing, checked when each slab is pinned).

Ordering is on the GPU: a write waits on the engine's ready event before reading its slots; a
load records one event per layer, which the engine's compute stream waits on.

Every wait on the GPU has a deadline (``waits``): a job whose events make no progress for
``--cuda-wait-seconds`` fails, and with it the pool (``failed``), which the reaper then reclaims;
other waits of the pool give up at once. A pool whose stream has not drained when it closes hands
its resources to the quarantine instead of releasing them under the GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserver.copies.geometry import Geometry, describe
from kvserver.copies.workers import single
from kvserver.errors import FailedPrecondition, GpuStalled, InvalidArgument
from kvserver.media.base import DevicePool, wide_dtype
from kvserver.media.cuda import driver, plan, waits
from kvserver.media.cuda.devices import ordinal_for
from kvserver.media.cuda.kernels import copy_rows_kernel
from kvserver.media.cuda.quarantine import QUARANTINE
from kvserver.media.cuda.slabs import HOST_REGISTER_FLAGS, SlabPinner, register_host
from kvserver.protocol.cuda_ipc import check_span, raw_ipc_handle
from kvserver.v1 import kvserver_pb2 as pb

if TYPE_CHECKING:
    from kvserver.copies.job import Job
    from kvserver.copies.progress import LayerSignal

logger = logging.getLogger(__name__)

# cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess: a CPU thread that
# synchronizes on one (in the engine) sleeps instead of spinning. The daemon itself polls
# eventQuery with a deadline (waits.py), which no flag changes.
EVENT_FLAGS = 1 | 2 | 4
DONE_EVENT_FLAGS = 1 | 2  # a write's completion: BlockingSync | DisableTiming, this process only
MEMCPY_DEFAULT = 4
DEFAULT_EVENT_SLOTS = 3
MAX_EVENT_SLOTS = plan.MAX_EVENT_SLOTS
# Engines' ready events opened per client, least recently used closed first: an engine that makes
# a new event per step must not grow the daemon's set without bound.
MAX_OPENED_EVENTS = 64
KERNEL_MAX_BLOCKS = 128  # with 8 warps each: ~1000 rows in flight, about one block per SM on H100/H200

_open_lock = threading.Lock()
# (device, raw handle) -> [base pointer, users, bytes from the base to the allocation's real end]
_open: dict[tuple[int, bytes], list[int]] = {}


def _open_allocation(rt, ordinal: int, handle: bytes) -> tuple[int, int]:
    """(base, real size) of the allocation, opened once per device; the size is the driver's,
    never the client's word. Runs inside ``with cupy.cuda.Device(ordinal)``."""
    with _open_lock:
        entry = _open.get((ordinal, handle))
        if entry is None:
            try:
                ptr = rt.ipcOpenMemHandle(handle, 1)
            except Exception as exc:  # (CuPy's CUDARuntimeError) a stale or made-up handle: the caller's
                raise InvalidArgument(f"the IPC handle opens no allocation on device {ordinal}: "
                                      f"{exc}") from None
            try:
                base, size = driver.allocation_range(ptr)
            except driver.DriverError as exc:
                rt.ipcCloseMemHandle(ptr)
                raise InvalidArgument(f"the IPC handle's allocation on device {ordinal} has no range: "
                                      f"{exc}") from None
            except BaseException:
                rt.ipcCloseMemHandle(ptr)
                raise
            entry = _open[(ordinal, handle)] = [ptr, 0, base + size - ptr]
        entry[1] += 1
        return entry[0], entry[2]


def _close_allocation(rt, ordinal: int, handle: bytes) -> None:
    with _open_lock:
        entry = _open[(ordinal, handle)]
        entry[1] -= 1
        if entry[1] == 0:
            del _open[(ordinal, handle)]
            rt.ipcCloseMemHandle(entry[0])


@dataclass(frozen=True, slots=True)
class Pending:
    """An enqueued copy: the events that complete with it, in layer order; ``owned`` ones (a
    write's) are destroyed once waited on. ``failed``: the launch failed part way; what it had
    enqueued is drained by the waiter (never on the shared copy worker), then this is raised."""

    events: list[int]
    owned: bool = False
    failed: BaseException | None = None


@dataclass(slots=True, eq=False)
class _Room:
    """A job's driver calls, counted in its pool's ``queued_calls`` from when it is taken for the
    stream until it ends (``given_back``; a job that ends before it is taken is never counted),
    and the engine's ready event it makes the stream wait on (its IPC handle; b"": none)."""

    calls: int
    ready_event: bytes = b""
    taken: bool = False
    given_back: bool = False


@dataclass(slots=True)
class CudaDevicePool(DevicePool):
    cupy: object
    ordinal: int
    num_tokens: int
    page_size: int
    token_bytes: int
    token_stride: int
    parts: int
    token_bases: np.ndarray  # uint64 [layers, parts]: device address of token 0
    handles: list[bytes]
    geometry: Geometry | None = None  # every buffer's blocks and head strides; None: plain token rows
    stream: object = None  # cupy.cuda.Stream, non-blocking
    events: list[int] = field(default_factory=list)  # [slot * layers + layer]
    event_handles: list[bytes] = field(default_factory=list)
    event_slots: int = DEFAULT_EVENT_SLOTS
    pinned: list[int] = field(default_factory=list)
    host_to_device: int = 0  # add to a host address of the region to get its device address
    opened_events: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    _events_lock: threading.Lock = field(default_factory=threading.Lock)
    # One job at a time goes onto the stream: with --copy-threads above 1, two workers may hold
    # jobs of this client, and their launches and records must not interleave.
    _enqueue_lock: threading.Lock = field(default_factory=threading.Lock)
    wait_seconds: float = waits.DEFAULT_WAIT_SECONDS  # no progress this long fails the pool
    failed: str | None = None  # why this pool's GPU work is given up on; the reaper reclaims it
    _fail_lock: threading.Lock = field(default_factory=threading.Lock)  # failed is set once
    pinned_bytes: int = 0
    slabs: SlabPinner | None = None  # the daemon's cache slabs, pinned once this pool attaches
    # Completes once the pool's resources are released: its GPU work, if any was left, has drained.
    released: Future = field(default_factory=Future)
    # Its enqueued copies' waits, taken one at a time by one of the daemon's waiter threads (the
    # stream completes them in order anyway): an engine whose ready event never fires holds one
    # waiter, never every one, and no other engine's copy waits for a free waiter behind it.
    _waits: deque = field(default_factory=deque)
    _waiting: bool = False
    _waits_lock: threading.Lock = field(default_factory=threading.Lock)
    # The compiled data plane's gate, where it puts this pool's lane copies on the stream itself
    # (plane_setup), and the engines' ready events it was given: kept open until the release.
    plane_gate: object = None
    plane_ready: set[bytes] = field(default_factory=set)
    # For the plane's kernel launches (attach_host, where plan.PLANE): the kernel's CUfunction per
    # word, the pinned area its arguments go in, and that area's device address less its host one.
    plane_kernels: tuple[tuple[int, ...], np.ndarray, int] | None = None
    # Driver calls the loop's jobs have on the stream and have not ended (plan.MAX_QUEUED), under
    # _room_lock; and the copy queue's recheck, which a job held for room waits on.
    queued_calls: int = 0
    _on_stream: set = field(default_factory=set)  # the _Rooms taken and not given back
    _room_lock: threading.Lock = field(default_factory=threading.Lock)
    _recheck: Callable[[], None] | None = None

    @property
    def dtype(self):
        """The wide integer dtype of the client's host views."""
        if self.geometry is not None:
            return wide_dtype(self.token_bytes, self.geometry.head_bytes)
        return wide_dtype(self.token_bytes)

    @property
    def paged(self) -> bool:
        if self.geometry is not None:
            return False  # rows are tokens, or (token, head) segments
        return self.token_stride == self.token_bytes and self.num_tokens >= self.page_size

    @property
    def ipc_allocations(self) -> frozenset[bytes]:
        return frozenset(self.handles)

    @property
    def inline_ok(self) -> bool:
        return False  # every copy is GPU work, enqueued off the event loop

    @property
    def records_events(self) -> bool:
        return True

    def plane_buffers(self) -> tuple[list[int], int] | None:
        """Plain token rows (no blocks, no strided heads), where the plane's CUDA copies are on
        (``plan.PLANE``): every (layer, part) buffer's device address of token 0, and the stride."""
        if not plan.PLANE or self.geometry is not None or self.stream is None:
            return None
        return [int(b) for b in self.token_bases.reshape(-1)], self.token_stride

    def plane_setup(self, gate) -> None:
        """Hands the plane's gate what it needs to put this pool's copies on its stream: the driver's
        entry points, the device's context, the stream, the layer events, the host region's
        device address and the deadline; then the ready events opened so far."""
        ctx = driver.stream_context(self.stream.ptr)
        gate.set_cuda(driver.plane_entry_points(), ctx, self.stream.ptr, list(self.events), self.event_slots,
                      self.host_to_device, self.wait_seconds, plan.PLANE_DMA_MAX_COPIES,
                      plan.DMA_MIN_CHUNK_BYTES, plan.PLANE_SMALL_COPIES, plan.PLANE_MAX_QUEUED)
        if self.plane_kernels is not None:  # prepared off the loop (attach_host)
            functions, args, shift = self.plane_kernels
            gate.set_cuda_kernels(functions, args.ctypes.data, args.nbytes, shift, KERNEL_MAX_BLOCKS, 8)
        self.plane_gate = gate
        with self._events_lock:
            for handle, event in self.opened_events.items():
                if gate.add_ready(handle, event):
                    self.plane_ready.add(handle)

    def plane_failed(self) -> str | None:
        """Why the plane gave this pool's GPU work up, latched as the pool's own failure; None if
        it has not."""
        gate = self.plane_gate
        why = gate.cuda_failed if gate is not None else None
        if why and self.failed is None:
            self._fail(why)
        return why

    def check_plane(self) -> None:
        if self.plane_failed():
            raise self._stalled()

    def check_request(self, ready_event: bytes, event_slot: int) -> None:
        if event_slot >= self.event_slots:
            raise InvalidArgument(
                f"event_slot {event_slot} is not one of this registration's {self.event_slots} slots"
            )
        if ready_event and len(ready_event) != 64:
            raise InvalidArgument(
                f"ready_event must be a 64-byte CUDA IPC event handle, got {len(ready_event)} bytes"
            )

    def check_sizes(self) -> None:
        """IPC allocations cannot shrink under the daemon."""

    def check_cache_rows(self) -> None:
        """The cache's slabs are pinned for this device, and the pool has not failed."""
        if self.failed:
            raise self._stalled()
        if self.slabs is None:
            raise FailedPrecondition("this CUDA pool was opened without the cache's slabs pinned for it")
        self.slabs.check()

    def device(self):
        return self.cupy.cuda.Device(self.ordinal)

    # ---- lifetime -------------------------------------------------------------------------

    def attach_host(self, host_ptr: int, nbytes: int, num_layers: int) -> None:
        """Pins the client's host region (and, the first time CUDA is used, the cache's slabs)
        and creates the stream and the layer events."""
        rt = self.cupy.cuda.runtime
        with self.device():
            self.pinned = register_host(rt, host_ptr, nbytes, HOST_REGISTER_FLAGS)
            self.pinned_bytes = nbytes
            if self.slabs is not None:
                self.slabs.use(self.cupy, self.ordinal)
            if nbytes:  # a cache-only registration has no region to translate
                self.host_to_device = rt.pointerGetAttributes(host_ptr).devicePointer - host_ptr
            self.stream = self.cupy.cuda.Stream(non_blocking=True)
            for _ in range(self.event_slots * num_layers):
                event = rt.eventCreateWithFlags(EVENT_FLAGS)
                self.events.append(event)
                self.event_handles.append(rt.ipcGetEventHandle(event))
        if plan.PLANE and self.geometry is None:
            self._plane_kernels()

    def _plane_kernels(self) -> None:
        """What the plane's kernel launches need (``plane_kernels``), made here, in the
        registration's worker thread: the kernel's first load compiles it (NVRTC), which the
        event loop must not wait for. Without it (a failed compile), the plane still copies by DMA
        and leaves the rest to the loop."""
        rt = self.cupy.cuda.runtime
        try:
            functions = driver.kernel_functions(self.cupy, self.ordinal)
            args = np.zeros(plan.PLANE_ARGS_BYTES + 64, np.uint8)
            at = -args.ctypes.data % 64
            args = args[at:at + plan.PLANE_ARGS_BYTES]
            with self.device():
                pinned = register_host(rt, args.ctypes.data, args.nbytes, HOST_REGISTER_FLAGS)
                self.pinned.extend(pinned)  # released with the pool's other pins
                shift = rt.pointerGetAttributes(args.ctypes.data).devicePointer - args.ctypes.data
        except Exception:
            logger.exception("the data plane cannot launch the copy kernel on device %d: the loop "
                             "does the copies it would have", self.ordinal)
            return
        self.plane_kernels = (functions, args, shift)

    def close(self) -> Future | None:
        """Releases everything once the stream has drained (waiting up to ``wait_seconds``; not
        at all for a failed pool). If it has not drained, the GPU may still touch the pinned
        region and the mappings: they go to the quarantine, and the returned future completes
        once they are released; until then the caller must keep the host region reserved."""
        self.plane_failed()  # an Unregister right after the plane gave up, before the reaper's look
        if self.stream is not None:
            limit = 0.0 if self.failed else self.wait_seconds
            with self.device():
                try:
                    drained = waits.until_done(self._stream_query, time.monotonic() + limit)
                except waits.CudaFailed as exc:  # released at the quarantine's first look
                    self._fail(str(exc))
                    drained = False
                if not drained:
                    return QUARANTINE.hold(
                        f"CUDA pool on device {self.ordinal} ({self.pinned_bytes} pinned host bytes, "
                        f"{len(self.handles)} IPC mappings; {self.failed or 'its stream had not drained'})",
                        self._drained, self._release)
        self._release()
        return None

    def _stream_query(self) -> int:
        return self.cupy.cuda.runtime.streamQuery(self.stream.ptr)

    def _drained(self) -> bool:
        """Whether the stream has drained; CudaFailed where its context has failed (it runs
        nothing more: the quarantine releases it)."""
        with self.device():
            return waits.done(self._stream_query())

    def _release(self) -> None:
        """Lets go of what the pool holds, each step whatever became of the others (after a
        sticky error every call of the context fails: the rest is let go all the same, logged),
        and says so (``released``: what waited for it, the jobs given up on among them, goes)."""
        rt = self.cupy.cuda.runtime
        failed: list[str] = []

        def step(what: str, call: Callable[..., Any], *args: Any) -> None:
            try:
                call(*args)
            except Exception as exc:
                failed.append(f"{what}: {exc}")

        try:
            with self.device():
                for event in self.events:
                    step("eventDestroy", rt.eventDestroy, event)
                with self._events_lock:
                    for event in self.opened_events.values():
                        step("eventDestroy", rt.eventDestroy, event)
                for ptr in self.pinned:
                    step("hostUnregister", rt.hostUnregister, ptr)
                for handle in self.handles:
                    step("ipcCloseMemHandle", _close_allocation, rt, self.ordinal, handle)
                if self.stream is not None:  # the offset tables' blocks cached for this stream
                    step("free_all_blocks", self.cupy.get_default_memory_pool().free_all_blocks,
                         self.stream)
        except Exception as exc:  # (the device itself could not be made current)
            failed.append(f"device {self.ordinal}: {exc}")
        finally:
            # CuPy destroys its stream with the last reference, which is this one.
            self.events, self.pinned, self.handles, self.stream = [], [], [], None
            self.opened_events = OrderedDict()
            if not self.released.done():
                self.released.set_result(None)
        if failed:
            logger.warning("releasing the CUDA pool on device %d: %d steps failed (%s%s); a device "
                           "whose context failed needs the daemon started again", self.ordinal,
                           len(failed), failed[0], "..." if len(failed) > 1 else "")

    def _fail(self, why: str) -> None:
        """Latches why this pool's GPU work is given up on, once (the reaper, the copy workers and a
        release may all see it), and logs it once."""
        with self._fail_lock:
            if self.failed is not None:
                return
            self.failed = why
            gate = self.plane_gate
        logger.warning("CUDA pool on device %d failed: %s", self.ordinal, why)
        if gate is not None:
            # A turn that is never given back: the plane hands every later request of the pool to
            # the loop, which refuses it at once. The loop's given-up calls may still fill the
            # stream, and the plane's bound counts only its own (plan.MAX_QUEUED). Set before the
            # failed jobs end (and give their turns back); the gate closes at the release.
            gate.py_enter()
        if self._recheck is not None:  # its jobs held for room fail now, putting nothing on the GPU
            self._recheck()

    def _stalled(self) -> GpuStalled:
        return GpuStalled(f"this client's GPU work is given up on: {self.failed}. The client is "
                          "failed and reclaimed; register again")

    # ---- copies ---------------------------------------------------------------------------

    def _wait_on(self, event_handle: bytes) -> None:
        """Makes the stream wait (on the GPU) for the engine's latest record of this event."""
        rt = self.cupy.cuda.runtime
        with self._events_lock:
            event = self.opened_events.get(event_handle)
            if event is None:
                try:
                    event = rt.ipcOpenEventHandle(event_handle)
                except Exception as exc:  # (CuPy's CUDARuntimeError) stale, made up: the caller's error
                    raise InvalidArgument(f"the ready_event opens no CUDA event on device {self.ordinal}: "
                                          f"{exc}") from None
                self.opened_events[event_handle] = event
                # The plane waits on it from now on, for this handle's requests: kept until the release.
                if self.plane_gate is not None and self.plane_gate.add_ready(event_handle, event):
                    self.plane_ready.add(event_handle)
                if len(self.opened_events) > MAX_OPENED_EVENTS:
                    # A wait already enqueued keeps what it waits for; destroying is safe. The
                    # plane's are not destroyed: it may be putting a wait on one on the stream.
                    oldest = next((h for h in self.opened_events if h not in self.plane_ready), None)
                    if oldest is not None:
                        rt.eventDestroy(self.opened_events.pop(oldest))
            else:
                self.opened_events.move_to_end(event_handle)
            rt.streamWaitEvent(self.stream.ptr, event, 0)

    def start(self, job: Job, to_device: bool, signal: LayerSignal | None, executor: Executor,
              waiters: Executor, plane: Callable | None = None) -> Future[None]:
        """The copy worker enqueues the copy (and says a load's events are recorded), then hands
        the waiting to a waiter thread; the future completes when the GPU has done the copy."""
        done: Future[None] = Future()
        # Running from the start, so that cancelling the RPC cannot cancel it: the pages stay
        # busy until the GPU is really done with them.
        done.set_running_or_notify_cancel()
        layers = np.asarray(job.local_layers, dtype=np.int64)

        def fail(exc: BaseException) -> None:
            if isinstance(exc, GpuStalled):  # given up on: its copies may still run on the GPU
                job.held = self.released
            done.set_exception(exc)

        def wait(pending: Pending) -> None:
            try:
                self.wait(pending, signal)
                job.check_ended(to_device)  # (seen done here, after the GPU: never too early)
            except BaseException as exc:
                fail(exc)
            else:
                done.set_result(None)

        room = _Room(self.job_calls(job.plan, layers.size, to_device, bool(job.ready_event)), job.ready_event)
        done.add_done_callback(lambda _: self._give_room(room))

        def enqueue() -> None:
            try:
                if job.stopping:  # dropped before anything went on the GPU
                    raise job.stopped(0)
                pending = self.enqueue(job.plan, layers, job.host, to_device, job.ready_event,
                                       job.event_slot, cache_rows=job.host_table is not None)
                if signal is not None and pending.failed is None:
                    signal.mark_recorded()
                self._wait_in_turn(waiters, wait, pending)  # a failed launch is drained there too
            except BaseException as exc:
                fail(exc)

        # Enqueued on the client's stream only after the earlier copies it must follow
        # (kvserver/copies/order.py): the stream then keeps that order on the GPU. And only once
        # the stream has room for its calls: until then it waits in the queue, not in the driver.
        self._recheck = getattr(executor, "recheck", None)
        work = job.work = single(to_device, enqueue, ready=lambda: job.ready() and self._take_room(room))
        queued = job.queued = executor.submit_work(work)
        # Stopped while still waiting for the worker: dropped from its queue, nothing enqueued.
        queued.add_done_callback(lambda f: f.cancelled() and done.set_exception(job.stopped(0)))
        return done

    def job_calls(self, copy_plan, num_layers: int, to_device: bool, ready_event: bool) -> int:
        """The driver calls ``enqueue`` puts on the stream for a job of ``num_layers`` layers: the
        wait on the engine's ready event, the copies (DMA: one a row, layer and part; the kernel:
        its uploads and one launch a layer for a load, one for a write), and the records (a load's
        layer events, a write's completion). The choice of copies is ``_job_copier``'s."""
        g = self.geometry
        if g is not None:
            rows = copy_plan.num_tokens * (1 if g.heads_contiguous else g.heads)
            row_bytes = g.token_bytes if g.heads_contiguous else g.head_bytes
        elif copy_plan.device_paged:
            rows, row_bytes = copy_plan.host_pages.size, self.page_size * self.token_bytes
        else:
            rows, row_bytes = copy_plan.num_tokens, self.token_bytes
        steps = num_layers if to_device else 1
        copies = rows * num_layers * self.parts
        most = plan.dma_max_copies(num_layers, to_device)
        if plan.choose_method(row_bytes, copies, max_copies=most) == "kernel":
            copies = 2 * plan.KERNEL_UPLOADS + steps
        return int(ready_event) + copies + steps

    def _take_room(self, room: _Room) -> bool:
        """Whether the job may go on the stream now, its calls then counted (the copy queue asks,
        under its lock, just before it hands the job to a worker). A job goes on an empty stream,
        beside the jobs there while all of them fit ``plan.MAX_QUEUED``, and beside any number
        once each engine event the jobs there wait on has fired: the stream then drains by itself,
        and a call into its full queue waits for the GPU, not for an engine. A failed pool's job
        goes too (it fails at once, putting nothing on the GPU)."""
        with self._room_lock:
            if room.taken or room.given_back:
                return True
            if (self.queued_calls and self.queued_calls + room.calls > plan.MAX_QUEUED and not self.failed
                    and not self._waits_fired()):
                return False
            room.taken = True
            self.queued_calls += room.calls
            self._on_stream.add(room)
            return True

    def _waits_fired(self) -> bool:
        """Whether every engine event the jobs on the stream wait on has fired (its latest record
        is complete, and with it the one the stream waits on, recorded before it); an event no
        longer open counts as not fired."""
        handles = {r.ready_event for r in self._on_stream if r.ready_event}
        if not handles:
            return True
        rt = self.cupy.cuda.runtime
        with self._events_lock:
            events = [self.opened_events.get(h) for h in handles]
        if None in events:
            return False
        try:
            with self.device():
                return all(rt.eventQuery(e) == 0 for e in events)
        except Exception:  # a failed query says nothing: the bound holds
            return False

    def _give_room(self, room: _Room) -> None:
        """The job ended (its calls done on the GPU, or given up on, or never made): a job held for
        room may go."""
        with self._room_lock:
            room.given_back = True
            if not room.taken:
                return
            room.taken = False
            self.queued_calls -= room.calls
            self._on_stream.discard(room)
        if self._recheck is not None:
            self._recheck()

    def enqueue(self, copy_plan, layers: np.ndarray, host_table, to_device: bool, ready_event: bytes = b"",
                event_slot: int = 0, cache_rows: bool = False) -> Pending:
        """Puts the copy of ``layers`` (local ids) on the client's stream and returns at once
        with what ``wait`` waits on: a load's layer events of ``event_slot``, each recorded after
        its layer's copy, or a write's one completion event. Runs on the copy worker, which is
        then free for the next job while the GPU copies. ``cache_rows``: ``host_table`` is the
        cache's (rows are byte offsets into the arena's pinned slabs, addressed by their host
        address), not the client's region."""
        cp = self.cupy
        rt = cp.cuda.runtime
        num_layers = self.token_bases.shape[0]
        stream = self.stream.ptr
        if cache_rows:
            self.check_cache_rows()
        self.plane_failed()
        host_to_device = 0 if cache_rows else self.host_to_device
        with self._enqueue_lock, self.device(), self.stream:
            if self.failed:
                raise self._stalled()
            try:
                if ready_event:
                    self._wait_on(ready_event)
                copier = self._job_copier(copy_plan, layers, host_table, to_device, host_to_device)
                if not to_device:  # a write: every layer at once, one event for all of it
                    copier(slice(None))
                    done = rt.eventCreateWithFlags(DONE_EVENT_FLAGS)
                    try:
                        rt.eventRecord(done, stream)
                    except BaseException:
                        rt.eventDestroy(done)
                        raise
                    return Pending([done], owned=True)
                events = []
                for i, layer in enumerate(layers.tolist()):
                    copier(slice(i, i + 1))
                    event = self.events[event_slot * num_layers + layer]
                    rt.eventRecord(event, stream)
                    events.append(event)
                return Pending(events)
            except Exception as exc:
                # Part of the job may be on the stream: a marker event recorded right behind it
                # (still under the lock, so nothing later is in between) lets a waiter thread wait
                # for exactly that part before the pages are released and the failure reported;
                # the copy worker moves on. If even the marker cannot be recorded, drain here.
                try:
                    marker = rt.eventCreateWithFlags(DONE_EVENT_FLAGS)
                except Exception:
                    marker = None
                if marker is not None:
                    try:
                        rt.eventRecord(marker, stream)
                        return Pending([marker], owned=True, failed=exc)
                    except Exception:
                        rt.eventDestroy(marker)
                try:
                    drained = waits.until_done(self._stream_query, time.monotonic() + self.wait_seconds)
                except waits.CudaFailed as failed:
                    self._fail(str(failed))
                    raise self._stalled() from exc
                if not drained:
                    self._fail(f"a failed job's copies were still on the GPU after {self.wait_seconds:g} s "
                               "(--cuda-wait-seconds)")
                    raise self._stalled() from exc
                raise

    def _job_copier(self, copy_plan, layers: np.ndarray, host_table, to_device: bool, host_to_device: int):
        """The copier of one job: rows of whole device pages where the plan allows, else of tokens.
        ``host_to_device`` turns the table's host addresses into device addresses."""
        g = self.geometry
        if g is not None:
            row_bytes = g.token_bytes if g.heads_contiguous else g.head_bytes
            host_off, dev_off = copy_plan.strided_offsets(host_table.row_stride, g)
        else:
            if copy_plan.device_paged:
                row_bytes = dev_stride = self.page_size * self.token_bytes
            else:
                row_bytes, dev_stride = self.token_bytes, self.token_stride
            host_off, dev_off = copy_plan.offsets(host_table.row_stride, dev_stride, row_bytes)
        host_bases = host_table.bases[layers] + np.uint64(host_to_device % (1 << 64))
        dev_bases = self.token_bases[layers]
        most = plan.dma_max_copies(layers.size, to_device)
        if to_device:
            return self._copier(dev_bases, dev_off, host_bases, host_off, row_bytes, most)
        return self._copier(host_bases, host_off, dev_bases, dev_off, row_bytes, most)

    def _wait_in_turn(self, waiters: Executor, wait: Callable[[Pending], None], pending: Pending) -> None:
        """Queues ``wait(pending)`` behind this pool's earlier waits, on one waiter thread at a time."""
        with self._waits_lock:
            self._waits.append((wait, pending))
            if self._waiting:
                return
            self._waiting = True
        try:
            waiters.submit(self._run_waits)
        except RuntimeError:  # the waiters shut down (the daemon stopping): the chain runs here
            self._run_waits()

    def _run_waits(self) -> None:
        while True:
            with self._waits_lock:
                if not self._waits:
                    self._waiting = False
                    return
                wait, pending = self._waits.popleft()
            try:
                wait(pending)  # (it settles its job whatever happens)
            except Exception:
                logger.exception("waiting for a CUDA copy of device %d failed", self.ordinal)

    def wait(self, pending: Pending, signal) -> None:
        """Blocks until the enqueued copy is done, reporting each layer through ``signal`` as its
        event completes. Runs on a waiter thread. Fails the pool (GpuStalled) if the events make
        no progress for ``wait_seconds``, and gives up at once if the pool has failed meanwhile."""
        rt = self.cupy.cuda.runtime
        with self.device():
            try:
                for i, event in enumerate(pending.events):
                    try:
                        complete = waits.until_done(lambda e=event: rt.eventQuery(e),
                                                    time.monotonic() + self.wait_seconds,
                                                    lambda: bool(self.failed))
                    except waits.CudaFailed as failed:
                        self._fail(str(failed))
                        raise self._stalled() from failed
                    if not complete:
                        self._fail(f"its GPU copies made no progress for {self.wait_seconds:g} s "
                                   "(--cuda-wait-seconds): an event they wait on, such as the engine's "
                                   "ready event, has not fired")
                        raise self._stalled() from pending.failed
                    if signal is not None and pending.failed is None:
                        signal.publish(i + 1)
                if pending.failed is not None:  # what it had enqueued is done: now say it failed
                    raise pending.failed
            finally:
                if pending.owned:  # destroying a pending event is safe: CUDA frees it once complete
                    for event in pending.events:
                        rt.eventDestroy(event)

    def _copier(self, dst_bases: np.ndarray, dst_off: np.ndarray, src_bases: np.ndarray,
                src_off: np.ndarray, row_bytes: int, max_copies: int = plan.DMA_MAX_COPIES):
        """A function copying the rows of a slice of layers: one kernel launch (with the widest
        word the job's alignment allows) for small rows or many copies, DMA for at most
        ``max_copies`` large ones (``plan.choose_method``)."""
        cp = self.cupy
        if plan.choose_method(row_bytes, dst_off.size * dst_bases.size, max_copies=max_copies) == "kernel":
            word = plan.word_bytes(row_bytes, dst_bases, src_bases, dst_off, src_off)
            kernel = copy_rows_kernel(cp, word)
            d_dst_off, d_src_off = cp.asarray(dst_off), cp.asarray(src_off)
            d_dst_b, d_src_b = cp.asarray(dst_bases.reshape(-1)), cp.asarray(src_bases.reshape(-1))
            n, parts = dst_off.size, self.parts
            blocks, threads = plan.kernel_launch(n * parts, row_bytes, KERNEL_MAX_BLOCKS, warps_per_block=8,
                                                 word_bytes=word)

            def launch(layers: slice) -> None:
                first, last, _ = layers.indices(dst_bases.shape[0])
                count = (last - first) * parts
                if count == 0 or n == 0:
                    return
                kernel((blocks,), (threads,), (
                    d_dst_b[first * parts:], d_src_b[first * parts:], np.int32(count),
                    d_dst_off, d_src_off, np.int64(n), np.int64(row_bytes // word),
                ))

            return launch
        # At most plan.DMA_MAX_COPIES copies per job (choose_method): DMA needs no alignment.
        pairs = list(zip(dst_off.tolist(), src_off.tolist(), strict=True))
        rt, stream = cp.cuda.runtime, self.stream.ptr

        def dma(layers: slice) -> None:
            for db, sb in zip(dst_bases[layers].reshape(-1).tolist(), src_bases[layers].reshape(-1).tolist(),
                              strict=True):
                for d, s in pairs:
                    rt.memcpyAsync(db + d, sb + s, row_bytes, MEMCPY_DEFAULT, stream)

        return dma


def open_cuda_pool(cupy, refs: list[pb.BufferRef], num_tokens: int, token_bytes: int, parts: int,
                   page_size: int, event_slots: int, slabs: SlabPinner | None = None,
                   geoms: list[Geometry] | None = None) -> CudaDevicePool:
    """Checks, then opens every allocation of the pool once on the engine's device. ``geoms``:
    the buffers' checked geometry where the pool has blocks or strided heads (docs/layouts.md),
    one shape for every buffer; None for plain token rows."""
    if not 0 <= event_slots <= MAX_EVENT_SLOTS:
        raise InvalidArgument(f"event_slots must be at most {MAX_EVENT_SLOTS}, got {event_slots}")
    if len(refs) // parts > plan.max_layers():
        raise InvalidArgument(
            f"a CUDA pool has at most {plan.max_layers()} layers, got {len(refs) // parts}: a load of more "
            f"would put more calls on its stream than the {plan.MAX_QUEUED} it may hold; register the "
            "model's layers in several ranges (pipeline stages)"
        )
    devices = {(r.cuda.device_uuid, r.cuda.pci_bus_id) for r in refs}
    ordinals = {ordinal_for(cupy, uuid, pci) for uuid, pci in devices}
    if len(ordinals) != 1:
        raise InvalidArgument("every buffer of a CUDA pool must live on one device")
    ordinal = ordinals.pop()
    strides = {r.token_stride for r in refs}
    if len(strides) != 1:
        raise InvalidArgument("every buffer of a CUDA pool must have the same token_stride")
    handles = []
    for i, r in enumerate(refs):
        _check_span(r, geoms[i] if geoms else None, num_tokens, token_bytes, f"device_pool buffer {i}")
        handles.append(raw_ipc_handle(r.cuda.ipc_handle))
    rt = cupy.cuda.runtime
    opened: list[bytes] = []
    try:
        with cupy.cuda.Device(ordinal):
            bases = []
            for i, (handle, r) in enumerate(zip(handles, refs, strict=True)):
                base, real_size = _open_allocation(rt, ordinal, handle)
                opened.append(handle)
                _check_span(r, geoms[i] if geoms else None, num_tokens, token_bytes,
                            f"device_pool buffer {i}", real_size)
                bases.append(base + r.offset)
    except BaseException:
        with cupy.cuda.Device(ordinal):
            for handle in opened:
                _close_allocation(rt, ordinal, handle)
        raise
    return CudaDevicePool(
        cupy=cupy, ordinal=ordinal, num_tokens=num_tokens, page_size=page_size, token_bytes=token_bytes,
        token_stride=strides.pop(), parts=parts, geometry=geoms[0] if geoms else None,
        token_bases=np.array(bases, dtype=np.uint64).reshape(-1, parts), handles=handles,
        event_slots=event_slots or DEFAULT_EVENT_SLOTS, wait_seconds=waits.wait_seconds(), slabs=slabs,
    )


def _check_span(r: pb.BufferRef, g: Geometry | None, num_tokens: int, token_bytes: int, what: str,
                real_size: int | None = None) -> None:
    """The buffer's whole span inside the declared allocation and, once open, its real size."""
    if g is None:
        check_span(r.offset, r.token_stride, num_tokens, token_bytes, r.cuda.allocation_size, what,
                   real_size=real_size)
        return
    end = g.span(num_tokens)[1]
    for size, which in ((real_size, "the allocation the handle opens is"),
                        (r.cuda.allocation_size, "the allocation is")):
        if size is not None and end > size:
            raise InvalidArgument(f"{what}: buffer at {describe(r)} needs {end} bytes for {num_tokens} "
                                  f"tokens, but {which} {size} bytes")
