"""Per-space logs of the node cache's KV events, read by engines through the Events call.

A key enters a space's log as stored when every part of the space holds it in a tier (host
memory, disk, or the cluster: what a Get of that engine's shape could load), and as removed when
one part stops holding it there: the tiers' listeners (``KVCache.on_complete``, the cluster's
publish results) call ``record``. A log is kept only for a space someone reads (an engine's
connector polling ``read``), from its first read on, and dropped after ``IDLE_SECONDS`` unread;
each holds at most ``MAX_LOG_KEYS`` keys in at most ``MAX_LOG_EVENTS`` events, and all together
``MAX_TOTAL_KEYS`` in ``MAX_TOTAL_EVENTS``, the oldest dropped first (a reader that fell further
behind is told of the gap): an event costs about 0.45 KB beyond its keys' 33 bytes each, so a log
of one-key events is bounded by its events, not its keys. Consecutive changes of one kind share an
event. Recording costs a copy of the keys' arrays on the event loop; their bytes are made only when
read, ``MAX_READ_KEYS`` at a time, and a read finds its place by its seq at once (an index into the
log's list, whatever its length).

Every record goes to the daemon's ZMQ publisher too, when one runs (``publisher``), whose drop
count the metrics read there.

Primitives: ``EventBook`` (``record``, ``read``, ``listener``), ``LoggedEvent``, the mediums
``CPU`` and ``STORAGE`` and the localities ``LOCAL`` and ``REMOTE`` (vLLM's names).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvserver.store import Keys, Space, SpaceKey

CPU, STORAGE = "CPU", "STORAGE"  # vLLM's kv_offload mediums: host memory (here or a peer's), a disk
LOCAL, REMOTE = "LOCAL", "REMOTE"  # relative to the engine: this node, or another node's memory
MAX_LOG_KEYS = 1 << 17  # keys one space's log holds, at most
MAX_TOTAL_KEYS = 1 << 20  # keys all logs hold together, at most (the oldest of the fullest log go)
MAX_LOG_EVENTS = 1 << 13  # events one space's log holds, at most (~0.45 KB each beyond their keys)
MAX_TOTAL_EVENTS = 1 << 16  # events all logs hold together, at most (~30 MiB beyond their keys)
MAX_READ_KEYS = 8192  # keys one read returns, at most
CHUNK_KEYS = 4096  # keys of one logged event, at most (a larger change is logged in chunks)
IDLE_SECONDS = 120.0  # a log unread this long is dropped
SWEEP_SECONDS = 1.0  # every log is looked at for idle ones at most this often (by a read)


@dataclass(slots=True)
class LoggedEvent:
    seq: int
    ts: float
    stored: bool
    medium: str
    locality: str
    keys: Keys  # owned copies


class _Log:
    """Events with contiguous seqs (``first_seq`` ..), in a list whose first ``head`` slots are
    dropped events (compacted once they are half of it), so a read finds its place at once."""

    def __init__(self, log_id: str, now: float) -> None:
        self.id = log_id
        self._events: list[LoggedEvent | None] = []
        self._head = 0  # slots before it: dropped events (None)
        self.keys = 0
        self.next_seq = 1
        self.read_at = now
        self.served = 0  # the highest seq a read returned: events up to it are not joined again

    def __len__(self) -> int:
        return len(self._events) - self._head

    def append(self, stored: bool, medium: str, locality: str, keys: Keys, ts: float) -> int:
        """Logs ``keys``; consecutive changes of one kind join the last event while it has room
        (a decode step stores a block or two a Put). Returns the keys logged."""
        last = self._events[-1] if len(self) else None
        at = 0
        if (last is not None and last.seq > self.served
                and (last.stored, last.medium, last.locality) == (stored, medium, locality)
                and len(last.keys) < CHUNK_KEYS):
            at = min(len(keys), CHUNK_KEYS - len(last.keys))
            last.keys = concat(last.keys, keys[:at])
            last.ts = ts
        for start in range(at, len(keys), CHUNK_KEYS):
            chunk = keys[start : start + CHUNK_KEYS].copy()
            self._events.append(LoggedEvent(self.next_seq, ts, stored, medium, locality, chunk))
            self.next_seq += 1
        self.keys += len(keys)
        self.trim(MAX_LOG_KEYS, MAX_LOG_EVENTS)
        return len(keys)

    def trim(self, most_keys: int, most_events: int) -> None:
        """Drops the oldest events down to ``most_keys`` keys and ``most_events`` events."""
        events = self._events
        while (self.keys > most_keys or len(self) > most_events) and len(self):
            ev = events[self._head]
            assert ev is not None
            self.keys -= len(ev.keys)
            events[self._head] = None
            self._head += 1
        if self._head and self._head * 2 >= len(events):
            del events[: self._head]
            self._head = 0

    def after(self, seq: int, max_keys: int) -> list[LoggedEvent]:
        """The events after ``seq`` (from the first, if it is before it), up to ``max_keys`` keys
        (one event at least): found by index, so the cost is the events returned, wherever
        ``seq`` is in the log."""
        events = self._events
        out: list[LoggedEvent] = []
        total = 0
        for i in range(self._head + max(0, seq + 1 - self.first_seq), len(events)):
            ev = events[i]
            assert ev is not None
            if out and total + len(ev.keys) > max_keys:
                break
            out.append(ev)
            total += len(ev.keys)
        return out

    @property
    def first_seq(self) -> int:
        first = self._events[self._head] if len(self) else None
        return first.seq if first is not None else self.next_seq


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
        self._events = 0  # and their events
        self.publisher = publisher
        self._clock = clock
        self._swept = float("-inf")  # when ``sweep`` last looked at every log
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
        before = log.keys, len(log)
        log.append(stored, medium, locality, keys, ts)
        self._keys += log.keys - before[0]
        self._events += len(log) - before[1]
        if self._keys > MAX_TOTAL_KEYS:  # the fullest logs give way first
            for other in sorted(self._logs.values(), key=lambda x: -x.keys):
                self._trim(other, other.keys // 2, len(other))
                if self._keys <= MAX_TOTAL_KEYS:
                    break
        if self._events > MAX_TOTAL_EVENTS:
            for other in sorted(self._logs.values(), key=lambda x: -len(x)):
                self._trim(other, other.keys, len(other) // 2)
                if self._events <= MAX_TOTAL_EVENTS:
                    break

    def _trim(self, log: _Log, most_keys: int, most_events: int) -> None:
        before = log.keys, len(log)
        log.trim(most_keys, most_events)
        self._keys -= before[0] - log.keys
        self._events -= before[1] - len(log)

    def _drop(self, space: SpaceKey) -> None:
        log = self._logs.pop(space, None)
        if log is not None:
            self._keys -= log.keys
            self._events -= len(log)

    def sweep(self) -> None:
        """Drops the logs nobody read for ``IDLE_SECONDS``, looking at them all at most every
        ``SWEEP_SECONDS`` (each read did: 3.4 ms of the event loop at 64 Ki logs)."""
        now = self._clock()
        if now - self._swept < SWEEP_SECONDS:
            return
        self._swept = now
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
        if log is not None and now - log.read_at > IDLE_SECONDS:  # (idle since: the sweep's own rule)
            self._drop(space)
            log = None
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
        out = log.after(after_seq, max(1, min(max_keys, MAX_READ_KEYS)))
        last = out[-1].seq if out else max(after_seq, first - 1)
        log.served = max(log.served, last)
        return log.id, out, last, gap
