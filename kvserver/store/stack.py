"""A stack of ids in one growable numpy array: 4 bytes an id, pushed and popped in batches.

Primitives: ``IdStack`` (``push``, ``pop``, ``drop``, ``__len__``).
"""

from __future__ import annotations

import numpy as np


class IdStack:
    __slots__ = ("_ids", "_n")

    def __init__(self) -> None:
        self._ids = np.empty(0, np.int32)
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

    def drop(self, ids: np.ndarray) -> None:
        """Removes ``ids`` wherever they are in the stack (ids not in it are ignored)."""
        held = self._ids[: self._n]
        kept = held[~np.isin(held, ids)]
        self._n = len(kept)
        self._ids[: self._n] = kept
