"""Register-or-miss, for the engine seams (SGLang's linker and HiCache backend, vLLM's connector)."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from kvclient.errors import KVClientError
from kvclient.sync_client import KVClient

logger = logging.getLogger("kvclient")

# Register failures that mean "the daemon is not there (yet)": the seam starts and misses.
_AWAY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN}



def daemon_away(exc: BaseException) -> bool:
    """A Register failure that means the daemon is not there (yet), not that it refused."""
    return isinstance(exc, KVClientError) and exc.code in _AWAY


class Registrar:
    """Register-or-miss. A seam registers at startup; if the daemon is away it still starts,
    every call misses, and ``ensure`` tries again at most every ``retry_s``. Once registered,
    kvclient's resilient mode re-registers by itself after an outage. A refusal that is not the
    daemon being away (a bad layout, a wrong layer count) raises when ``strict``: it is a
    configuration error that would otherwise miss forever."""

    def __init__(self, client: KVClient, retry_s: float, kwargs: dict | None = None) -> None:
        self.client = client
        self.retry_s = retry_s
        self.kwargs = kwargs  # KVClient.register's; read and changed only under the lock
        self.registered = False
        self._last_try = float("-inf")
        self._lock = threading.Lock()  # controller threads may ask at once: one Register

    def ensure(self, *, strict: bool = False, closed: bool = False) -> bool:
        """Registered (True), or tried again if it is time; False means miss."""
        if self.registered:
            return True
        with self._lock:
            if self.registered:
                return True
            now = time.monotonic()
            if closed or self.kwargs is None or now - self._last_try < self.retry_s:
                return False
            self._last_try = now
            try:
                self.client.register(**self.kwargs)
            except Exception as exc:  # the daemon is away: every call misses until it is back
                if strict and not daemon_away(exc):
                    raise
                logger.warning("kvserver: register failed (%s); the cache misses until it succeeds", exc)
                return False
            self.registered = True
            return True

    def renew(self, **changes) -> None:
        """The next ``ensure`` registers again at once, with ``changes`` to the arguments (a new
        pool, say): under the lock, so no Register in flight can send the old ones after this."""
        with self._lock:
            self.kwargs = dict(self.kwargs or {}, **changes)
            self.registered = False
            self._last_try = float("-inf")
