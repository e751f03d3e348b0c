"""How the daemon's process uses glibc's heap: what a free gives back to the system, and when.

glibc serves blocks under its mmap threshold from the heap, and a free that leaves more than its
trim threshold free at the heap's top gives all of that back at once (``systrim``: the kernel
unmaps it, page by page). Its thresholds slide up as large blocks are freed (to 32 MiB and 64
MiB), so a daemon soon serves blocks of up to 32 MiB from the heap, and a burst of them freed in
the order they were made (a Release of 128 leases of 128 Ki pins: 192 MiB of page ids) is given
back whole by the last free, on the event loop: 30-40 ms while no other engine's call ran.

The daemon fixes the mmap threshold where it would slide to (blocks of 32 MiB and more are
mapped, and unmapped alone when freed) and never trims the heap in a free: what its blocks under
32 MiB free stays with the process for the next ones, up to its peak use. That peak is outside
the host-memory budget once what it held is given back (a tenant's pins' bookkeeping, booked while
held: up to 192 MiB a tenant). Only glibc has these knobs (``mallopt``); elsewhere nothing
changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its sliding threshold (DEFAULT_MMAP_THRESHOLD_MAX)
NEVER_TRIM = -1  # glibc: "disables trimming completely" (an int past 2 GiB of free heap top would still trim)


def keep_freed_heap() -> bool:
    """Sets the process's heap as the daemon wants it (module docstring); False where the C library
    has no such knobs (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    if not ok:
        logger.debug("the C library took no heap thresholds (mallopt): frees may give memory back at once")
    return ok
