"""Aligned byte regions of a fixed capacity: the allocator under the host arena and the disk tier.

A first-fit allocator over free ranges kept as parallel sorted lists, handing out regions of whole
``REGION_ALIGN`` units, from the bottom (``reserve``) or the top (``reserve_high``). Bookkeeping
bytes the daemon keeps for what lies in the regions are booked against the same capacity: past a
free allowance of 1/``BOOK_ALLOWANCE`` of it, every booked byte is one byte less to reserve.

What backs the regions (memory, a file) is the subclass's: ``_commit`` takes it for a region,
``_punch`` frees it.

Primitives: ``Regions`` (``reserve`` / ``reserve_high`` / ``reserve_at`` / ``commit`` / ``discard`` /
``release``, ``hold`` / ``unhold``, ``held``, ``book`` / ``unbook``, ``largest_free``, ``discard_free``),
``REGION_ALIGN``, ``BOOK_ALLOWANCE``.
"""

from __future__ import annotations

import bisect
import logging

from kvserver.errors import NoCapacity

logger = logging.getLogger(__name__)

REGION_ALIGN = 1 << 21  # 2 MiB: regions start on huge-page boundaries
BOOK_ALLOWANCE = 64  # bookkeeping up to capacity / BOOK_ALLOWANCE is not charged to the capacity


def align_down(n: int, a: int) -> int:
    return n // a * a


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def aligned_capacity(capacity: int) -> int:
    """The bytes of whole regions in ``capacity``."""
    return capacity // REGION_ALIGN * REGION_ALIGN


