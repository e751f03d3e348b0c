"""Arrays sized for the most they may ever hold, whose memory the kernel commits only as they are
written: an anonymous private mapping with MAP_NORESERVE, as the host arena is. The cache's tables
never grow (growing copies the whole table on the event loop), and cost what they hold.

Primitives: ``lazy_zeros``.
"""

from __future__ import annotations

import mmap

import numpy as np

from kvserver.host.arena import MAP_NORESERVE


def lazy_zeros(n: int, dtype: type | np.dtype) -> np.ndarray:
    """A zeroed array of ``n`` items; a page of it takes memory once it is written."""
    nbytes = max(1, n * np.dtype(dtype).itemsize)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return np.frombuffer(mm, dtype=dtype, count=n)
