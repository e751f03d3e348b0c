"""What an engine does when the daemon is away: which failures are cache misses, and backoff.

An engine must keep serving whatever happens to the daemon. In resilient mode (the default) a
failure that says "the daemon is gone, restarted, or no longer knows these pages" is a miss: a
write is dropped, a load reports that it did not land, and the client re-registers in the
background. A failure that says "this request is wrong" still raises: that is a bug to fix.
"""

from __future__ import annotations

import random

import grpc

# The daemon is unreachable: reconnect (register again once it answers).
OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE})
# The daemon no longer knows this registration (restarted, or reclaimed it): register again.
LOST = frozenset({grpc.StatusCode.NOT_FOUND})
# The host pages are not (or no longer) this registration's: the data is simply not there.
STALE = frozenset({grpc.StatusCode.FAILED_PRECONDITION})
# The call took too long or was cancelled: a miss, and the registration stays. A deadline is not an
# outage: re-registering would drop every page the registration holds.
SLOW = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


# A cache call the daemon cannot serve now (a tenant's limit, slabs being pinned, a part of another
# layer range): the cache is best effort, so the engine recomputes; the reason is logged once.
CACHE_BEST_EFFORT = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION})


def is_miss(code: grpc.StatusCode) -> bool:
    return code in OUTAGE or code in LOST or code in STALE or code in SLOW


def needs_register(code: grpc.StatusCode) -> bool:
    return code in OUTAGE or code in LOST


def job_unconfirmed(code: grpc.StatusCode, job_ended: bool) -> bool:
    """A Write or Load failed on the client's side (its deadline, a cancellation) without the
    daemon saying its job is dead: the job might still copy, so the client must make sure it
    cannot before it reports the failure."""
    return code in SLOW and not job_ended


def confirm_grace(timeout: float) -> float:
    """How much longer than the daemon's own job deadline (``timeout``) a Write or Load call's
    gRPC deadline is: time for the daemon to stop the job and say so."""
    return max(1.0, timeout / 2)


class Backoff:
    """Exponential backoff with full jitter, from ``first`` up to ``cap`` seconds."""

    # The cap keeps a client back within about a second of a daemon that answers again, whatever
    # the length of the outage (the channel's own reconnect backoff is capped alike: _transport/channel.py).
    def __init__(self, first: float = 0.05, cap: float = 0.5) -> None:
        self.first = first
        self.cap = cap
        self.attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.first * (2**self.attempt))
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0
