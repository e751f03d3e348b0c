"""Waiting on the GPU with a deadline.

CUDA has no timed wait: ``cudaEventSynchronize`` and ``cudaStreamSynchronize`` block until the
work is done, and work behind an engine event that never fires is never done. So every wait here
polls ``eventQuery`` / ``streamQuery`` (0 once complete, cudaErrorNotReady before), sleeping
between polls from 50 us up to 1 ms, until the work is done or the deadline passes. The deadline
is ``--cuda-wait-seconds``, a daemon-wide setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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


def until_done(query: Callable[[], int], deadline: float,
               give_up: Callable[[], bool] = lambda: False) -> bool:
    """Polls ``query`` (a CUDA query call: 0 once the work is complete) until it is complete
    (True), or the monotonic ``deadline`` passes or ``give_up()`` holds (False)."""
    delay = POLL_FIRST
    while True:
        if query() == 0:
            return True
        now = time.monotonic()
        if now >= deadline or give_up():
            return False
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, POLL_MAX)
