"""Choosing what to evict: least recently used pages and slabs, chosen in batches.

Primitives: ``lru_pages`` (the k least recently used of a mask, by argpartition), ``lru_bytes``
(least recently used pages adding up to a number of bytes) and ``lru_slabs`` (slab ids with no busy
page, least recently used first).
"""

from __future__ import annotations

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


def lru_bytes(pages: PageTable, mask: np.ndarray, nbytes: int) -> np.ndarray:
    """Ids of the least recently used pages of ``mask`` whose bytes add up to at least ``nbytes``
    (all of them if they add up to less)."""
    ids = np.flatnonzero(mask)
    if nbytes <= 0 or not len(ids):
        return ids[:0]
    ids = ids[np.argsort(pages.stamp[ids], kind="stable")]
    total = np.cumsum(pages.nbytes[ids])
    return ids[: int(np.searchsorted(total, nbytes)) + 1]


def lru_slabs(pages: PageTable, nslabs: int, exclude_class: int = 0) -> np.ndarray:
    """Slab ids none of whose pages is busy, least recently used (by their newest page) first;
    without the slabs of pages of ``exclude_class`` bytes when it is not 0."""
    used = np.flatnonzero(pages.state != UNUSED)
    slab = pages.slab[used]
    busy = np.bincount(slab, weights=pages.busy()[used], minlength=nslabs) > 0
    present = np.bincount(slab, minlength=nslabs) > 0
    recent = np.zeros(nslabs, np.int64)
    np.maximum.at(recent, slab, pages.stamp[used])
    ok = present & ~busy
    if exclude_class:
        cls = np.zeros(nslabs, np.int64)
        cls[slab] = pages.nbytes[used]
        ok &= cls != exclude_class
    sids = np.flatnonzero(ok)
    return sids[np.argsort(recent[sids], kind="stable")]
