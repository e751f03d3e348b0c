"""A stand-in for CuPy on a machine without a GPU, for testing the daemon's CUDA path logic.

"Device memory" is host memory (numpy buffers), so every copy the daemon plans through IPC
pointers, the copy kernel or DMA really moves bytes and can be checked bit for bit. The kernel is
the daemon's own CUDA source built for the CPU (tests/kernel_host.py). Every runtime
call is logged in order, so event ordering and the release of every resource can be checked too.
What it cannot show (real IPC, pinning, kernel speed) is for scripts/gpu_check.py on a GPU.

Like a GPU, the stand-in only reaches memory it may: every row a kernel or a DMA touches must lie
in an exported allocation or in host memory registered with ``hostRegister`` (and not since
unregistered); anything else fails the launch as an illegal address would. ``device_offset``
makes ``pointerGetAttributes`` give registered host memory another device address, as on a
device without unified addressing.

Streams keep CUDA's order: work put on a stream after a wait on an engine event that is "hung"
(``FakeRuntime.hang``: the engine recorded it behind work that never ends) does not run, and
events recorded there do not complete, until the test fires that event. ``eventQuery`` and
``streamQuery`` answer NOT_READY meanwhile, as CuPy's do (they return cudaErrorNotReady rather
than raise); ``eventSynchronize`` and ``streamSynchronize`` block, as the real ones would for
good (here they give up after STUCK_SECONDS, so a test that waits on them fails instead of hanging).
Like the driver's, a stalled stream's queue has a depth (``FakeRuntime.queue_depth``, unbounded
unless a test sets it): a call past it waits until the stream runs again, as a call into a full
queue waits for room. ``outstanding`` counts the calls waiting on a stalled stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
import types

import numpy as np
from kernel_host import HostKernel

from kvserver.media.cuda.kernels import KERNELS, SOURCE

UUID_HEX = "1a2b3c4d5e6f7a8b9c0d112233445566"
UUID = "GPU-1a2b3c4d-5e6f-7a8b-9c0d-112233445566"
PCI_BUS_ID = "0000:3B:00.0"  # as cudaDeviceGetPCIBusId spells it
NOT_READY = 600  # cudaErrorNotReady
STUCK_SECONDS = 15.0
_IDS = itertools.count(2)
OPENED = 1 << 40  # an engine event opened by handle h is event h + OPENED here (never a made id)


class _CurrentStream(threading.local):
    """CuPy's current stream is per thread."""

    def __init__(self) -> None:
        self.stack = [0]


