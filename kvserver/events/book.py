"""Per-space logs of the node cache's KV events, read by engines through the Events call.

A key enters a space's log as stored when every part of the space holds it in a tier (host
memory, disk, or the cluster: what a Get of that engine's shape could load), and as removed when
one part stops holding it there: the tiers' listeners (``KVCache.on_complete``, the cluster's
publish results) call ``record``. A log is kept only for a space someone reads (an engine's
connector polling ``read``), from its first read on, and dropped after ``IDLE_SECONDS`` unread;
each holds at most ``MAX_LOG_KEYS`` keys and all together ``MAX_TOTAL_KEYS``, the oldest dropped
first (a reader that fell further behind is told of the gap); consecutive changes of one kind
share an event. Recording costs a copy of the keys' arrays on the event loop; their bytes are made
only when read, ``MAX_READ_KEYS`` at a time, and a read finds its place by its seq at once.

Every record goes to the daemon's ZMQ publisher too, when one runs (``publisher``), whose drop
count the metrics read there.

Primitives: ``EventBook`` (``record``, ``read``, ``listener``), ``LoggedEvent``, the mediums
``CPU`` and ``STORAGE`` and the localities ``LOCAL`` and ``REMOTE`` (vLLM's names).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

import numpy as np

from kvserver.store import Keys, Space, SpaceKey

CPU, STORAGE = "CPU", "STORAGE"  # vLLM's kv_offload mediums: host memory (here or a peer's), a disk
LOCAL, REMOTE = "LOCAL", "REMOTE"  # relative to the engine: this node, or another node's memory
MAX_LOG_KEYS = 1 << 17  # keys one space's log holds, at most
MAX_TOTAL_KEYS = 1 << 20  # keys all logs hold together, at most (the oldest of the fullest log go)
MAX_READ_KEYS = 8192  # keys one read returns, at most
CHUNK_KEYS = 4096  # keys of one logged event, at most (a larger change is logged in chunks)
IDLE_SECONDS = 120.0  # a log unread this long is dropped


@dataclass(slots=True)
class LoggedEvent:
    seq: int
    ts: float
    stored: bool
    medium: str
    locality: str
    keys: Keys  # owned copies


class _Log:
    """Events with contiguous seqs (``first_seq`` ..), so a read finds its place at once."""

    def __init__(self, log_id: str, now: float) -> None:
        self.id = log_id
        self.events: deque[LoggedEvent] = deque()
        self.keys = 0
        self.next_seq = 1
        self.read_at = now
        self.served = 0  # the highest seq a read returned: events up to it are not joined again

    def append(self, stored: bool, medium: str, locality: str, keys: Keys, ts: float) -> int:
        """Logs ``keys``; consecutive changes of one kind join the last event while it has room
        (a decode step stores a block or two a Put). Returns the keys logged."""
        last = self.events[-1] if self.events else None
        at = 0
        if (last is not None and last.seq > self.served
                and (last.stored, last.medium, last.locality) == (stored, medium, locality)
                and len(last.keys) < CHUNK_KEYS):
            at = min(len(keys), CHUNK_KEYS - len(last.keys))
            last.keys = concat(last.keys, keys[:at])
            last.ts = ts
        for start in range(at, len(keys), CHUNK_KEYS):
            chunk = keys[start : start + CHUNK_KEYS].copy()
            self.events.append(LoggedEvent(self.next_seq, ts, stored, medium, locality, chunk))
            self.next_seq += 1
        self.keys += len(keys)
        self.trim(MAX_LOG_KEYS)
        return len(keys)

    def trim(self, most: int) -> int:
        """Drops the oldest events down to ``most`` keys; returns the keys dropped."""
        dropped = 0
        while self.keys > most and self.events:
            n = len(self.events.popleft().keys)
            self.keys -= n
            dropped += n
        return dropped

    @property
    def first_seq(self) -> int:
        return self.events[0].seq if self.events else self.next_seq


def concat(a: Keys, b: Keys) -> Keys:
    """``a`` then ``b``, owned (wide keys' bytes at the wider of the two widths)."""
    raw = None
    if a.raw is not None or b.raw is not None:
        width = max(x.raw.shape[1] for x in (a, b) if x.raw is not None)
        raw = np.zeros((len(a) + len(b), width), np.uint8)
        if a.raw is not None:
            raw[: len(a), : a.raw.shape[1]] = a.raw
        if b.raw is not None:
            raw[len(a):, : b.raw.shape[1]] = b.raw
    return Keys(np.concatenate([a.words, b.words]), np.concatenate([a.lens, b.lens]), raw)


class Publisher(Protocol):
    """What the book hands every record to (the daemon's ``ZmqPublisher``)."""

    dropped_keys: int

    def record(self, space: SpaceKey, stored: bool, medium: str, locality: str, keys: Keys,
               ts: float) -> None: ...


class EventBook:
    """The logs of every space read lately; ``publisher`` (optional): given every record (the
    daemon's ZMQ publisher), and read by the metrics for its drop count."""

    def __init__(self, publisher: Publisher | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.id = secrets.token_hex(8)  # this daemon's logs: a reader of another's starts over
        self._logs: dict[SpaceKey, _Log] = {}
        self._generation = 0
        self._keys = 0  # keys all logs hold
        self.publisher = publisher
        self._clock = clock
        self.gaps = 0  # reads that found events dropped before them

    def listener(self, medium: str, locality: str) -> Callable[[bool, Space, Keys], None]:
        """A ``KVCache.on_complete`` listener recording a tier's changes with its medium and
        locality."""

        def heard(stored: bool, space: Space, keys: Keys) -> None:
            self.record(space.key, stored, medium, locality, keys)

        return heard

    def record(self, space: SpaceKey, stored: bool, medium: str, locality: str, keys: Keys) -> None:
        if not len(keys):
            return
        ts = time.time()
        if self.publisher is not None:
            self.publisher.record(space, stored, medium, locality, keys.copy(), ts)
        log = self._logs.get(space)
        if log is None:
            return
        if self._clock() - log.read_at > IDLE_SECONDS:  # nobody reads it any more
            self._drop(space)
            return
        before = log.keys
        log.append(stored, medium, locality, keys, ts)
        self._keys += log.keys - before
        if self._keys > MAX_TOTAL_KEYS:  # the fullest logs give way first
            for other in sorted(self._logs.values(), key=lambda x: -x.keys):
                self._keys -= other.trim(other.keys // 2)
                if self._keys <= MAX_TOTAL_KEYS:
                    break

    def _drop(self, space: SpaceKey) -> None:
        log = self._logs.pop(space, None)
        if log is not None:
            self._keys -= log.keys

    def sweep(self) -> None:
        """Drops the logs nobody read for ``IDLE_SECONDS``."""
        now = self._clock()
        for space in [k for k, log in self._logs.items() if now - log.read_at > IDLE_SECONDS]:
            self._drop(space)

    def read(self, space: SpaceKey, log_id: str, after_seq: int,
             max_keys: int = MAX_READ_KEYS) -> tuple[str, list[LoggedEvent], int, bool]:
        """The space's events after ``after_seq`` of log ``log_id`` (the id a read returned; "":
        a first read), up to ``max_keys`` keys (one event at least): (the log's id, events, the seq
        to read after next, whether events were dropped before them). A first read starts the log
        and returns none; a read of another log (a log started again, or another daemon's) returns
        none and a gap."""
        self.sweep()
        now = self._clock()
        log = self._logs.get(space)
        if log is None:
            self._generation += 1
            log = self._logs[space] = _Log(f"{self.id}.{self._generation}", now)
            return log.id, [], log.next_seq - 1, bool(log_id)
        log.read_at = now
        if log_id != log.id:
            if log_id:
                self.gaps += 1
            return log.id, [], log.next_seq - 1, bool(log_id)
        first = log.first_seq
        gap = after_seq + 1 < first
        if gap:
            self.gaps += 1
        out: list[LoggedEvent] = []
        total = 0
        max_keys = max(1, min(max_keys, MAX_READ_KEYS))
        for ev in islice(log.events, max(0, after_seq + 1 - first), None):
            if out and total + len(ev.keys) > max_keys:
                break
            out.append(ev)
            total += len(ev.keys)
        last = out[-1].seq if out else max(after_seq, first - 1)
        log.served = max(log.served, last)
        return log.id, out, last, gap
