"""A load or a get in flight, as the synchronous client returns it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import grpc

from kvclient.errors import KVClientError, from_rpc_error
from kvserver.v1 import kvserver_pb2 as pb

# An on_error's answer that the outcome comes later, from another thread (LoadHandle._settle): a
# lane load's failure that the daemon must confirm, which no engine thread waits for.
LATER = object()

# Longest a waiter for a lane call's end sleeps at once: a waiter for one of its layers that comes
# meanwhile hears of the steps again at most this long after (LoadHandle._wait_for).
END_SLICE = 0.002


class LoadHandle:
    """A load in flight. ``wait_layer(i)`` returns True once global layer i has landed, or False
    if the load missed (resilient mode: the daemon went away; recompute instead). A Get's
    ``pages()`` says how many leading pages it loads; one that loads none lands no layer."""

    def __init__(self, layers: list[int], on_error: Callable[[KVClientError], bool] | None = None, *,
                 get: bool = False) -> None:
        self.layers = layers
        self.get = get
        self._pages: int | None = None  # a Get's stored prefix, from its first message
        self._part_pages: list[int] = []  # a Get with parts: each part's
        self.parts = 0  # a Get with parts: how many (set by get_parts)
        self._on_error = on_error  # True: the error is a miss, not raised
        # What the handle's state is read and changed under; a Condition over it is made only once
        # a thread must sleep (most lane loads are waited for by one thread, which never sleeps).
        self._lock = threading.RLock()
        self._cond: threading.Condition | None = None
        self._last_layer = -1
        self._done = False
        self._bytes = 0
        self._error: KVClientError | None = None
        self.missed = False
        # False only if the load failed and the daemon could not confirm that its copy stopped
        # (see docs/reliability.md): its device slots may then still be written for a while.
        self.confirmed = True
        self._recorded = False
        self.events: dict[int, object] = {}  # CUDA pools: global layer -> torch.cuda.Event
        self._source = None  # on the lane: its kvclient._transport.lane.LaneStream, pumped by waiters
        self._pumping = False
        self._sleepers = 0  # threads in self._cond.wait: a notification with none to wake is skipped

    @classmethod
    def miss(cls, layers: list[int], *, get: bool = False) -> LoadHandle:
        handle = cls(layers, get=get)
        handle.missed = True
        return handle

    def _apply(self, progress: pb.LoadProgress) -> None:
        self._update(progress.pages, progress.part_pages, progress.events_recorded, progress.layers_done,
                     progress.last_layer, progress.bytes, progress.done)

    def _update(self, pages: int, part_pages, recorded: bool, layers_done: int, last_layer: int, nbytes: int,
                done: bool) -> None:
        """One progress message's words (a LoadProgress, or the lane slot's progress words)."""
        with self._lock:
            if self._pages is None:
                self._pages = pages
                self._part_pages = list(part_pages)
            self._recorded = self._recorded or recorded
            if layers_done:
                self._last_layer = last_layer
            self._bytes = nbytes
            self._done = done
            self._notify()

    def _consume(self, stream: Iterable[pb.LoadProgress]) -> None:
        try:
            for progress in stream:
                self._apply(progress)
            if not self._done:
                raise KVClientError(grpc.StatusCode.INTERNAL, "load stream ended before the last layer")
        except grpc.RpcError as exc:
            self._fail(from_rpc_error(exc))
        except KVClientError as exc:
            self._fail(exc)
        except BaseException as exc:  # never leave waiters hanging
            self._fail(KVClientError(grpc.StatusCode.INTERNAL, f"load stream failed: {exc!r}"))

    def _fail(self, error: KVClientError) -> None:
        missed = self._on_error is not None and self._on_error(error)
        if missed is LATER:  # until then the load has not ended
            return
        self._settle(error, bool(missed))

    def _settle(self, error: KVClientError, missed: bool) -> None:
        """The load failed: a miss (resilient mode) or ``error``, raised to its waiters."""
        with self._lock:
            if missed:
                self.missed = True
            else:
                self._error = error
            self._notify()

    def _sleep(self, predicate: Callable[[], bool] | None, timeout: float | None) -> bool:
        """``Condition.wait_for`` (or ``wait`` without a predicate), counted in ``_sleepers`` (the
        lock held)."""
        if self._cond is None:
            self._cond = threading.Condition(self._lock)
        self._sleepers += 1
        try:
            if predicate is None:
                return self._cond.wait(timeout)
            return self._cond.wait_for(predicate, timeout)
        finally:
            self._sleepers -= 1

    def _notify(self) -> None:
        """Wakes the sleepers (the lock held)."""
        if self._sleepers:
            self._cond.notify_all()

    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None, end_only: bool = False) -> bool:
        """``Condition.wait_for`` (the condition held). On the lane (``_source``), no thread feeds
        the handle: one waiter at a time pumps the slot's progress, the others wait for its news.
        ``end_only``: the waiter needs the call's end, not its steps; while no other thread waits
        on the handle it sleeps through them (the daemon does not ring for them), ``END_SLICE``
        at a time, after which it pumps step by step for a waiter of a layer come meanwhile."""
        src = self._source
        if src is None or src.finished:
            return self._sleep(predicate, timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if predicate():
                return True
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            if src.finished:
                return self._sleep(predicate, left)
            if self._pumping:
                self._sleep(None, left)
                continue
            self._pumping = True
            self._lock.release()
            try:
                if end_only and not self._sleepers:
                    src.pump(self, END_SLICE if left is None else min(left, END_SLICE), True)
                else:
                    src.pump(self, left)
            finally:
                self._lock.acquire()
                self._pumping = False
                self._notify()

    def _drive(self) -> None:
        """Reads what the lane has for this handle now, without waiting."""
        with self._lock:
            self._pump_now()

    def _pump_now(self) -> None:
        src = self._source
        if src is None or src.finished or self._pumping:
            return
        self._pumping = True
        self._lock.release()
        try:
            src.pump(self, 0.0)
        finally:
            self._lock.acquire()
            self._pumping = False
            self._notify()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def ended(self) -> bool:
        """True once the load ended (every layer landed, or it missed or failed); never waits:
        on the lane it reads what has arrived for this handle."""
        with self._lock:
            self._pump_now()
            return self._done or self.missed or self._error is not None

    def landed(self, layer_id: int) -> bool:
        with self._lock:
            self._pump_now()
            self._check()
            return self._last_layer >= layer_id

    def wait_layer(self, layer_id: int, timeout: float | None = None) -> bool:
        if layer_id not in self.layers:
            raise ValueError(f"layer {layer_id} is not part of this load")
        with self._lock:
            ok = self._wait_for(
                lambda: self._error is not None or self.missed or self._done or self._last_layer >= layer_id,
                timeout,
            )
            self._check()
            if not ok:
                raise TimeoutError(f"layer {layer_id} did not land within {timeout} s")
            return self._last_layer >= layer_id and not self.missed

    def wait_recorded(self, timeout: float | None = None) -> bool:
        """CUDA pools: blocks until the daemon has recorded this load's layer events (one message,
        sent before the copies finish); False if the load missed."""
        with self._lock:
            ok = self._wait_for(
                lambda: self._error is not None or self.missed or self._recorded or self._done, timeout
            )
            self._check()
            if not ok:
                raise TimeoutError(f"layer events were not recorded within {timeout} s")
            return not self.missed

    def stream_wait_layer(self, layer_id: int, stream=None) -> bool:
        """CUDA pools: makes ``stream`` (default: the current one) wait on the GPU until global
        layer ``layer_id`` has landed; the CPU does not wait for the copy. False on a miss."""
        if self.missed:  # e.g. the daemon was away when the load was asked for: no events
            return False
        if layer_id not in self.events:
            raise ValueError(f"layer {layer_id} has no event in this load (not a CUDA pool, or not loaded)")
        if not self.wait_recorded() or (self.get and self._pages == 0):  # a Get of nothing: no events
            return False
        import torch

        (stream or torch.cuda.current_stream()).wait_event(self.events[layer_id])
        return True

    def pages(self, timeout: float | None = None) -> int:
        """Blocks until the first message: how many leading pages this Get loads (0 on a miss)."""
        with self._lock:
            ok = self._wait_for(
                lambda: self._error is not None or self.missed or self._pages is not None or self._done,
                timeout,
            )
            self._check()
            if not ok:
                raise TimeoutError(f"the get did not answer within {timeout} s")
            return 0 if self.missed else self._pages or 0

    def part_pages(self, timeout: float | None = None) -> list[int]:
        """A Get with parts: as ``pages``, each part's stored prefix (all 0 on a miss)."""
        self.pages(timeout)
        with self._lock:
            return [0] * self.parts if self.missed else list(self._part_pages)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for every layer; returns the bytes copied (0 if the load missed)."""
        with self._lock:
            ok = self._wait_for(lambda: self._error is not None or self.missed or self._done, timeout,
                                end_only=True)
            self._check()
            if not ok:
                raise TimeoutError(f"load did not finish within {timeout} s")
            return 0 if self.missed else self._bytes
