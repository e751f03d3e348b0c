"""A copy job: what one Write, Load, Put or Get asks a medium to copy, and how it is stopped.

A job names host rows (the client's own region pages, or cache pages as arena offsets), device
rows, the layers to copy, and a stop word that the copy reads before every layer. The medium
(``kvserver.media``) runs it; the copier (``kvserver.core.copier``) queues it, orders it among its
client's copies and reports its progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserver.copies import transfer
from kvserver.copies.workers import Work
from kvserver.errors import JobStopped


@dataclass(slots=True, eq=False)
class Job:
    """One copy between host rows and a device pool, as a medium runs it: what to copy, where the
    host rows lie, and the word that stops it. Whose copy it is stays with the copier
    (``kvserver.core.copier.ClientJob``): a medium never needs to know."""

    plan: transfer.CopyPlan
    local_layers: list[int]
    pages: np.ndarray
    region: transfer.BufferTable  # the client's own host region (rows are its pages)
    region_views: list[list[np.ndarray]]  # the same region as [layer][part] views (copies a part at a time)
    layer_token_bytes: int  # bytes of one token in one layer: every part (K and V) together
    ready_event: bytes = b""  # CUDA: the engine's event to wait on before copying
    event_slot: int = 0  # CUDA loads: whose layer events to record
    deadline: float = 0.0  # event-loop time at which the job stops (0: none), from timeout_ms
    # Read by the copy thread before every layer; nonzero once the job is to stop.
    stop_word: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    stop_reason: str = ""
    queued: Future | None = None  # the worker's future while the job may still be dropped
    # Where the host side lives: None for the client's own region (``pages`` are its pages, held
    # busy while the job runs); else a cache table whose rows are byte offsets in the arena, and
    # ``pages`` is empty (the cache holds those pages as being read or written).
    host_table: transfer.BufferTable | None = None
    # Called once on the event loop when the medium is done with every byte of the job's host
    # rows, with whether the copy completed: where the cache ends its read or write marks. Its
    # call may end first: a CUDA job given up on (stalled) settles only once its pool's GPU work
    # has drained, so the cache keeps such pages marked, and their slab pinned, until then.
    on_settled: Callable[[bool], None] | None = None
    # Set by the medium when the job's call ends before the device is done with its memory:
    # completes once that device work has drained.
    held: Future | None = None
    # Set once the medium has the job: from then on ``on_settled`` will be called. A job that
    # failed before (no descriptor left for its signal, the worker shut down) never will be.
    submitted: bool = False
    # Ordering among the client's copies (kvserver/copies/order.py): whether this is a load, the
    # earlier jobs it waits for, and its work in the copy queue (None until handed to it).
    load: bool = False
    after: list = field(default_factory=list)
    work: Work | None = None
    # Its turn among the compiled data plane's copies of its client (kvserver.core.copier.plane_turn),
    # given back when the job is released.
    turn: Any = None
    # A job of many pages: the region pages and device slots it names, as arrays of 1s made off
    # the loop (``kvserver.copies.order.dense_marks``), so that its marks on the loop are
    # whole-array adds, not scattered updates (300 ms for 4 Mi shuffled indices).
    dense: tuple[np.ndarray, np.ndarray] | None = None

    def ready(self) -> bool:
        """Whether every earlier job it must follow has ended (or was dropped) in the queue."""
        return all(p.work is None or p.work.ended or p.work.future.cancelled() for p in self.after)

    @property
    def host(self) -> transfer.BufferTable:
        return self.region if self.host_table is None else self.host_table

    @property
    def bytes_per_layer(self) -> int:
        return self.plan.num_tokens * self.layer_token_bytes

    @property
    def stopping(self) -> bool:
        return bool(self.stop_word[0])

    def stop(self, reason: str) -> None:
        """Asks the job to end: dropped if the worker has not taken it yet, else it ends at its
        next layer boundary. The first reason given is the one reported."""
        if not self.stop_reason:
            self.stop_reason = reason
        self.stop_word[0] = 1
        if self.queued is not None:
            self.queued.cancel()  # only succeeds while the job waits in the worker's queue

    def stopped(self, layers_done: int) -> JobStopped:
        return JobStopped(self.stop_reason or "cancelled", layers_done, len(self.local_layers))

    def check_ended(self, to_device: bool) -> None:
        """Called by the medium as the job's copy ends: raises JobStopped ("late") for a write
        (device to host) that ended after its deadline, which is therefore not done. Its engine
        gives up on the call by then (its deadline, then the Unregister that confirms the copy
        stopped) and may reuse the device pages the copy was still reading: a daemon stopped in
        the middle of a copy and resumed after that would otherwise keep, and the cache serve,
        torn KV. (The deadline is on the loop's clock, CLOCK_MONOTONIC as ``time.monotonic``,
        uvloop's a millisecond behind at most: a write is judged late no later than it should be.)"""
        if not to_device and self.deadline > 0 and time.monotonic() > self.deadline:
            raise JobStopped("late", len(self.local_layers), len(self.local_layers))
