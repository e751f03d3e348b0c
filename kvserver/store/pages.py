"""The per-page state of the cache as growable numpy arrays, indexed by page id.

Primitives: ``PageTable`` (arrays: LRU stamp, pins, readers, state, part, tenant, arena offset,
slab and page bytes; the key of each page), ``PageTable.take`` / ``give`` (page ids for a new slab
and back), ``PageTable.touch`` (prefix-end-first stamps) and ``PageTable.evictable``.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

UNUSED = 0  # id not in any slab
FREE = 1  # in a slab, holds nothing
WRITING = 2  # being written: invisible to lookup and get, never evicted
COMMITTED = 3  # stored: visible, evictable unless pinned or being read

_ARRAYS = {
    "stamp": np.int64,
    "pins": np.int32,
    "readers": np.int32,
    "state": np.int8,
    "part": np.int32,
    "tenant": np.int32,
    "offset": np.int64,
    "slab": np.int32,
    "nbytes": np.int64,
}


class PageTable:
    """Arrays of per-page state; an array doubles when the ids run out."""

    def __init__(self, capacity: int = 1024) -> None:
        self.size = 0
        self.keys: list[bytes | None] = []
        self._spare: list[int] = []
        self._tick = 0
        self.stamp = self.pins = self.readers = self.state = np.empty(0)
        self.part = self.tenant = self.offset = self.slab = self.nbytes = np.empty(0)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.size
        for name, dtype in _ARRAYS.items():
            arr = np.zeros(capacity, dtype)
            arr[:old] = getattr(self, name)[:old]
            setattr(self, name, arr)
        self.part[old:] = -1
        self.keys.extend(repeat(None, capacity - old))
        self._spare.extend(range(capacity - 1, old - 1, -1))
        self.size = capacity

    def take(self, n: int) -> np.ndarray:
        """``n`` unused page ids, ascending where possible."""
        if len(self._spare) < n:
            self._grow(max(2 * self.size, self.size + n))
        ids = self._spare[-n:]
        del self._spare[-n:]
        return np.array(ids[::-1], dtype=np.int64)

    def give(self, ids: np.ndarray) -> None:
        """Page ids of a released slab go back to the spare ids."""
        self.state[ids] = UNUSED
        self._spare.extend(ids[::-1].tolist())

    def touch(self, ids: np.ndarray) -> None:
        """Marks pages used, in key order: the first is made the most recently used."""
        n = len(ids)
        if n:
            self.stamp[ids] = np.arange(self._tick + n, self._tick, -1, dtype=np.int64)
            self._tick += n

    def set_keys(self, ids: np.ndarray, keys: list[bytes]) -> None:
        list(map(self.keys.__setitem__, ids.tolist(), keys))

    def keys_of(self, ids: np.ndarray) -> list[bytes]:
        return list(map(self.keys.__getitem__, ids.tolist()))

    def clear(self, ids: np.ndarray) -> None:
        """Makes pages free: no key, no part, no stamp."""
        self.state[ids] = FREE
        self.part[ids] = -1
        self.tenant[ids] = -1
        self.stamp[ids] = 0
        list(map(self.keys.__setitem__, ids.tolist(), repeat(None)))

    def evictable(self) -> np.ndarray:
        """Mask of pages eviction may take: committed, not pinned, not being read."""
        return (self.state == COMMITTED) & (self.pins == 0) & (self.readers == 0)

    def busy(self) -> np.ndarray:
        """Mask of pages that hold their slab: pinned, being read or being written."""
        return (self.state == WRITING) | (self.pins > 0) | (self.readers > 0)
