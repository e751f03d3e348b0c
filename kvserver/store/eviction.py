"""Choosing what to evict: least recently used pages and slabs, chosen in batches.

Primitives: ``EvictionQueue`` (a size class's least recently used pages, ranked a window at a time
for many Puts) and ``lru_slabs`` (of some slabs, those with no busy page, least recently used
first).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping

import numpy as np

from kvserver.store.pages import COMMITTED, PageTable

RANK_WINDOW = 1 << 17  # pages of a size class one ranking looks at, at most (a few milliseconds)


class EvictionQueue:
    """A size class's least recently used pages, ranked in windows and handed out over many Puts.

    Ranking a class's pages costs a pass over them; doing it for every step of every Put that
    evicts made each step cost the size of the class. The queue ranks the class a window at a
    time, whole slabs of at most ``RANK_WINDOW`` pages, the next window starting where the last
    one ended (a clock hand over the class's slabs), and hands out the window's oldest eighth (at
    least what is asked). A class of up to ``RANK_WINDOW`` pages is one window: exact LRU; a larger
    one is approximate LRU as a clock is, and no ranking costs more than a window, however large
    the class. A page is handed out only if it is still the class's, evictable, and untouched
    since the ranking (same stamp), so the queue never evicts a page used since.
    """

    __slots__ = ("ids", "stamps", "pos", "hand")

    def __init__(self) -> None:
        self.ids = np.empty(0, np.int64)
        self.stamps = np.empty(0, np.int64)
        self.pos = 0
        self.hand = -1  # the last slab id of the last window

    def pop(self, pages: PageTable, slabs: Callable[[], Mapping[int, np.ndarray]], tenant: int,
            page_bytes: int, k: int) -> np.ndarray:
        """Up to ``k`` evictable pages of the class, least recently used first; ``slabs`` gives
        the class's slabs (id -> page ids)."""
        out: list[np.ndarray] = []
        ranked = False
        while k > 0:
            if self.pos >= len(self.ids):
                if ranked:
                    break
                taken = np.concatenate(out) if out else None
                self._rank(pages, self._window(slabs(), k), k, taken)
                ranked = True
                continue
            ids = self.ids[self.pos : self.pos + 2 * k]
            ok = ((pages.state[ids] == COMMITTED) & (pages.pins[ids] == 0) & (pages.readers[ids] == 0)
                  & (pages.stamp[ids] == self.stamps[self.pos : self.pos + len(ids)])
                  & (pages.tenant[ids] == tenant) & (pages.nbytes[ids] == page_bytes)
                  & ~pages.slab_leaving[pages.slab[ids]])
            good = np.flatnonzero(ok)[:k]
            out.append(ids[good])
            k -= len(good)
            self.pos += int(good[-1]) + 1 if k == 0 else len(ids)
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def _window(self, slabs: Mapping[int, np.ndarray], k: int) -> np.ndarray:
        """The pages of the class's next slabs after the hand, whole slabs, until the window
        holds ``RANK_WINDOW`` pages (or ``8 k``, or the class)."""
        sids = sorted(slabs)
        if not sids:
            return np.empty(0, np.int64)
        start = bisect.bisect_right(sids, self.hand)
        order = sids[start:] + sids[:start]
        limit, window, n = max(RANK_WINDOW, 8 * k), [], 0
        for sid in order:
            if n >= limit:
                break
            window.append(slabs[sid])
            n += len(slabs[sid])
            self.hand = sid
        return np.concatenate(window)

    def _rank(self, pages: PageTable, ids: np.ndarray, k: int, taken: np.ndarray | None) -> None:
        ids = ids[(pages.state[ids] == COMMITTED) & (pages.pins[ids] == 0) & (pages.readers[ids] == 0)
                  & ~pages.slab_leaving[pages.slab[ids]]]
        if taken is not None:  # handed out by this pop already, from the ranking before
            ids = ids[~np.isin(ids, taken)]
        q = min(len(ids), max(k, len(ids) // 8))
        if q < len(ids):
            ids = ids[np.argpartition(pages.stamp[ids], q - 1)[:q]]
        ids = ids[np.argsort(pages.stamp[ids], kind="stable")]
        self.ids, self.stamps, self.pos = ids, pages.stamp[ids].copy(), 0


def lru_slabs(pages: PageTable, sids: Collection[int]) -> np.ndarray:
    """Of slabs ``sids``, those none of whose pages is pinned, read or written (and not being
    evicted in steps already), least recently used (by their newest page) first. The table keeps
    these per slab as pages change: a pass over the slabs, never one over their pages."""
    ids = np.fromiter(sids, np.int64, len(sids))
    ids = ids[~pages.busy_slabs(ids) & ~pages.slab_leaving[ids]]
    return ids[np.argsort(pages.slab_stamp[ids], kind="stable")]
