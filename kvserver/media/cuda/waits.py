"""Waiting on the GPU with a deadline.

CUDA has no timed wait: ``cudaEventSynchronize`` and ``cudaStreamSynchronize`` block until the
work is done, and work behind an engine event that never fires is never done. So every wait here
polls ``eventQuery`` / ``streamQuery`` (0 once complete, cudaErrorNotReady before), sleeping
between polls from 50 us up to 1 ms, until the work is done or the deadline passes. The deadline
is ``--cuda-wait-seconds``, a daemon-wide setting. Any other answer is an error (a sticky one,
such as an illegal address, fails the context: CuPy's queries return its code on every call rather
than raise) and its work never completes: ``CudaFailed`` at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

NOT_READY = 600  # cudaErrorNotReady (CUDA_ERROR_NOT_READY): the work is not complete yet
POLL_FIRST = 50e-6
POLL_MAX = 1e-3
DEFAULT_WAIT_SECONDS = 20.0

_wait_seconds = DEFAULT_WAIT_SECONDS


def set_wait_seconds(seconds: float) -> None:
    """How long GPU work may make no progress before its client is failed (daemon start)."""
    global _wait_seconds
    _wait_seconds = seconds


def wait_seconds() -> float:
    return _wait_seconds


class CudaFailed(RuntimeError):
    """A query answered an error: the context has failed, and the work will never complete."""


def done(code: int) -> bool:
    """Whether a query's answer says complete (True) or not yet (False); CudaFailed otherwise."""
    if code == 0:
        return True
    if code != NOT_READY:
        raise CudaFailed(f"CUDA error {code}: the context has failed")
    return False


def until_done(query: Callable[[], int], deadline: float,
               give_up: Callable[[], bool] = lambda: False) -> bool:
    """Polls ``query`` (a CUDA query call: 0 once the work is complete) until it is complete
    (True), or the monotonic ``deadline`` passes or ``give_up()`` holds (False); CudaFailed at
    once where it answers an error."""
    delay = POLL_FIRST
    while True:
        if done(query()):
            return True
        now = time.monotonic()
        if now >= deadline or give_up():
            return False
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, POLL_MAX)