class Regions:
    """First-fit allocator of aligned byte regions over ``capacity`` bytes."""

    what = "host memory"  # what the regions are, as errors name it
    # A range whose freeing failed may be handed out again: only where nothing is read from it
    # before it is written (never for memory a client gets as its region).
    reuse_unfreed = False

    def __init__(self, capacity: int) -> None:
        self.capacity = aligned_capacity(capacity)
        # Free ranges as parallel sorted lists of starts and sizes.
        self._free_starts: list[int] = [0]
        self._free_sizes: list[int] = [self.capacity]
        self.reserved = 0
        self.booked = 0  # bytes of bookkeeping kept for the regions' contents (see the module doc)
        self.claimed = 0  # budget claimed by held ranges (``hold``), not reserved
        # Reserved ranges their holder let go, kept for a region in the making (``Room``) until given
        # back: counted in ``reserved``.
        self.leaving = 0

    @property
    def charged(self) -> int:
        """Booked bytes charged to the budget: those past the free allowance."""
        return max(0, self.booked - self.capacity // BOOK_ALLOWANCE)

    @property
    def held(self) -> int:
        """The budget held for regions in the making (``Room``): held free ranges' claims and let-go
        ranges still reserved."""
        return self.claimed + self.leaving

    @property
    def available(self) -> int:
        """Bytes that may still be reserved: free, less the booked bytes charged and the budget
        held ranges claim."""
        return self.capacity - self.reserved - self.claimed - self.charged

    def free_ranges(self) -> tuple[list[int], list[int]]:
        """The free ranges' starts and sizes, in address order (copies)."""
        return list(self._free_starts), list(self._free_sizes)

    def largest_free(self) -> int:
        return min(max(self._free_sizes, default=0), self.available // REGION_ALIGN * REGION_ALIGN)

    def _fits(self, size: int, booked: int) -> bool:
        charged = max(0, self.booked + booked - self.capacity // BOOK_ALLOWANCE)
        return self.reserved + self.claimed + size + charged <= self.capacity

    def can_book(self, nbytes: int) -> bool:
        return self._fits(0, nbytes)

    def book(self, nbytes: int) -> bool:
        """Books ``nbytes`` of bookkeeping with no region (``unbook`` gives them back); False,
        booking nothing, if the budget has no room for them."""
        if not self._fits(0, nbytes):
            return False
        self.booked += nbytes
        return True

    def unbook(self, nbytes: int) -> None:
        self.booked -= nbytes

    def reserve(self, nbytes: int, commit: bool = True, booked: int = 0) -> int:
        """Reserves ``nbytes`` (rounded up to the alignment) and returns the region's offset.
        ``commit`` False: a kept arena's memory for it is taken later, by ``commit`` (which may
        take a while for a large region: in a worker thread), before anything touches it.
        ``booked``: as ``reserve_high``'s."""
        if nbytes == 0:  # an empty region: nothing to reserve (release of it is a no-op too)
            return 0
        size = align_up(nbytes, REGION_ALIGN)
        for i, free in enumerate(self._free_sizes if self._fits(size, booked) else ()):
            if free >= size:
                start = self._free_starts[i]
                self._take(start, size, commit)
                self.booked += booked
                return start
        raise NoCapacity(
            f"{self.what} exhausted: {nbytes} bytes requested, largest free region "
            f"{self.largest_free()} of {self.capacity} bytes"
        )

    def reserve_high(self, nbytes: int, booked: int = 0) -> int:
        """Like ``reserve``, but takes the free range with the highest address that fits and carves
        the region from its top: regions taken this way gather at the top of the arena, those of
        ``reserve`` at the bottom. ``booked``: bookkeeping bytes the region brings (returned with
        it to ``release``)."""
        size = align_up(nbytes, REGION_ALIGN)
        fits = self._fits(size, booked)
        for i in range(len(self._free_sizes) - 1 if fits else -1, -1, -1):
            free = self._free_sizes[i]
            if free >= size:
                start = self._free_starts[i] + free - size
                self._take(start, size)
                self.booked += booked
                return start
        raise NoCapacity(
            f"{self.what} exhausted: {nbytes} bytes requested, largest free region "
            f"{self.largest_free()} of {self.capacity} bytes"
        )

    def commit(self, start: int, nbytes: int) -> None:
        """Takes the backing store of a region reserved with ``commit`` False (NoCapacity if there
        is none); nothing to do for memory committed on first touch. Any thread."""
        size = align_up(nbytes, REGION_ALIGN)
        if size:
            try:
                self._commit(start, size)
            except NoCapacity:  # a file system that took some of it before it ran out keeps that
                try:  # (ext4): given back, the range holds nothing yet
                    self._punch(start, size)
                except OSError as exc:  # (one that cannot punch holes: the refusal stands)
                    logger.warning("giving back the room a refused region took failed: %s", exc)
                raise

    def _commit(self, start: int, size: int) -> None:
        """Takes the backing store of [start, start + size) (subclasses that have one)."""

    def _punch(self, start: int, size: int) -> None:
        """Frees the backing store of [start, start + size): it reads as zeros after."""
        raise NotImplementedError

    def discard(self, start: int, nbytes: int) -> None:
        """Frees the backing store of a reserved region (it reads as zeros after), in whichever
        thread calls it: the subclasses' ``_punch`` lets go of the GIL, so a worker thread doing
        this costs the event loop nothing. The region stays reserved until ``release``."""
        if nbytes == 0:
            return
        self._punch(start, align_up(nbytes, REGION_ALIGN))

    def _take(self, start: int, size: int, commit: bool = True, count: bool = True) -> None:
        """Takes [start, start + size) out of the free range holding it; with a kept arena, its
        memory is taken now (NoCapacity, nothing taken, if the file system has none). ``count``
        False: not reserved either (``hold``)."""
        i = bisect.bisect_right(self._free_starts, start) - 1
        fs, fz = (self._free_starts[i], self._free_sizes[i]) if i >= 0 else (0, 0)
        if not (i >= 0 and fs <= start and start + size <= fs + fz):
            raise ValueError(f"arena range [{start}, {start + size}) is not free")
        if commit:
            self.commit(start, size)
        del self._free_starts[i], self._free_sizes[i]
        if start + size < fs + fz:  # what is left above it
            self._free_starts.insert(i, start + size)
            self._free_sizes.insert(i, fs + fz - start - size)
        if fs < start:  # and below it
            self._free_starts.insert(i, fs)
            self._free_sizes.insert(i, start - fs)
        if count:
            self.reserved += size

    def hold(self, start: int, nbytes: int, most: int) -> int:
        """Takes the free range at ``start`` out of the free ranges without reserving it: no one
        else can reserve it, and it claims of the budget only what is left of it, up to its size
        and ``most`` (where the bookkeeping charged keeps most of the free bytes from use, holding
        them all would overdraw the budget, and others would evict at once to pay it back).
        Returns that claim, which ``unhold`` gives back with the range."""
        size = align_up(nbytes, REGION_ALIGN)
        self._take(start, size, commit=False, count=False)
        claim = max(0, min(size, self.available, most))
        self.claimed += claim
        return claim

    def unhold(self, start: int, nbytes: int, claim: int) -> None:
        """A range ``hold`` took is free again (it held nothing), its claim given back."""
        self.claimed -= claim
        self._give(start, align_up(nbytes, REGION_ALIGN))

    def reserve_at(self, start: int, nbytes: int, booked: int = 0) -> None:
        """Reserves the region at ``start`` (aligned; free): a kept cache's slab found again at the
        daemon's start. Its memory is already the file's: nothing is allocated or zeroed."""
        size = align_up(nbytes, REGION_ALIGN)
        if start % REGION_ALIGN or start < 0 or start + size > self.capacity:
            raise ValueError(f"arena range [{start}, {start + size}) is not aligned inside the arena")
        self._take(start, size, commit=False)  # adopted bytes are kept as they are
        self.booked += booked

    def discard_free(self) -> None:
        """Frees the memory of every free range (a kept arena's file may hold what an earlier
        daemon left there: its clients' regions, slabs not adopted). A range that cannot be freed
        is taken out of use where its contents must never reach anyone (``reuse_unfreed``)."""
        for start, size in list(zip(self._free_starts, self._free_sizes, strict=True)):
            try:
                self._punch(start, size)
            except OSError as exc:
                logger.warning("%s: freeing [%d, %d) failed (%s)", self.what, start, start + size, exc)
                if not self.reuse_unfreed:
                    self._take(start, size, commit=False)

    def release(self, start: int, nbytes: int, discarded: bool = False, booked: int = 0) -> None:
        """Returns a region, first giving its pages back to the kernel unless ``discard`` did, so
        that whoever reserves the range next never reads what was there."""
        if nbytes == 0:
            return
        size = align_up(nbytes, REGION_ALIGN)
        self.booked -= booked
        if not discarded:
            try:
                self._punch(start, size)
            except OSError as exc:
                if not self.reuse_unfreed:  # what was there must never reach the next holder
                    logger.error("%s: freeing [%d, %d) failed (%s): the range is not used again",
                                 self.what, start, start + size, exc)
                    return
                logger.warning("%s: freeing [%d, %d) failed (%s)", self.what, start, start + size, exc)
        self.reserved -= size
        self._give(start, size)

    def _give(self, start: int, size: int) -> None:
        """[start, start + size) joins the free ranges."""
        i = bisect.bisect_left(self._free_starts, start)
        self._free_starts.insert(i, start)
        self._free_sizes.insert(i, size)
        # Merge with the next, then the previous neighbour.
        if i + 1 < len(self._free_starts) and start + size == self._free_starts[i + 1]:
            self._free_sizes[i] += self._free_sizes.pop(i + 1)
            self._free_starts.pop(i + 1)
        if i > 0 and self._free_starts[i - 1] + self._free_sizes[i - 1] == start:
            self._free_sizes[i - 1] += self._free_sizes.pop(i)
            self._free_starts.pop(i)

