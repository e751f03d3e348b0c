"""The GPU runtime, loaded the first time a CUDA client registers, never at import.

A daemon without CuPy, a driver or a GPU keeps serving shared-memory clients and refuses CUDA
registrations with FAILED_PRECONDITION and the reason.
"""

from __future__ import annotations

import functools
import logging

from kvserver.errors import FailedPrecondition

logger = logging.getLogger(__name__)


@functools.cache
def _probe() -> tuple[object | None, str]:
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc}); install kvserver[cuda]"
    try:
        if not cupy.cuda.is_available():
            return None, "no CUDA driver or GPU is visible to the daemon"
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError and friends, without importing their types
        return None, f"CUDA is not usable: {exc}"
    logger.info("CUDA available: %d device(s)", count)
    return cupy, ""


def require_cuda():
    """CuPy, or FailedPrecondition saying why this daemon cannot serve CUDA pools."""
    cupy, why = _probe()
    if cupy is None:
        raise FailedPrecondition(
            f"this daemon cannot register CUDA pools: {why}. Shared-memory pools still work"
        )
    return cupy
