"""Pages complete in every part of a space, counted as they come and go, so that Stats never
probes every key: per key, the number of parts that hold it committed.

Primitives: ``CompleteCount`` (``added``, ``removed``, ``value``). Each call costs one dict probe
and one store per key, in C (``map``, ``compress``), and a numpy count; a space of one part needs
no dict at all.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat

import numpy as np


class CompleteCount:
    def __init__(self, num_parts: int) -> None:
        self.num_parts = num_parts
        self.parts_of: dict[bytes, int] = {}  # key -> parts that hold it committed (2+ parts only)
        self.value = 0  # keys held committed by every part

    def added(self, keys: list[bytes]) -> None:
        """``keys`` were committed in one part (each once)."""
        if self.num_parts == 1 or not keys:
            self.value += len(keys)
            return
        held = np.fromiter(map(self.parts_of.get, keys, repeat(0)), np.int64, len(keys)) + 1
        deque(map(self.parts_of.__setitem__, keys, held.tolist()), maxlen=0)
        self.value += int(np.count_nonzero(held == self.num_parts))

    def removed(self, keys: list[bytes]) -> None:
        """``keys``, committed in one part, left it (each once)."""
        if self.num_parts == 1 or not keys:
            self.value -= len(keys)
            return
        held = np.fromiter(map(self.parts_of.__getitem__, keys), np.int64, len(keys))
        self.value -= int(np.count_nonzero(held == self.num_parts))
        held -= 1
        gone = (held == 0).tolist()
        deque(map(self.parts_of.pop, compress(keys, gone)), maxlen=0)
        kept = held != 0
        deque(map(self.parts_of.__setitem__, compress(keys, kept.tolist()), held[kept].tolist()), maxlen=0)
