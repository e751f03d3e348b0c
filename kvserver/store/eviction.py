"""Choosing what to evict: least recently used pages and slabs, chosen in batches.

Primitives: ``lru_pages`` (the k least recently used of a mask, by argpartition) and ``lru_slabs``
(slab ids with no busy page, least recently used first, of some slabs or all but some).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvserver.store.pages import UNUSED, PageTable


def lru_pages(pages: PageTable, mask: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` pages of ``mask`` with the smallest stamps (all of them if fewer)."""
    ids = np.flatnonzero(mask)
    if k <= 0:
        return ids[:0]
    if len(ids) > k:
        ids = ids[np.argpartition(pages.stamp[ids], k - 1)[:k]]
    return ids


def lru_slabs(pages: PageTable, nslabs: int, exclude: Collection[int] = (),
              only: Collection[int] | None = None) -> np.ndarray:
    """Slab ids none of whose pages is busy, least recently used (by their newest page) first;
    without the slabs of ``exclude``, and of ``only`` alone when it is given."""
    used = np.flatnonzero(pages.state != UNUSED)
    slab = pages.slab[used]
    busy = np.bincount(slab, weights=pages.busy()[used], minlength=nslabs) > 0
    present = np.bincount(slab, minlength=nslabs) > 0
    recent = np.zeros(nslabs, np.int64)
    np.maximum.at(recent, slab, pages.stamp[used])
    ok = present & ~busy
    if exclude:
        ok[list(exclude)] = False
    if only is not None:
        ok &= np.isin(np.arange(nslabs), list(only))
    sids = np.flatnonzero(ok)
    return sids[np.argsort(recent[sids], kind="stable")]
