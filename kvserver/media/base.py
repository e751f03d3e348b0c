"""The one interface every medium's device pool implements (shared memory, CUDA).

A pool is opened by ``kvserver.media.open_pool`` from the Register request's description, gets
the client's host region once (``attach_host``), checks each copy request (``check_request``,
``check_sizes``), runs copy jobs (``start``) and is closed once with its client (``close``). The
copier owns what is the same for every medium (queueing, deadlines, stop words, busy marks and
progress); the pool owns how bytes move between its memory and the host.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserver.copies.job import Job
    from kvserver.copies.progress import LayerSignal
    from kvserver.copies.workers import Work

WIDE_DTYPES = {8: np.dtype(np.int64), 4: np.dtype(np.int32), 2: np.dtype(np.int16), 1: np.dtype(np.uint8)}


def wide_dtype(*sizes: int) -> np.dtype:
    """The widest integer dtype whose size divides every one of ``sizes``."""
    g = 0
    for s in sizes:
        g = math.gcd(g, s)
    for width, dtype in WIDE_DTYPES.items():
        if g % width == 0:
            return dtype
    return WIDE_DTYPES[1]


class DevicePool(ABC):
    """An engine's KV buffers as the daemon sees them: ``num_tokens`` token slots per (layer,
    part), grouped in pages of ``page_size`` tokens."""

    __slots__ = ()

    # Attributes (plain fields or properties of each medium):
    num_tokens: int
    page_size: int
    dtype: np.dtype  # the wide integer dtype of the client's host views (copies move its words)
    event_slots: int  # sets of per-layer load events a client can use at once (0: no events)
    event_handles: Sequence[bytes]  # IPC handles of the layer events, [slot * layers + layer]
    failed: str | None  # why the pool's work is given up on (the reaper reclaims it), or None

    @property
    def num_pages(self) -> int:
        """Whole pages of the pool."""
        return self.num_tokens // self.page_size

    @property
    @abstractmethod
    def paged(self) -> bool:
        """Whole device pages can be copied as rows (every buffer is page-contiguous)."""

    @property
    @abstractmethod
    def ipc_allocations(self) -> frozenset[bytes]:
        """The engine's device allocations this pool maps (empty where nothing is mapped by IPC):
        another pool of the same allocation that is still quarantined may write this memory."""

    @property
    def mapped_bytes(self) -> int:
        """Of the daemon's address space, what the pool's mappings of the engine's memory take
        (shared-memory pools; a CUDA pool's IPC mappings are the GPU's)."""
        return 0

    @property
    @abstractmethod
    def inline_ok(self) -> bool:
        """A small copy may run right on the event loop (it is a memcpy of host memory)."""

    @property
    @abstractmethod
    def records_events(self) -> bool:
        """A load says 'events recorded' before its first layer lands (the engine's compute
        stream then waits on the layer events)."""

    @abstractmethod
    def check_request(self, ready_event: bytes, event_slot: int) -> None:
        """Raises InvalidArgument if a copy request's event fields do not fit this medium."""

    def plane_buffers(self) -> tuple[list[int], int] | None:
        """Where the compiled data plane may copy this pool's tokens by itself (kvserver.lane.plane):
        the address of token 0 of every (layer, part) buffer, layer-major, and the bytes between
        tokens, shared by all; None where it may not (its copies then run on the event loop's side)."""
        return None

    def plane_setup(self, gate) -> None:  # noqa: B027 - shared memory needs nothing; CUDA overrides it
        """Gives the plane's new gate for this pool what only the medium knows (a CUDA pool's
        stream, events and driver); nothing for shared memory."""

    def plane_failed(self) -> str | None:
        """Why the plane gave up this pool's copies (a CUDA pool's stalled GPU work), latched as
        the pool's failure; None."""
        return None

    def check_plane(self) -> None:  # noqa: B027 - shared memory has nothing to raise; CUDA overrides it
        """Raises the pool's failure if the plane gave its copies up (``plane_failed``): a copy of
        the loop's that would wait behind them fails as they did. Nothing for shared memory."""

    @abstractmethod
    def check_sizes(self) -> None:
        """Raises if the pool's memory shrank under the daemon since it was opened."""

    @abstractmethod
    def check_cache_rows(self) -> None:
        """Raises unless copies to and from the node-wide cache's slabs can run now. Checked
        before the cache picks (and evicts for) the pages of a Put or Get, so a request the medium
        must refuse changes nothing; checked again when the copy starts."""

    @abstractmethod
    def attach_host(self, host_ptr: int, nbytes: int, num_layers: int) -> None:
        """Sets up copies with the client's host region (``nbytes`` at ``host_ptr``). Runs in a
        worker thread, once, before any copy."""

    @abstractmethod
    def start(self, job: Job, to_device: bool, signal: LayerSignal | None, executor: Executor,
              waiters: Executor, plane: Callable | None = None) -> Future[None]:
        """Starts a copy job: host to device for a load, else device to host. The returned future
        completes once the medium is done with every byte of the job (raising ``JobStopped`` if
        the job was stopped first, or the copy's error). ``executor`` is the copy workers' queue
        (``kvserver.copies.workers``: loads first, jobs in pieces) or ``INLINE``; ``waiters`` may
        hold threads that only wait for a device. A job dropped from the queue shows as a
        cancelled future; ``job.queued`` is what ``job.stop`` may cancel. ``signal`` (loads) gets
        every landed layer. ``plane``, where given, may run the job on the compiled data plane's
        thread instead (``plane(job, to_device, signal)``: its future, or None if it does not
        take the job); a medium the plane cannot copy for ignores it."""

    @abstractmethod
    def close(self) -> Future | None:
        """Releases the pool. None once everything is released; else a future that completes
        once it is (the device may still touch the host region until then)."""


class InlineExecutor(Executor):
    """Runs each submitted call at once in the caller's thread (a small copy on the event loop)."""

    threads = 1

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def submit_work(self, work: Work) -> Future:
        """Every piece in order, then its ``finish``."""
        work.future.set_running_or_notify_cancel()
        try:
            for i in range(work.pieces):
                if work.stopping(i):
                    break
                work.run(i)
            work.future.set_result(work.finish())
        except Exception as exc:
            work.future.set_exception(exc)
        work.ended = True
        return work.future


INLINE = InlineExecutor()
