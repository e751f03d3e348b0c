"""Slabs: runs of equal-sized pages taken from the top of the host arena, one size class each.

Primitives: ``Slab``, ``SlabPool.grow`` (reserve one more slab of a class), ``SlabPool.take`` /
``SlabPool.give`` (free pages of a class out and back) and ``SlabPool.release`` (a slab back to
the arena, its hooks called first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvserver.errors import NoCapacity
from kvserver.host.arena import REGION_ALIGN, HostArena
from kvserver.store.pages import FREE, PageTable

logger = logging.getLogger(__name__)


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(slots=True)
class Slab:
    sid: int
    offset: int
    nbytes: int
    page_bytes: int
    pages: np.ndarray  # page ids, page i at offset + i * page_bytes
    free: int  # pages of it that hold nothing


class SlabPool:
    """The cache's slabs and, per page size class, its free pages."""

    def __init__(self, arena: HostArena, pages: PageTable, slab_bytes: int) -> None:
        self.arena = arena
        self.pages = pages
        self.slab_bytes = slab_bytes
        self.slabs: dict[int, Slab] = {}
        self.bytes = 0
        self.on_slab_added: list[Callable[[int, int], None]] = []
        self.on_slab_removed: list[Callable[[int, int], None]] = []
        self._free: dict[int, list[int]] = {}  # page bytes -> free page ids (taken from the end)
        self._spare_sids: list[int] = []
        self._next_sid = 0

    @property
    def nslabs(self) -> int:
        """One past the highest slab id in use (the length of per-slab arrays)."""
        return self._next_sid

    def per_slab(self, page_bytes: int) -> int:
        return max(1, self.slab_bytes // page_bytes)

    def free_count(self, page_bytes: int) -> int:
        return len(self._free.get(page_bytes, ()))

    def grow(self, page_bytes: int) -> bool:
        """Reserves one more slab of pages of ``page_bytes``; False if the arena has no room."""
        n = self.per_slab(page_bytes)
        nbytes = _align_up(n * page_bytes, REGION_ALIGN)
        try:
            offset = self.arena.reserve_high(nbytes)
        except NoCapacity:
            return False
        sid = self._spare_sids.pop() if self._spare_sids else self._new_sid()
        ids = self.pages.take(n)
        p = self.pages
        p.state[ids] = FREE
        p.offset[ids] = offset + np.arange(n, dtype=np.int64) * page_bytes
        p.slab[ids] = sid
        p.nbytes[ids] = page_bytes
        p.part[ids] = -1
        p.tenant[ids] = -1
        p.stamp[ids] = 0
        self.slabs[sid] = Slab(sid, offset, nbytes, page_bytes, ids, n)
        self._free.setdefault(page_bytes, []).extend(ids[::-1].tolist())
        self.bytes += nbytes
        for hook in self.on_slab_added:
            hook(offset, nbytes)
        return True

    def _new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid - 1

    def take(self, page_bytes: int, n: int) -> np.ndarray:
        """``n`` free pages of the class (at most as many as it has)."""
        free = self._free.get(page_bytes, [])
        n = min(n, len(free))
        if n == 0:
            return np.empty(0, np.int64)
        ids = np.array(free[-n:][::-1], dtype=np.int64)
        del free[-n:]
        self._count(ids, -1)
        return ids

    def give(self, ids: np.ndarray, release_empty: bool = True) -> list[int]:
        """Puts cleared pages back among the free ones; releases slabs left empty unless told not
        to. Returns the ids of the slabs the pages belong to."""
        if not len(ids):
            return []
        for page_bytes in np.unique(self.pages.nbytes[ids]).tolist():
            chunk = ids[self.pages.nbytes[ids] == page_bytes]
            self._free.setdefault(page_bytes, []).extend(chunk[::-1].tolist())
        sids = self._count(ids, 1)
        if release_empty:
            self.release_empty(sids)
        return sids

    def _count(self, ids: np.ndarray, sign: int) -> list[int]:
        sids, counts = np.unique(self.pages.slab[ids], return_counts=True)
        for sid, count in zip(sids.tolist(), counts.tolist(), strict=True):
            self.slabs[sid].free += sign * count
        return sids.tolist()

    def release_empty(self, sids: Iterable[int]) -> None:
        """Releases those of the slabs whose pages all hold nothing."""
        empty = [s for s in set(sids) if s in self.slabs and self.slabs[s].free == len(self.slabs[s].pages)]
        if empty:
            self.release(empty)

    def release(self, sids: list[int]) -> None:
        """Gives slabs back to the arena; their pages must all be free."""
        slabs = [self.slabs.pop(s) for s in sids]
        ids = np.concatenate([s.pages for s in slabs])
        for page_bytes in {s.page_bytes for s in slabs}:
            free = np.array(self._free[page_bytes], dtype=np.int64)
            self._free[page_bytes] = free[~np.isin(free, ids)].tolist()
        self.pages.give(ids)
        for slab in slabs:
            for hook in self.on_slab_removed:
                hook(slab.offset, slab.nbytes)
            self.arena.release(slab.offset, slab.nbytes)
            self.bytes -= slab.nbytes
            self._spare_sids.append(slab.sid)
        logger.debug("released %d cache slabs", len(slabs))
