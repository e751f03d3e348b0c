"""What prepare_put and prepare_get hand the copier, and complete_put / complete_get take back.

Primitives: ``PutPlan`` (and ``PutPlans``, a request's steps' plans as one) and ``GetPlan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserver.store.spaces import Part


def _no_pages() -> np.ndarray:
    return np.empty(0, np.int64)


@dataclass(slots=True)
class PutPlan:
    part: Part
    positions: np.ndarray  # int64, ascending: indices into the request's keys of the pages to copy
    offsets: np.ndarray  # int64: arena byte offset of each new page
    present: int  # keys skipped: stored already (committed)
    dropped: int  # keys not stored for want of room or quota (always the last ones)
    page_ids: np.ndarray = field(default_factory=_no_pages)  # the new pages; emptied once completed
    waiting: np.ndarray = field(default_factory=_no_pages)  # positions of keys another Put is writing


class PutPlans:
    """The plans of a request's steps gathered into one as they come (``add``): each step's part
    written into arrays sized for the whole request, so that ``plan`` copies nothing (a Put of
    128 Ki keys concatenating its 128 steps' arrays at its end held the loop 3-5 ms at once). A
    request of one step is its step's plan."""

    def __init__(self, part: Part, n: int) -> None:
        self.part, self.n = part, n
        self.steps: list[PutPlan] = []  # each step's own plan (given back one by one, if given up)
        self._arrays: tuple[np.ndarray, ...] | None = None  # positions, offsets, page_ids, waiting
        self._new = self._waiting = self.present = self.dropped = 0

    def add(self, start: int, plan: PutPlan) -> None:
        """A step's plan, its keys from position ``start`` of the request's."""
        self.steps.append(plan)
        self.present += plan.present
        self.dropped += plan.dropped
        if start == 0 and len(self.steps) == 1:
            return
        if self._arrays is None:  # a second step: the first one's written in first
            first = self.steps[0]
            self._arrays = tuple(np.empty(self.n, np.int64) for _ in range(4))
            self._write(0, first)
        self._write(start, plan)

    def _write(self, start: int, plan: PutPlan) -> None:
        assert self._arrays is not None
        positions, offsets, page_ids, waiting = self._arrays
        a, b = self._new, self._new + len(plan.positions)
        np.add(plan.positions, start, out=positions[a:b])
        offsets[a:b] = plan.offsets
        page_ids[a:b] = plan.page_ids
        self._new = b
        a, b = self._waiting, self._waiting + len(plan.waiting)
        np.add(plan.waiting, start, out=waiting[a:b])
        self._waiting = b

    def plan(self, dropped: int = 0) -> PutPlan:
        """The request's plan, with ``dropped`` more keys dropped after its steps'."""
        if self._arrays is None:
            plan = self.steps[0] if self.steps else PutPlan(self.part, _no_pages(), _no_pages(), 0, 0)
            plan.dropped += dropped
            return plan
        positions, offsets, page_ids, waiting = self._arrays
        n = self._new
        return PutPlan(self.part, positions[:n], offsets[:n], self.present, self.dropped + dropped,
                       page_ids[:n], waiting[: self._waiting])


@dataclass(slots=True)
class GetPlan:
    part: Part
    pages: int  # leading keys stored (committed) in the part
    offsets: np.ndarray  # int64 arena byte offsets of those pages, in key order
    lease_id: str  # lease ended at complete_get ("" for none)
    page_ids: np.ndarray = field(default_factory=_no_pages)  # the pages read; emptied once completed
