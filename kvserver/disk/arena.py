"""The disk tier's file as regions: slabs of pages at file offsets, its blocks taken as they are used.

The file ``data`` in the disk cache's directory (``kept.KeptDir``: owner, mode and lock checked)
is as large as --disk-size and sparse: a slab's blocks are taken when it is reserved (``fallocate``:
a full file system refuses the slab, where a write would fail later) and freed when it is released.

Primitives: ``DiskArena`` (``Regions`` over the file, with ``fd`` and ``direct_fd`` to read and
write it).
"""

from __future__ import annotations

import logging

from kvserver.errors import NoCapacity
from kvserver.host.kept import KeptDir
from kvserver.host.regions import Regions

logger = logging.getLogger(__name__)

DATA = "data"


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
        if self.direct_fd < 0:
            logger.warning("the disk cache's file system (%s) does not do direct I/O: its pages go "
                           "through the page cache", kept.path)

    def reserve_high(self, nbytes: int, booked: int = 0) -> int:
        """A slab's region: the file has no client regions, so slabs go from its start up, in the
        order they are made (writes behind the host cache then run forward through the file)."""
        return self.reserve(nbytes, booked=booked)

    def _commit(self, start: int, size: int) -> None:
        if not self.kept.allocate(DATA, start, size):
            raise NoCapacity(f"disk cache: the file system of {self.kept.path} has no room for {size} "
                             "more bytes")

    def _punch(self, start: int, size: int) -> None:
        self.kept.punch(DATA, start, size)
