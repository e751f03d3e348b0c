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

import ctypes
import errno
import logging
import mmap
import os
import platform
import sys

import numpy as np

from kvserver.config import format_size, machine_memory
from kvserver.errors import NoCapacity
from kvserver.host.kept import KeptDir
from kvserver.host.regions import BOOK_ALLOWANCE, REGION_ALIGN, Regions, aligned_capacity
from kvserver.protocol.raw_memory import address_of, array_at

__all__ = ["BOOK_ALLOWANCE", "REGION_ALIGN", "HostArena", "HostMemoryError", "aligned_capacity"]

logger = logging.getLogger(__name__)

# Python names MAP_NORESERVE only from 3.13; without it the kernel's default overcommit check refuses
# a budget above the machine's memory and swap. Its value on Linux where the generic one holds.
_GENERIC_MMAN = ("x86_64", "aarch64", "riscv64")
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0) or (
    0x4000 if sys.platform == "linux" and platform.machine() in _GENERIC_MMAN else 0
)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


# Faults a range's pages in, writable, without changing what they hold (Linux 5.14 and later).
MADV_POPULATE_WRITE = 23


POPULATE_PIECE = 2 << 20  # bytes a call faults in: the process's mapping lock is held meanwhile


def populate(array: np.ndarray) -> None:
    """Faults in the whole pages of ``array`` for writing without changing what it holds, so that
    its first writes cost whoever makes them no page faults (tens of milliseconds for 16 MiB on
    this VM). Any thread, while others read or write it; the GIL is let go meanwhile. In pieces of
    ``POPULATE_PIECE``: each call holds the process's mapping lock, which other threads' mmap and
    munmap wait for (0.7 s for 256 MiB at once). Where the kernel has no MADV_POPULATE_WRITE,
    nothing is done."""
    page = mmap.PAGESIZE
    start = -(-array.ctypes.data // page) * page
    end = (array.ctypes.data + array.nbytes) // page * page
    for at in range(start, end, POPULATE_PIECE):
        if _libc.madvise(at, min(POPULATE_PIECE, end - at), MADV_POPULATE_WRITE) != 0:
            return  # (no such advice on this kernel, or no memory: first writes fault as before)


class HostMemoryError(ValueError):
    """The budget cannot be mapped on this machine (address space, overcommit policy or limits)."""


class HostArena(Regions):
    """The regions of one mapping of ``capacity`` bytes (``Regions``)."""

    def __init__(self, capacity: int, kept: KeptDir | None = None) -> None:
        if capacity < REGION_ALIGN:
            raise ValueError(f"host memory must be at least {REGION_ALIGN} bytes, got {capacity}")
        super().__init__(capacity)
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
        self._address: int | None = address_of(self._mm)
        self._views: dict[np.dtype, np.ndarray] = {}

    def view(self, dtype: np.dtype | type) -> np.ndarray:
        """The whole arena as a flat array of ``dtype`` (cached per dtype)."""
        dtype = np.dtype(dtype)
        t = self._views.get(dtype)
        if t is None:
            t = array_at(self.address, self.capacity, dtype)
            self._views[dtype] = t
        return t

    @property
    def address(self) -> int:
        """The arena's first byte in this process (RuntimeError once closed: it is unmapped)."""
        if self._address is None:
            raise RuntimeError("the host memory arena is closed")
        return self._address

    def _commit(self, start: int, size: int) -> None:
        if self.kept is not None and not self.kept.allocate("arena", start, size):
            raise NoCapacity(
                f"host memory: the file system of {self.kept.path} has no room for {size} more bytes "
                "(--host-memory-dir: give it a tmpfs as large as --host-memory)"
            )

    def _punch(self, start: int, size: int) -> None:
        if self.kept is not None:  # a shared mapping keeps the file's pages: free them there
            self.kept.punch("arena", start, size)
            return
        while _libc.madvise(self.address + start, size, mmap.MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            if err != errno.EINTR:  # (a signal: again)
                raise OSError(err, f"madvise of {size} bytes at offset {start}: {os.strerror(err)}")

    def close(self) -> None:
        # Every client's host views are gone by now (clients are unregistered first): views do not
        # pin the mapping (kvserver.protocol.raw_memory), so none may outlive this.
        self._views.clear()
        self._address = None
        self._mm.close()
