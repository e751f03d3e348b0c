"""What prepare_put and prepare_get hand the copier, and complete_put / complete_get take back.

Primitives: ``PutPlan`` and ``GetPlan``.
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

    @classmethod
    def merged(cls, part: Part, plans: list[tuple[int, PutPlan]], dropped: int = 0) -> PutPlan:
        """One plan of the plans of a request's steps (each with the position its keys start
        at), with ``dropped`` more keys dropped after them."""
        if len(plans) == 1 and plans[0][0] == 0:
            plan = plans[0][1]
            plan.dropped += dropped
            return plan

        def cat(arrays: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays) if arrays else _no_pages()

        return cls(part, cat([p.positions + s for s, p in plans]), cat([p.offsets for _, p in plans]),
                   sum(p.present for _, p in plans), sum(p.dropped for _, p in plans) + dropped,
                   cat([p.page_ids for _, p in plans]), cat([p.waiting + s for s, p in plans]))


@dataclass(slots=True)
class GetPlan:
    part: Part
    pages: int  # leading keys stored (committed) in the part
    offsets: np.ndarray  # int64 arena byte offsets of those pages, in key order
    lease_id: str  # lease ended at complete_get ("" for none)
    page_ids: np.ndarray = field(default_factory=_no_pages)  # the pages read; emptied once completed