class FakeRuntime:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        # (stream, thread, call) of everything put on a stream, in the order it was put there.
        self.stream_ops: list[tuple[int, int, str]] = []
        self.allocations: dict[bytes, np.ndarray] = {}
        self._current = _CurrentStream()
        self.uuid_bytes = bytes.fromhex(UUID_HEX)
        self.launch_seconds = 0.0  # how long a kernel launch takes to return
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._hung: set[int] = set()  # engine events (as opened here) that have not fired
        self._stalled: dict[int, tuple[int, list]] = {}  # stream -> (hung event, work behind it)
        self._pending: set[int] = set()  # events recorded behind a hung one
        self._queued: dict[int, int] = {}  # stalled stream -> calls on it since (its wait included)
        self.queue_depth: int | None = None  # calls a stalled stream holds before the next one waits
        self.registered: dict[int, int] = {}  # host address -> bytes, while hostRegister'ed
        self.device_offset = 0  # added to a registered host address to give its device address
        self.bad_events: set[bytes] = set()  # IPC event handles that open nothing (CuPy raises)
        self.sticky = 0  # a sticky error's code: every query returns it from now on, as CuPy's do

    # ---- events that never fire -----------------------------------------------------------

    @staticmethod
    def opened_id(handle: bytes) -> int:
        return int.from_bytes(handle[:8], "little") + OPENED

    def hang(self, handle: bytes) -> None:
        """The engine's event of this IPC handle will not fire until ``fire``."""
        with self._cond:
            self._hung.add(self.opened_id(handle))

    def fire(self, handle: bytes) -> None:
        """The hung event completes: the work queued behind it runs, in stream order."""
        event = self.opened_id(handle)
        with self._cond:
            self._hung.discard(event)
            for stream, (waited, work) in list(self._stalled.items()):
                if waited == event:
                    del self._stalled[stream]
                    self._queued.pop(stream, None)
                    for fn in work:
                        fn()
            self._cond.notify_all()

    def fire_all(self) -> None:
        """Every hung event completes (a test's teardown: nothing of it stays queued)."""
        with self._cond:
            hung = list(self._hung)
        for event in hung:
            self.fire((event - OPENED).to_bytes(8, "little") * 8)

    def _defer(self, stream: int, fn) -> bool:
        """Queues ``fn`` behind the hung event its stream waits on; False if the stream runs."""
        with self._cond:
            if stream not in self._stalled:
                return False
            self._stalled[stream][1].append(fn)
            return True

    def _block_until(self, ready, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(ready, STUCK_SECONDS):
                raise RuntimeError(f"stand-in: {what} waited {STUCK_SECONDS} s on work that never ends")

    @property
    def current_stream(self) -> list[int]:
        return self._current.stack

    def _on_stream(self, stream: int, call: str) -> None:
        """Puts a call on ``stream``: past ``queue_depth`` calls on a stalled stream, waits until it
        runs again (for at most STUCK_SECONDS, then fails as a stuck wait does)."""
        with self._cond:
            if stream in self._stalled:
                if self.queue_depth is not None and self._queued[stream] >= self.queue_depth:
                    self._block_until(lambda: stream not in self._stalled, "a call into a full queue")
                else:
                    self._queued[stream] += 1
            self.stream_ops.append((stream, threading.get_ident(), call))

    def outstanding(self, stream: int) -> int:
        """Calls put on ``stream`` since it stalled, its wait included; 0 while it runs."""
        with self._cond:
            return self._queued.get(stream, 0)

    def _id(self) -> int:
        """A new handle, stream or event id, unique in the process: a test's handles never name
        what an earlier test's daemon may still hold open (a quarantined pool's allocations)."""
        return next(_IDS)

    def export(self, nbytes: int) -> tuple[bytes, np.ndarray]:
        """An engine's cudaMalloc: returns (IPC handle, its memory)."""
        mem = np.zeros(nbytes, dtype=np.uint8)
        handle = self._id().to_bytes(8, "little") * 8
        self.allocations[handle] = mem
        return handle, mem

    def address_range(self, ptr: int) -> tuple[int, int]:
        """cuMemGetAddressRange: (base, size) of the allocation holding ``ptr``; like the driver,
        CUDA_ERROR_NOT_FOUND for an address no allocation holds."""
        for mem in self.allocations.values():
            base = mem.ctypes.data
            if base <= ptr < base + mem.size:
                return base, mem.size
        raise RuntimeError("cuMemGetAddressRange failed: CUDA_ERROR_NOT_FOUND")

    def getDeviceCount(self):
        return 1

    def getDeviceProperties(self, i):
        return {"uuid": self.uuid_bytes}

    def deviceGetPCIBusId(self, i):
        return PCI_BUS_ID

    def ipcOpenMemHandle(self, handle, flags=1):
        self.calls.append(("ipcOpenMemHandle", handle))
        return self.allocations[handle].ctypes.data

    def _sticky(self, what: str) -> None:
        """After a sticky error every call of the context fails with it, as CUDA's do."""
        if self.sticky:
            raise RuntimeError(f"cudaErrorIllegalAddress ({what}): an illegal memory access was encountered")

    def ipcCloseMemHandle(self, ptr):
        self.calls.append(("ipcCloseMemHandle", ptr))
        self._sticky("ipcCloseMemHandle")

    def hostRegister(self, ptr, size, flags):
        self.calls.append(("hostRegister", ptr, size, flags))
        with self._lock:
            if any(p < ptr + size and ptr < p + n for p, n in self.registered.items()):
                raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
            self.registered[ptr] = size

    def hostUnregister(self, ptr):
        self.calls.append(("hostUnregister", ptr))
        self._sticky("hostUnregister")
        with self._lock:
            if self.registered.pop(ptr, None) is None:
                raise RuntimeError("cudaErrorHostMemoryNotRegistered")

    def pointerGetAttributes(self, ptr):
        # UVA: the host address works on the device (unless the test says otherwise)
        return types.SimpleNamespace(devicePointer=ptr + self.device_offset)

    def _ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the memory the GPU may reach, sorted by start."""
        with self._lock:
            ranges = [(m.ctypes.data, m.size) for m in self.allocations.values()]
            ranges += list(self.registered.items())
        ranges.sort()
        starts = np.array([r[0] for r in ranges], dtype=np.uint64)
        return starts, starts + np.array([r[1] for r in ranges], dtype=np.uint64)

    def check_reach(self, lo, hi, what: str) -> None:
        """Raises unless each [lo, hi) (scalars or arrays) lies in one exported allocation or
        one registered host range."""
        lo = np.atleast_1d(np.asarray(lo, dtype=np.uint64))
        hi = np.atleast_1d(np.asarray(hi, dtype=np.uint64))
        starts, ends = self._ranges()
        idx = np.searchsorted(starts, lo, side="right").astype(np.int64) - 1
        ok = (idx >= 0) & (hi <= ends[np.maximum(idx, 0)]) if starts.size else np.zeros(lo.shape, bool)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise RuntimeError(f"stand-in: {what} touches [{int(lo[bad]):#x}, {int(hi[bad]):#x}), memory the "
                               "GPU cannot reach (cudaErrorIllegalAddress)")

    def check_rows(self, bases, offsets, row_bytes: int, what: str) -> None:
        """Every row ``base + offset`` of ``row_bytes`` is reachable (see ``check_reach``)."""
        offsets = np.asarray(offsets, dtype=np.int64).astype(np.uint64)
        if offsets.size == 0:
            return
        lo = (np.asarray(bases, dtype=np.uint64).reshape(-1, 1) + offsets.reshape(1, -1)).reshape(-1)
        self.check_reach(lo, lo + np.uint64(row_bytes), what)

    def streamSynchronize(self, stream):
        self.calls.append(("streamSynchronize", stream))
        self._block_until(lambda: stream not in self._stalled, "streamSynchronize")

    def streamQuery(self, stream):
        self.calls.append(("streamQuery", stream))
        with self._cond:
            if self.sticky:
                return self.sticky
            return NOT_READY if stream in self._stalled else 0

    def streamWaitEvent(self, stream, event, flags=0):
        self.calls.append(("streamWaitEvent", event))
        self._on_stream(stream, "streamWaitEvent")
        with self._cond:
            if event in self._hung and stream not in self._stalled:
                self._stalled[stream] = (event, [])
                self._queued[stream] = 1

    def eventCreateWithFlags(self, flags):
        self.calls.append(("eventCreateWithFlags", flags))
        return self._id()

    def eventDestroy(self, event):
        self.calls.append(("eventDestroy", event))
        self._sticky("eventDestroy")

    def ipcGetEventHandle(self, event):
        return event.to_bytes(8, "little") * 8

    def ipcOpenEventHandle(self, handle):
        self.calls.append(("ipcOpenEventHandle", handle))
        if handle in self.bad_events:
            raise RuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")
        return self.opened_id(handle)

    def eventRecord(self, event, stream):
        self.calls.append(("eventRecord", event, stream))
        self._on_stream(stream, "eventRecord")
        with self._cond:
            self._pending.discard(event)  # a new record replaces the last one
            if stream in self._stalled:
                self._pending.add(event)
                self._stalled[stream][1].append(lambda: self._pending.discard(event))

    def eventQuery(self, event):
        self.calls.append(("eventQuery", event))
        with self._cond:
            if self.sticky:
                return self.sticky
            return NOT_READY if event in self._pending or event in self._hung else 0

    def eventSynchronize(self, event):
        self.calls.append(("eventSynchronize", event))
        self._block_until(lambda: event not in self._pending, "eventSynchronize")

    def memcpyAsync(self, dst, src, size, kind, stream):
        self.calls.append(("memcpyAsync", size, stream))
        self.check_reach(dst, dst + size, "memcpyAsync")
        self.check_reach(src, src + size, "memcpyAsync")
        self._on_stream(stream, "memcpyAsync")
        if not self._defer(stream, lambda: ctypes.memmove(dst, src, size)):
            ctypes.memmove(dst, src, size)


class FakeStream:
    """cupy.cuda.Stream: a handle, and the current stream inside ``with``."""

    def __init__(self, runtime: FakeRuntime, non_blocking: bool = False) -> None:
        self.runtime = runtime
        self.ptr = runtime._id()
        self.non_blocking = non_blocking
        runtime.calls.append(("Stream", self.ptr, non_blocking))

    def __enter__(self) -> FakeStream:
        self.runtime.current_stream.append(self.ptr)
        return self

    def __exit__(self, *exc) -> None:
        self.runtime.current_stream.pop()


class RecordingKernel(HostKernel):
    """The real kernel source built for the CPU (tests/kernel_host.py), launches logged."""

    def __init__(self, runtime: FakeRuntime, source: str, name: str) -> None:
        super().__init__(source, name)
        self.runtime = runtime
        self.word = {name: word for word, name in KERNELS.items()}[name]

    def __call__(self, grid, block, args):
        dst_b, src_b, count, dst_off, src_off, n, row_words = args
        row_bytes = int(row_words) * self.word
        self.runtime.check_rows(dst_b[:int(count)], dst_off[:int(n)], row_bytes, self.name)
        self.runtime.check_rows(src_b[:int(count)], src_off[:int(n)], row_bytes, self.name)
        stream = self.runtime.current_stream[-1]
        self.runtime.calls.append(("kernel", int(count), int(n), self.name, stream))
        self.runtime._on_stream(stream, "kernel")
        time.sleep(self.runtime.launch_seconds)
        if not self.runtime._defer(stream, lambda: HostKernel.__call__(self, grid, block, args)):
            super().__call__(grid, block, args)


class FakeMemoryPool:
    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def free_all_blocks(self, stream=None):
        self.runtime.calls.append(("free_all_blocks", None if stream is None else stream.ptr))


def upload(runtime: FakeRuntime, a) -> np.ndarray:
    """CuPy's asarray of host memory: a copy from a pinned staging buffer on the current stream,
    then an event recorded behind it (CuPy's pinned pool frees the buffer once it fires)."""
    stream = runtime.current_stream[-1]
    runtime._on_stream(stream, "upload")
    runtime._on_stream(stream, "upload's record")
    return np.ascontiguousarray(a)


class FakeCupy:
    """Hashable, like the cupy module (the daemon caches per-module lookups)."""

    def __init__(self) -> None:
        runtime = FakeRuntime()
        pool = FakeMemoryPool(runtime)
        self.cuda = types.SimpleNamespace(
            runtime=runtime,
            Device=lambda ordinal: contextlib.nullcontext(),
            Stream=lambda non_blocking=False: FakeStream(runtime, non_blocking),
            is_available=lambda: True,
        )
        self.asarray = lambda a: upload(runtime, a)
        self.get_default_memory_pool = lambda: pool
        self.RawKernel = lambda source, name: RecordingKernel(runtime, source, name)


ILLEGAL_ADDRESS = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: what a copy outside reachable memory gets here
_RESULT = ctypes.c_int
_PTR = ctypes.c_void_p
_U64 = ctypes.c_uint64


class FakeDriver:
    """The driver's entry points the compiled data plane calls (kvserver/lane/csrc/cuda.h), over
    the stand-in runtime: C callbacks (ctypes) into ``FakeRuntime``, so the plane's copies, waits
    and records land in the same streams, events and call log as the loop's. The plane's thread
    takes the GIL for each call: slow, and only for tests. A call that fails (a copy out of reach)
    returns its CUresult, as the driver would, and is kept in ``errors``."""

    CONTEXT = 0xC0
    FUNCTIONS = {0xF8: 8, 0xF4: 4, 0xF2: 2, 0xF1: 1}  # the copy kernel's CUfunction stand-ins, by word

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.errors: list[BaseException] = []
        self.fail_copy_after: int | None = None  # the copies that succeed before every next one fails
        rt = runtime

        def guarded(fn, code=1):
            def call(*args):
                try:
                    return fn(*args)
                except BaseException as exc:  # noqa: BLE001 - reported as a CUresult, as a driver would
                    self.errors.append(exc)
                    return code
            return call

        def ctx_set_current(ctx):
            if ctx != self.CONTEXT:
                raise RuntimeError(f"cuCtxSetCurrent of an unknown context {ctx}")
            return 0

        def memcpy_async(dst, src, size, stream):
            if self.fail_copy_after is not None:
                if self.fail_copy_after <= 0:
                    return ILLEGAL_ADDRESS
                self.fail_copy_after -= 1
            rt.memcpyAsync(dst, src, size, 4, stream or 0)
            return 0

        def stream_wait_event(stream, event, flags):
            rt.streamWaitEvent(stream or 0, event or 0, flags)
            return 0

        def event_record(event, stream):
            rt.eventRecord(event or 0, stream or 0)
            return 0

        def event_create(out, flags):
            out[0] = rt.eventCreateWithFlags(flags)
            return 0

        def event_destroy(event):
            rt.eventDestroy(event or 0)
            return 0

        kernels: dict[int, RecordingKernel] = {}

        def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            # The arguments as the kernel reads them, from the device's view of pinned host memory.
            word = self.FUNCTIONS[function]
            p = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            dst_b, src_b, dst_o, src_o = (_U64.from_address(p[i]).value - rt.device_offset
                                          for i in (0, 1, 3, 4))
            count = ctypes.c_int.from_address(p[2]).value
            n, row_words = (ctypes.c_int64.from_address(p[i]).value for i in (5, 6))
            for lo, size in ((dst_b, 8 * count), (src_b, 8 * count), (dst_o, 8 * n), (src_o, 8 * n)):
                rt.check_reach(lo, lo + size, "cuLaunchKernel's arguments")

            def view(address: int, length: int, kind):
                return np.ctypeslib.as_array((kind * length).from_address(address))

            args = (view(dst_b, count, _U64), view(src_b, count, _U64), np.int32(count),
                    view(dst_o, n, ctypes.c_int64), view(src_o, n, ctypes.c_int64), np.int64(n),
                    np.int64(row_words))
            kernel = kernels.get(word)
            if kernel is None:
                kernel = kernels[word] = RecordingKernel(rt, SOURCE, KERNELS[word])
            rt.current_stream.append(stream or 0)  # the launch's stream, on the plane's thread
            try:
                kernel((gx,), (bx,), args)
            finally:
                rt.current_stream.pop()
            return 0

        types_ = [
            (ctypes.CFUNCTYPE(_RESULT, _PTR), ctx_set_current),
            (ctypes.CFUNCTYPE(_RESULT, _U64, _U64, ctypes.c_size_t, _PTR), memcpy_async),
            (ctypes.CFUNCTYPE(_RESULT, _PTR, _PTR, ctypes.c_uint), stream_wait_event),
            (ctypes.CFUNCTYPE(_RESULT, _PTR, _PTR), event_record),
            (ctypes.CFUNCTYPE(_RESULT, _PTR), lambda event: rt.eventQuery(event or 0)),
            (ctypes.CFUNCTYPE(_RESULT, ctypes.POINTER(_PTR), ctypes.c_uint), event_create),
            (ctypes.CFUNCTYPE(_RESULT, _PTR), event_destroy),
            (ctypes.CFUNCTYPE(_RESULT, _PTR, *[ctypes.c_uint] * 7, _PTR, _PTR, _PTR), launch_kernel),
        ]
        code = {memcpy_async: ILLEGAL_ADDRESS}
        self._callbacks = [kind(guarded(fn, code.get(fn, 1))) for kind, fn in types_]  # kept alive

    def entry_points(self) -> tuple[int, ...]:
        return tuple(ctypes.cast(cb, ctypes.c_void_p).value for cb in self._callbacks)


def make_fake_cupy() -> FakeCupy:
    return FakeCupy()


def install(monkeypatch) -> FakeCupy:
    """A stand-in GPU for the daemon in this process: CuPy, and the one driver call the daemon
    makes through libcuda (kvserver/media/cuda/driver.py)."""
    from kvserver.media import cuda
    from kvserver.media.cuda import driver

    cupy = make_fake_cupy()
    monkeypatch.setattr(cuda, "require_cuda", lambda: cupy)
    monkeypatch.setattr(driver, "allocation_range", cupy.cuda.runtime.address_range)
    # The plane's driver calls (used only where a test turns the plane's CUDA copies on: plane=True).
    cupy.driver = FakeDriver(cupy.cuda.runtime)
    monkeypatch.setattr(driver, "plane_entry_points", cupy.driver.entry_points)
    monkeypatch.setattr(driver, "stream_context", lambda stream: FakeDriver.CONTEXT)
    monkeypatch.setattr(driver, "kernel_functions", lambda cupy, ordinal: tuple(FakeDriver.FUNCTIONS))
    return cupy
