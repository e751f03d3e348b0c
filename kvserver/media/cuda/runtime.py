"""The GPU runtime, loaded the first time a CUDA client registers, never at import.

A daemon without CuPy, a driver or a GPU keeps serving shared-memory clients and refuses CUDA
registrations with FAILED_PRECONDITION and the reason.
"""

from __future__ import annotations

import functools
import logging
import threading

from kvserver.copies.transfer import load_torch, torch_needed
from kvserver.errors import FailedPrecondition

logger = logging.getLogger(__name__)

# One look at a time: registrations arriving together (off the event loop, each on its own
# thread) all wait for the first look's answer. CuPy's ``cuda.is_available()`` is not used: it
# says False to a second caller while the first is still starting the driver.
_probe_lock = threading.Lock()


@functools.cache
def _probe_once() -> tuple[object | None, str]:
    # CuPy finds the CUDA libraries it loads (the runtime, NVRTC for the copy kernels) where the GPU
    # check found them on an H200: with torch in the process, which loads its nvidia packages'
    # copies as it is imported (scripts/gpu_check.py's ``cupy_alone`` says whether CuPy finds them
    # without it). A daemon where CuPy is installed loaded it at its start (``kvserver.server``).
    if not torch_needed():  # no CuPy to find: nothing more loaded for a registration refused
        return None, "CuPy is not installed; install kvserver[cuda]"
    load_torch()
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc}); install kvserver[cuda]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError and friends, without importing their types
        if "no CUDA-capable device" in str(exc) or "cudaErrorNoDevice" in str(exc):
            return None, "no CUDA driver or GPU is visible to the daemon"
        return None, f"CUDA is not usable: {exc}"
    if count < 1:
        return None, "no CUDA driver or GPU is visible to the daemon"
    logger.info("CUDA available: %d device(s)", count)
    return cupy, ""


def _probe() -> tuple[object | None, str]:
    """(CuPy, "") where this daemon can use CUDA, else (None, why); looked at once."""
    with _probe_lock:
        return _probe_once()


def require_cuda():
    """CuPy, or FailedPrecondition saying why this daemon cannot serve CUDA pools."""
    cupy, why = _probe()
    if cupy is None:
        raise FailedPrecondition(
            f"this daemon cannot register CUDA pools: {why}. Shared-memory pools still work"
        )
    return cupy
