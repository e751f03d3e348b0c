"""What an engine does when the daemon is away: which failures are cache misses, and backoff.

An engine must keep serving whatever happens to the daemon. In resilient mode (the default) a
failure that says "the daemon is gone, restarted, or no longer knows these pages" is a miss: a
write is dropped, a load reports that it did not land, and the client re-registers in the
background. A failure that says "this request is wrong" still raises: that is a bug to fix.
"""

from __future__ import annotations

import random

import grpc

# The daemon is unreachable or too slow: reconnect.
OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED})
# The daemon no longer knows this registration (restarted, or reclaimed it): register again.
LOST = frozenset({grpc.StatusCode.NOT_FOUND})
# The host pages are not (or no longer) this registration's: the data is simply not there.
STALE = frozenset({grpc.StatusCode.FAILED_PRECONDITION})


def is_miss(code: grpc.StatusCode) -> bool:
    return code in OUTAGE or code in LOST or code in STALE


def needs_register(code: grpc.StatusCode) -> bool:
    return code in OUTAGE or code in LOST


class Backoff:
    """Exponential backoff with full jitter, from ``first`` up to ``cap`` seconds."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.first * (2**self.attempt))
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0
