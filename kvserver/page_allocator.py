"""Page allocator of one client's host region: a free list plus an allocated bitmap."""

from __future__ import annotations

from collections import deque

import numpy as np

from kvserver.errors import FailedPrecondition, InvalidArgument, NoCapacity, OutOfRange


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self.is_allocated = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_pages)

    def allocate(self, n: int) -> np.ndarray:
        if n > len(self.free_pages):
            raise NoCapacity(
                f"host region full: {n} pages requested, {len(self.free_pages)} of "
                f"{self.num_pages} free"
            )
        pages = np.fromiter((self.free_pages.popleft() for _ in range(n)), np.int64, count=n)
        self.is_allocated[pages] = True
        return pages

    def check_owned(self, pages: np.ndarray, what: str = "host") -> None:
        """Raises unless every page is in range, allocated, and listed once."""
        if pages.size == 0:
            return
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= self.num_pages:
            bad = lo if lo < 0 else hi
            raise OutOfRange(
                f"{what} page {bad} is outside this client's host region of {self.num_pages} pages"
            )
        missing = ~self.is_allocated[pages]
        if missing.any():
            raise FailedPrecondition(
                f"{what} page {int(pages[missing][0])} is not allocated to this client"
            )
        if np.unique(pages).size != pages.size:
            raise InvalidArgument(f"{what} indices name the same page more than once")

    def free(self, pages: np.ndarray) -> None:
        self.check_owned(pages)
        self.is_allocated[pages] = False
        self.free_pages.extend(pages.tolist())
