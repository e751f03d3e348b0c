"""The disk tier's file as regions: slabs of pages at file offsets, its blocks taken as they are used.

The file ``data`` in the disk cache's directory (``kept.KeptDir``: owner, mode and lock checked)
is as large as --disk-size and sparse: a slab's blocks are taken when it is reserved (``fallocate``:
a full file system refuses the slab, where a write would fail later) and freed when it is released.
A ``fallocate`` waits on the file system's journal, which the tier's own writes keep busy (up to
100 ms each on ext4 here while eight writer threads ran): the writer takes the blocks of the next
slabs ahead of time in a worker thread (``ahead``), and a slab reserved over them costs the event
loop no call.

Primitives: ``DiskArena`` (``Regions`` over the file, with ``fd`` and ``direct_fd`` to read and
write it; ``ahead`` and ``take_ahead``).
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np

from kvserver.errors import NoCapacity
from kvserver.host.kept import KeptDir
from kvserver.host.regions import REGION_ALIGN, Regions

logger = logging.getLogger(__name__)

DATA = "data"
FULL_PAUSE_SECONDS = 30.0  # after a take ahead found the file system full, none for this long


class DiskArena(Regions):
    """Regions of the file ``data`` of ``capacity`` bytes in ``kept``."""

    what = "disk cache"
    # Every disk page is written before it is read, and checked when read: a range whose hole
    # could not be punched (a file system without hole punching) is used again as it is.
    reuse_unfreed = True

    def __init__(self, capacity: int, kept: KeptDir) -> None:
        super().__init__(capacity)
        self.kept = kept
        self.fd = kept.file(DATA, self.capacity)
        self.direct_fd = kept.direct(DATA)  # -1: the file system has no direct I/O
        # Per REGION_ALIGN unit of the file: free, its blocks taken already (``take_ahead``).
        self._ready = np.zeros(self.capacity // REGION_ALIGN, bool)
        # A take ahead found the file system full: none is tried again before this (monotonic) time
        # (a slab's own ``fallocate`` says so meanwhile, as ever; the file system may find room).
        self.full_until = 0.0
        self.punches = 0  # holes punched: a take ahead under way across one marks nothing
        if self.direct_fd < 0:
            logger.warning("the disk cache's file system (%s) does not do direct I/O: its pages go "
                           "through the page cache", kept.path)

    def reserve_high(self, nbytes: int, booked: int = 0) -> int:
        """A slab's region: the file has no client regions, so slabs go from its start up, in the
        order they are made (writes behind the host cache then run forward through the file)."""
        return self.reserve(nbytes, booked=booked)

    def ahead(self, nbytes: int, least: int) -> list[tuple[int, int]]:
        """The free ranges, up to ``nbytes`` of them from the file's start, that the next slabs
        will take (free ranges of at least ``least`` bytes: reserve takes the first that fits)
        and whose blocks are not taken yet; for ``take_ahead`` in a worker thread."""
        out: list[tuple[int, int]] = []
        full = time.monotonic() < self.full_until
        left = 0 if full else (nbytes + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN
        for start, size in zip(self._free_starts, self._free_sizes, strict=True):  # (read, not copied)
            if left <= 0:
                break
            if size < least:
                continue
            size = min(size, left)
            left -= size
            units = self._ready[start // REGION_ALIGN : (start + size) // REGION_ALIGN]
            for run in np.split(np.arange(len(units)), np.flatnonzero(np.diff(units.astype(np.int8))) + 1):
                if len(run) and not units[run[0]]:
                    out.append((start + int(run[0]) * REGION_ALIGN, len(run) * REGION_ALIGN))
        return out

    def take_ahead(self, start: int, size: int) -> bool:
        """Takes the blocks of [start, start + size) (any thread); False if the file system is
        full (nothing is tried ahead for ``FULL_PAUSE_SECONDS``; a slab's own ``fallocate`` says so
        as ever)."""
        try:
            if self.kept.allocate(DATA, start, size):
                return True
        except OSError as exc:  # (a slab's own fallocate meets it, and says so, as ever)
            logger.warning("the disk cache could not take blocks ahead of time: %s", exc)
        self.full_until = time.monotonic() + FULL_PAUSE_SECONDS
        return False

    def took_ahead(self, start: int, size: int, punches: int) -> None:
        """On the loop, once ``take_ahead`` of the range is done: its units still free count as
        taken (a slab reserved over one meanwhile took it itself); none where a hole was punched
        since ``punches`` was read (the take may have run before it)."""
        if punches != self.punches:
            return
        starts, sizes, end = self._free_starts, self._free_sizes, start + size
        i = max(0, bisect.bisect_right(starts, start) - 1)  # the free ranges over it only
        while i < len(starts) and starts[i] < end:
            lo, hi = max(starts[i], start), min(starts[i] + sizes[i], end)
            if lo < hi:
                self._ready[lo // REGION_ALIGN : hi // REGION_ALIGN] = True
            i += 1

    def _commit(self, start: int, size: int) -> None:
        units = slice(start // REGION_ALIGN, (start + size) // REGION_ALIGN)
        if self._ready[units].all():
            self._ready[units] = False
            return
        self._ready[units] = False
        if not self.kept.allocate(DATA, start, size):
            raise NoCapacity(f"disk cache: the file system of {self.kept.path} has no room for {size} "
                             "more bytes")

    def _punch(self, start: int, size: int) -> None:
        self._ready[start // REGION_ALIGN : (start + size) // REGION_ALIGN] = False
        self.punches += 1
        self.kept.punch(DATA, start, size)
