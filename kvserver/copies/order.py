"""Which earlier copies of one client a new copy must wait for.

Loads go first (``kvserver.copies.workers``), but never past a copy of the same client they depend
on. A client's copies keep their arrival order, with one exception: a load may start before the
client's earlier writes when it shares no host page and no device slot with any of them (it reads
no page they write, and writes no slot they read). So two writes to the same pages are applied
whole in arrival order, a load after a write of the same pages reads what that write stored, and
a load into slots an earlier write still reads waits for it; an engine's prefetch overtakes its
own unrelated offloads.

Host pages are the client's region pages (cache jobs have none: the cache hands out pages being
written to no reader); device slots are the pages of its pool (``page_size`` tokens each: a copy
of single tokens marks their pages, which orders it at worst behind a copy of other tokens of the
same page), so that marking costs one entry a page, never one a token. Loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserver.copies.job import Job


def device_pages(job: Job) -> np.ndarray:
    """The device pages a job's copy reads or writes (repeats possible)."""
    plan = job.plan
    pages = plan.device_pages
    return pages if pages is not None else plan.device_rows // plan.page_size


# A job naming more pages than this, and at least one in DENSE_SHARE of the client's region pages
# and device slots, is marked densely (``dense_marks``): its marks cost the loop a pass over the
# client's arrays (1-2 ms a 4 Mi entries), not a scattered update of one entry a page (12-25 ms a
# 1 Mi shuffled ones). Below that share the pass would cost more than the scattered update, and
# the arrays, one a job, more memory than the request.
DENSE_PAGES = 1 << 16
DENSE_SHARE = 8


def dense_pays(job: Job, region_pages: int, device_tokens: int, page_size: int) -> bool:
    """Whether ``job`` is marked densely (``DENSE_PAGES``)."""
    n, slots = len(job.pages), -(-device_tokens // page_size)
    return (n > DENSE_PAGES and n * DENSE_SHARE >= region_pages
            and len(device_pages(job)) * DENSE_SHARE >= slots)


def dense_marks(job: Job, region_pages: int, device_tokens: int, page_size: int) -> tuple[np.ndarray,
                                                                                          np.ndarray]:
    """Which region pages and device slots ``job`` names, as 1s in arrays as large as the
    client's: what its scattered marks add (any thread: numpy lets go of the GIL meanwhile)."""
    def count(ids: np.ndarray, n: int) -> np.ndarray:
        marks = np.zeros(n, np.int32)
        marks[ids] = 1
        return marks

    return count(job.pages, region_pages), count(device_pages(job), -(-device_tokens // page_size))


def mark(marks: np.ndarray, ids: np.ndarray | None, dense: np.ndarray | None, sign: int) -> None:
    """Adds (``sign`` 1) or takes back (-1) a job's marks: ``dense`` whole where it has them
    (``dense_marks``), else one at each of ``ids``."""
    if dense is None:
        marks[ids] += sign
    elif sign > 0:
        marks += dense
    else:
        marks -= dense


class JobOrder:
    def __init__(self, region_pages: int, device_tokens: int, page_size: int) -> None:
        self.unfinished: list[Job] = []  # arrival order
        # Unfinished writes' pages and slots (untouched, they take no memory until written).
        self._written = (np.zeros(region_pages, dtype=np.int32),
                         np.zeros(-(-device_tokens // page_size), dtype=np.int32))
        self._writes = 0

    def admit(self, job: Job, load: bool) -> list[Job]:
        """Registers ``job`` (a load if ``load``) and returns the earlier jobs it must wait for."""
        earlier = list(self.unfinished)
        if load and self._writes and not self._touches_writes(job):
            earlier = [j for j in earlier if j.load]
        job.load = load
        self.unfinished.append(job)
        if not load:
            self._mark(job, 1)
            self._writes += 1
        return earlier

    def finished(self, job: Job) -> None:
        """``job`` is over (or never started): it holds back nothing more."""
        try:
            self.unfinished.remove(job)
        except ValueError:
            return
        if not job.load:
            self._mark(job, -1)
            self._writes -= 1

    def _mark(self, job: Job, sign: int) -> None:
        pages, slots = self._written
        dense_pages, dense_slots = job.dense or (None, None)
        mark(pages, job.pages, dense_pages, sign)
        mark(slots, device_pages(job) if dense_slots is None else None, dense_slots, sign)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The marks' arrays: unfinished writes' pages and slots (for their pages to be faulted in
        ahead, off the loop)."""
        return self._written

    def _touches_writes(self, job: Job) -> bool:
        pages, slots = self._written
        if job.dense is not None:
            dense_pages, dense_slots = job.dense
            return bool(np.logical_and(pages, dense_pages).any() or np.logical_and(slots, dense_slots).any())
        return bool(pages[job.pages].any() or slots[device_pages(job)].any())
