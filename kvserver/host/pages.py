"""Page allocator of one client's host region: a FIFO of free pages plus an allocated bitmap.

Every operation is a handful of numpy array operations, whatever the number of pages: no Python
object or loop per page. The free FIFO is the never-allocated pages ``[fresh, num_pages)`` (kept as
that one number, so a new region costs nothing) followed by a ring of freed pages in the order they
were freed. The arrays are allocated empty or zeroed, so the kernel commits their memory only as
pages are used: 5 bytes a page at most (4 in the ring, 1 in the bitmap).
"""

from __future__ import annotations

import numpy as np

from kvserver.copies.transfer import has_repeats
from kvserver.errors import FailedPrecondition, InvalidArgument, NoCapacity, OutOfRange


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.is_allocated = np.zeros(num_pages, dtype=bool)
        self._ring = np.empty(num_pages, dtype=np.int32 if num_pages <= 1 << 31 else np.int64)
        self._head = 0  # ring position of the oldest freed page
        self._freed = 0  # freed pages in the ring
        self._fresh = 0  # pages [fresh, num_pages) were never allocated
        self.version = 0  # bumped by every change: a check made meanwhile elsewhere is stale

    @property
    def num_free(self) -> int:
        return self.num_pages - self._fresh + self._freed

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, n: int) -> np.ndarray:
        """``n`` free pages (int64), the longest-free first."""
        if n > self.num_free:
            raise NoCapacity(
                f"host region full: {n} pages requested, {self.num_free} of {self.num_pages} free"
            )
        self.version += 1
        fresh = min(n, self.num_pages - self._fresh)
        pages = np.empty(n, dtype=np.int64)
        pages[:fresh] = np.arange(self._fresh, self._fresh + fresh, dtype=np.int64)
        self.is_allocated[self._fresh : self._fresh + fresh] = True
        self._fresh += fresh
        rest = n - fresh
        if rest:
            reused = pages[fresh:]
            first = min(rest, self.num_pages - self._head)
            reused[:first] = self._ring[self._head : self._head + first]
            reused[first:] = self._ring[: rest - first]
            self._head = (self._head + rest) % self.num_pages
            self._freed -= rest
            self.is_allocated[reused] = True
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
                f"{what} page {int(pages[missing.argmax()])} is not allocated to this client"
            )
        if has_repeats(pages):
            raise InvalidArgument(f"{what} indices name the same page more than once")

    def free(self, pages: np.ndarray, *, checked: bool = False) -> None:
        """Returns ``pages`` to the FIFO; ``checked`` says ``check_owned`` passed since the last
        change of this allocator."""
        if not checked:
            self.check_owned(pages)
        n = pages.size
        if n == 0:
            return
        self.version += 1
        self.is_allocated[pages] = False
        tail = (self._head + self._freed) % self.num_pages
        first = min(n, self.num_pages - tail)
        self._ring[tail : tail + first] = pages[:first]
        self._ring[: n - first] = pages[first:]
        self._freed += n
