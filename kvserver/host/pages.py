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
        taken = self.take(n)
        taken.mark()
        return taken.pages()

    def take(self, n: int) -> Taken:
        """Takes ``n`` free pages, the longest-free first, at the cost of copying the freed ones'
        ids: the never-allocated run is marked allocated here (one memset), the freed ones by
        ``Taken.mark`` and their list built by ``Taken.pages``, both in any thread (no one else
        is handed them meanwhile): 4 Mi pages cost the caller's thread a few milliseconds."""
        if n > self.num_free:
            raise NoCapacity(
                f"host region full: {n} pages requested, {self.num_free} of {self.num_pages} free"
            )
        self.version += 1
        first, fresh = self._fresh, min(n, self.num_pages - self._fresh)
        self.is_allocated[first : first + fresh] = True
        self._fresh += fresh
        rest = n - fresh
        reused = np.empty(rest, dtype=self._ring.dtype)
        if rest:
            at = min(rest, self.num_pages - self._head)
            reused[:at] = self._ring[self._head : self._head + at]
            reused[at:] = self._ring[: rest - at]
            self._head = (self._head + rest) % self.num_pages
            self._freed -= rest
        return Taken(self.is_allocated, first, fresh, reused)

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


class Taken:
    """Pages ``PageAllocator.take`` took: the run [first, first + fresh) and ``reused``."""

    __slots__ = ("_owned", "first", "fresh", "reused")

    def __init__(self, owned: np.ndarray, first: int, fresh: int, reused: np.ndarray) -> None:
        self._owned, self.first, self.fresh, self.reused = owned, first, fresh, reused

    def mark(self) -> None:
        """Marks the reused pages allocated (their bits alone: other threads may change others)."""
        if len(self.reused):
            self._owned[self.reused] = True

    def pages(self) -> np.ndarray:
        """The pages (int64), the run first."""
        out = np.empty(self.fresh + len(self.reused), dtype=np.int64)
        out[: self.fresh] = np.arange(self.first, self.first + self.fresh, dtype=np.int64)
        out[self.fresh :] = self.reused
        return out
