"""Ids in numpy arrays, 4 bytes an id, handed out and taken back in batches.

Primitives: ``IdStack`` (a stack: ``push``, ``pop``, ``__len__``) and ``IdPool`` (ids
below a limit: ``take`` those given back first, then new ones from the lowest; ``give`` back).
"""

from __future__ import annotations

import numpy as np

from kvserver.store.lazy import lazy_zeros


class IdStack:
    """``capacity``: the most ids it will ever hold, taken at once and committed as written (a
    stack of many ids never grows: growing copies it on the event loop, 16 ms for 4 Mi ids);
    without it, it grows by doubling (a slab's free pages: a few thousand ids at most)."""

    __slots__ = ("_ids", "_n")

    def __init__(self, capacity: int = 0) -> None:
        self._ids = lazy_zeros(capacity, np.int32) if capacity else np.empty(0, np.int32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push(self, ids: np.ndarray) -> None:
        """Pushes ``ids`` so that the first of them is popped first."""
        k = len(ids)
        if self._n + k > len(self._ids):
            grown = np.empty(max(2 * len(self._ids), self._n + k, 64), np.int32)
            grown[: self._n] = self._ids[: self._n]
            self._ids = grown
        self._ids[self._n : self._n + k] = ids[::-1]
        self._n += k

    def pop(self, k: int) -> np.ndarray:
        """Up to ``k`` ids (int64), the most recently pushed first."""
        k = min(k, self._n)
        out = self._ids[self._n - k : self._n][::-1].astype(np.int64)
        self._n -= k
        return out


class IdPool:
    """Ids below ``limit``: ``take`` hands out ids given back first, then never-used ones in
    ascending order (so a table indexed by them is written from its start)."""

    __slots__ = ("limit", "fresh", "_spare")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fresh = 0  # ids below it have been handed out at least once
        self._spare = IdStack(limit)  # ids given back

    @property
    def in_use(self) -> int:
        return self.fresh - len(self._spare)

    def take(self, n: int) -> np.ndarray | None:
        """``n`` ids (int64); None, taking nothing, if fewer than ``n`` are left."""
        if len(self._spare) + self.limit - self.fresh < n:
            return None
        ids = self._spare.pop(n)
        if len(ids) < n:
            k = n - len(ids)
            ids = np.concatenate([ids, np.arange(self.fresh, self.fresh + k, dtype=np.int64)])
            self.fresh += k
        return ids

    def give(self, ids: np.ndarray) -> None:
        self._spare.push(ids)

    def restore(self, ids: np.ndarray) -> None:
        """Starts over with exactly ``ids`` handed out (a kept cache's pages, adopted)."""
        self.fresh = int(ids.max()) + 1 if len(ids) else 0
        self._spare = IdStack(self.limit)
        self._spare.push(np.setdiff1d(np.arange(self.fresh, dtype=np.int64), ids))  # lowest first
