"""The daemon-wide host memory budget: one lazily committed arena carved into client regions.

The arena is a private anonymous mapping with MAP_NORESERVE: pages are committed on first touch,
so a large budget costs nothing until clients write into it, and a released region is handed back
to the kernel with MADV_DONTNEED. Handing back a large region takes time (~0.09 s per populated
GiB: benchmarks/bench_release.py), so ``discard`` does it in any thread without the GIL, before
``release`` returns the range.

With --host-memory-dir the arena is a shared mapping of a file there instead (``kept.KeptDir``), so
that the cache in it outlives the daemon: a region's memory is then taken when it is reserved
(``fallocate``: a full file system refuses it, where a later write would kill the daemon) and
freed with the file's blocks when it is released.

Memory the daemon keeps for what lies in the arena (the cache's per-page bookkeeping) is booked
against it as well: past a free allowance of 1/64 of the budget, every booked byte is one byte less
to reserve, so the daemon's memory stays within the budget however small the cache's pages.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import platform
import sys

import torch

from kvserver.config import format_size, machine_memory
from kvserver.errors import NoCapacity
from kvserver.host.kept import KeptDir

logger = logging.getLogger(__name__)

REGION_ALIGN = 1 << 21  # 2 MiB: regions start on huge-page boundaries
BOOK_ALLOWANCE = 64  # bookkeeping up to capacity / BOOK_ALLOWANCE is not charged to the budget
# Python names MAP_NORESERVE only from 3.13; without it the kernel's default overcommit check refuses
# a budget above the machine's memory and swap. Its value on Linux where the generic one holds.
_GENERIC_MMAN = ("x86_64", "aarch64", "riscv64")
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0) or (
    0x4000 if sys.platform == "linux" and platform.machine() in _GENERIC_MMAN else 0
)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class HostMemoryError(ValueError):
    """The budget cannot be mapped on this machine (address space, overcommit policy or limits)."""


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def aligned_capacity(capacity: int) -> int:
    """The bytes an arena of ``capacity`` has: whole regions."""
    return capacity // REGION_ALIGN * REGION_ALIGN


class HostArena:
    """First-fit allocator of aligned byte regions over one mapping of ``capacity`` bytes."""

    def __init__(self, capacity: int, kept: KeptDir | None = None) -> None:
        if capacity < REGION_ALIGN:
            raise ValueError(f"host memory must be at least {REGION_ALIGN} bytes, got {capacity}")
        self.capacity = aligned_capacity(capacity)
        self.kept = kept  # the arena is its file "arena"; None: private memory
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        try:
            if kept is not None:
                self._mm = kept.mapping("arena", self.capacity)
            else:
                self._mm = mmap.mmap(-1, self.capacity, flags=flags)
        except OSError as exc:
            raise HostMemoryError(
                f"cannot map {format_size(self.capacity)} of host memory ({exc.strerror}): this machine "
                f"has {format_size(machine_memory())}; give less with --host-memory (KVSERVER_HOST_MEMORY), "
                "as a size or as a share of it, e.g. --host-memory 60%"
            ) from None
        if self.capacity > machine_memory():
            logger.warning(
                "host memory %s is more than this machine's %s: it is committed as clients write, "
                "and writing all of it will swap or end in the OOM killer",
                format_size(self.capacity), format_size(machine_memory()),
            )
        self._views: dict[torch.dtype, torch.Tensor] = {}
        # Free ranges as parallel sorted lists of starts and sizes.
        self._free_starts: list[int] = [0]
        self._free_sizes: list[int] = [self.capacity]
        self.reserved = 0
        self.booked = 0  # bytes of bookkeeping kept for the arena's contents (see the module doc)

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole arena as a flat tensor of ``dtype`` (cached per dtype)."""
        t = self._views.get(dtype)
        if t is None:
            t = torch.frombuffer(self._mm, dtype=dtype, count=self.capacity // dtype.itemsize)
            self._views[dtype] = t
        return t

    @property
    def address(self) -> int:
        """The arena's first byte in this process."""
        return self.view(torch.uint8).data_ptr()

    @property
    def charged(self) -> int:
        """Booked bytes charged to the budget: those past the free allowance."""
        return max(0, self.booked - self.capacity // BOOK_ALLOWANCE)

    @property
    def available(self) -> int:
        """Bytes that may still be reserved: free, less the booked bytes charged."""
        return self.capacity - self.reserved - self.charged

    def largest_free(self) -> int:
        return min(max(self._free_sizes, default=0), self.available // REGION_ALIGN * REGION_ALIGN)

    def _fits(self, size: int, booked: int) -> bool:
        charged = max(0, self.booked + booked - self.capacity // BOOK_ALLOWANCE)
        return self.reserved + size + charged <= self.capacity

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

    def reserve(self, nbytes: int, commit: bool = True) -> int:
        """Reserves ``nbytes`` (rounded up to the alignment) and returns the region's offset.
        ``commit`` False: a kept arena's memory for it is taken later, by ``commit`` (which may
        take a while for a large region: in a worker thread), before anything touches it."""
        if nbytes == 0:  # an empty region: nothing to reserve (release of it is a no-op too)
            return 0
        size = _align_up(nbytes, REGION_ALIGN)
        for i, free in enumerate(self._free_sizes if self._fits(size, 0) else ()):
            if free >= size:
                start = self._free_starts[i]
                self._take(start, size, commit)
                return start
        raise NoCapacity(
            f"host memory exhausted: {nbytes} bytes requested, largest free region "
            f"{self.largest_free()} of {self.capacity} bytes"
        )

    def reserve_high(self, nbytes: int, booked: int = 0) -> int:
        """Like ``reserve``, but takes the free range with the highest address that fits and carves
        the region from its top: regions taken this way gather at the top of the arena, those of
        ``reserve`` at the bottom. ``booked``: bookkeeping bytes the region brings (returned with
        it to ``release``)."""
        size = _align_up(nbytes, REGION_ALIGN)
        fits = self._fits(size, booked)
        for i in range(len(self._free_sizes) - 1 if fits else -1, -1, -1):
            free = self._free_sizes[i]
            if free >= size:
                start = self._free_starts[i] + free - size
                self._take(start, size)
                self.booked += booked
                return start
        raise NoCapacity(
            f"host memory exhausted: {nbytes} bytes requested, largest free region "
            f"{self.largest_free()} of {self.capacity} bytes"
        )

    def commit(self, start: int, nbytes: int) -> None:
        """Takes a kept arena's memory for a region reserved with ``commit`` False (NoCapacity if
        the file system has none); nothing to do for private memory. Any thread."""
        size = _align_up(nbytes, REGION_ALIGN)
        if self.kept is not None and size and not self.kept.allocate("arena", start, size):
            raise NoCapacity(
                f"host memory: the file system of {self.kept.path} has no room for {size} more bytes "
                "(--host-memory-dir: give it a tmpfs as large as --host-memory)"
            )

    def _take(self, start: int, size: int, commit: bool = True) -> None:
        """Takes [start, start + size) out of the free range holding it; with a kept arena, its
        memory is taken now (NoCapacity, nothing taken, if the file system has none)."""
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
        self.reserved += size

    def reserve_at(self, start: int, nbytes: int, booked: int = 0) -> None:
        """Reserves the region at ``start`` (aligned; free): a kept cache's slab found again at the
        daemon's start. Its memory is already the file's: nothing is allocated or zeroed."""
        size = _align_up(nbytes, REGION_ALIGN)
        if start % REGION_ALIGN or start < 0 or start + size > self.capacity:
            raise ValueError(f"arena range [{start}, {start + size}) is not aligned inside the arena")
        self._take(start, size, commit=False)  # adopted bytes are kept as they are
        self.booked += booked

    def discard_free(self) -> None:
        """Frees the memory of every free range (a kept arena's file may hold what an earlier
        daemon left there: its clients' regions, slabs not adopted)."""
        for start, size in zip(self._free_starts, self._free_sizes, strict=True):
            self._punch(start, size)

    def _punch(self, start: int, size: int) -> None:
        if self.kept is not None:  # a shared mapping keeps the file's pages: free them there
            self.kept.punch("arena", start, size)
        elif _libc.madvise(self.address + start, size, mmap.MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise of {size} bytes at offset {start}: {os.strerror(err)}")

    def discard(self, start: int, nbytes: int) -> None:
        """Gives the pages of a reserved region back to the kernel (they read as zeros after), in
        whichever thread calls it: ctypes lets go of the GIL, so a worker thread doing this costs
        the event loop nothing. The region stays reserved until ``release``."""
        if nbytes == 0:
            return
        self._punch(start, _align_up(nbytes, REGION_ALIGN))

    def release(self, start: int, nbytes: int, discarded: bool = False, booked: int = 0) -> None:
        """Returns a region, first giving its pages back to the kernel unless ``discard`` did, so
        that whoever reserves the range next never reads what was there."""
        if nbytes == 0:
            return
        size = _align_up(nbytes, REGION_ALIGN)
        if not discarded:
            self._punch(start, size)
        self.reserved -= size
        self.booked -= booked
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

    def close(self) -> None:
        # Every client's host views are gone by now (clients are unregistered first): torch views
        # do not pin the mapping, so none may outlive this.
        self._views.clear()
        self._mm.close()
