"""Pages complete in every part of a space, counted as they come and go, so that Stats never
probes every key: per key, the number of parts that hold it committed.

The counts of all spaces live in one ``KeyIndex`` (owner: the space's number) with a count per
entry, so a key costs a fixed few dozen bytes, not a Python object; a space of one part needs no
counts at all.

Primitives: ``PartCounts`` (the shared table) and ``CompleteCount`` (``added``, ``removed``,
``value``).
"""

from __future__ import annotations

import itertools

import numpy as np

from kvserver.store.index import KeyIndex
from kvserver.store.keys import Keys
from kvserver.store.lazy import lazy_zeros
from kvserver.store.stack import IdPool


class PartCounts:
    """(space, key) -> parts of the space that hold the key committed."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        # At most one entry per cached page: sized for ``capacity`` pages, committed as used.
        self.index = KeyIndex(capacity)
        self.held = lazy_zeros(capacity, np.int32)
        self._ids = IdPool(capacity)
        self._spaces = itertools.count()

    def new_space(self) -> int:
        return next(self._spaces)

    def add(self, space: int, keys: Keys) -> np.ndarray:
        """Counts one more part for each key (distinct); returns the new counts."""
        ids = self.index.find(space, keys)
        new = ids < 0
        if new.any():
            fresh = self._ids.take(int(new.sum()))  # never None: an entry per cached page at most
            self.index.insert(fresh, space, keys.take(np.flatnonzero(new)))
            self.held[fresh] = 0
            ids[new] = fresh
        self.held[ids] += 1
        return self.held[ids]

    def remove(self, space: int, keys: Keys) -> np.ndarray:
        """Counts one part less for each key (distinct, each counted); returns the old counts, in
        key order (0 for a key not counted)."""
        found = self.index.find(space, keys)
        ids = found[found >= 0]
        old = np.zeros(len(keys), np.int32)
        old[found >= 0] = self.held[ids]
        self.held[ids] -= 1
        gone = ids[self.held[ids] == 0]
        self.index.remove(gone)
        self._ids.give(gone)
        return old


class CompleteCount:
    def __init__(self, num_parts: int, counts: PartCounts) -> None:
        self.num_parts = num_parts
        self.counts = counts
        self.space = counts.new_space()
        self.value = 0  # keys held committed by every part

    def added(self, keys: Keys) -> np.ndarray:
        """``keys`` were committed in one part (each once); returns the mask of those now held by
        every part (complete)."""
        if self.num_parts == 1 or not len(keys):
            self.value += len(keys)
            return np.ones(len(keys), bool)
        now = self.counts.add(self.space, keys) == self.num_parts
        self.value += int(np.count_nonzero(now))
        return now

    def removed(self, keys: Keys) -> np.ndarray:
        """``keys``, committed in one part, left it (each once); returns the mask of those that
        were complete until then."""
        if self.num_parts == 1 or not len(keys):
            self.value -= len(keys)
            return np.ones(len(keys), bool)
        was = self.counts.remove(self.space, keys) == self.num_parts
        self.value -= int(np.count_nonzero(was))
        return was
