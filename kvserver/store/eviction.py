"""Choosing what to evict: least recently used pages and slabs, chosen in batches.

Primitives: ``EvictionQueue`` (a size class's least recently used pages, ranked once for many Puts) and
``lru_slabs`` (slab ids with no busy page, least recently used first, of some slabs or all but
some).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from kvserver.store.pages import COMMITTED, UNUSED, PageTable


class EvictionQueue:
    """A size class's least recently used pages, ranked once and handed out over many Puts.

    Ranking a class's pages costs a pass over all of them; doing it for every step of every Put
    that evicts made each step cost the size of the class. The queue ranks the oldest eighth of
    the class (at least what is asked) and pops from it; a page is handed out only if it is still
    the class's, evictable, and untouched since the ranking (same stamp), so the queue never
    evicts a page used since. Pages it missed (unpinned or unread since) wait for the next ranking.
    """

    __slots__ = ("ids", "stamps", "pos")

    def __init__(self) -> None:
        self.ids = np.empty(0, np.int64)
        self.stamps = np.empty(0, np.int64)
        self.pos = 0

    def pop(self, pages: PageTable, class_pages: Callable[[], np.ndarray], tenant: int, page_bytes: int,
            k: int) -> np.ndarray:
        """Up to ``k`` evictable pages of the class, least recently used first."""
        out: list[np.ndarray] = []
        ranked = False
        while k > 0:
            if self.pos >= len(self.ids):
                if ranked:
                    break
                taken = np.concatenate(out) if out else None
                self._rank(pages, class_pages(), k, taken)
                ranked = True
                continue
            ids = self.ids[self.pos : self.pos + 2 * k]
            ok = ((pages.state[ids] == COMMITTED) & (pages.pins[ids] == 0) & (pages.readers[ids] == 0)
                  & (pages.stamp[ids] == self.stamps[self.pos : self.pos + len(ids)])
                  & (pages.tenant[ids] == tenant) & (pages.nbytes[ids] == page_bytes))
            good = np.flatnonzero(ok)[:k]
            out.append(ids[good])
            k -= len(good)
            self.pos += int(good[-1]) + 1 if k == 0 else len(ids)
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def _rank(self, pages: PageTable, ids: np.ndarray, k: int, taken: np.ndarray | None) -> None:
        ids = ids[(pages.state[ids] == COMMITTED) & (pages.pins[ids] == 0) & (pages.readers[ids] == 0)]
        if taken is not None:  # handed out by this pop already, from the ranking before
            ids = ids[~np.isin(ids, taken)]
        q = min(len(ids), max(k, len(ids) // 8))
        if q < len(ids):
            ids = ids[np.argpartition(pages.stamp[ids], q - 1)[:q]]
        ids = ids[np.argsort(pages.stamp[ids], kind="stable")]
        self.ids, self.stamps, self.pos = ids, pages.stamp[ids].copy(), 0


def lru_slabs(pages: PageTable, nslabs: int, exclude: Collection[int] = (),
              only: Collection[int] | None = None) -> np.ndarray:
    """Slab ids none of whose pages is busy, least recently used (by their newest page) first;
    without the slabs of ``exclude``, and of ``only`` alone when it is given."""
    used = np.flatnonzero(pages.state != UNUSED)
    slab = pages.slab[used]
    busy = np.bincount(slab[pages.busy()[used]], minlength=nslabs) > 0
    present = np.bincount(slab, minlength=nslabs) > 0
    recent = pages.slab_stamp[:nslabs]  # kept by PageTable.touch: no pass over every page here
    ok = present & ~busy
    if exclude:
        ok[list(exclude)] = False
    if only is not None:
        ok &= np.isin(np.arange(nslabs), list(only))
    sids = np.flatnonzero(ok)
    return sids[np.argsort(recent[sids], kind="stable")]
