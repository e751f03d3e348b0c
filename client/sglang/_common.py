"""What both SGLang seams share: the storage hash keys, the fp8 dtype on the wire, and
register-or-miss.

Importing this module does not import SGLang.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import torch

from kvclient.errors import KVClientError
from kvclient.sync_client import KVClient

logger = logging.getLogger("kvclient.sglang")

KEY_BYTES = 32  # a SHA-256 storage hash
# Register failures that mean "the daemon is not there (yet)": the seam starts and misses.
_AWAY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN}


def storage_keys(hashes) -> bytes:
    """SGLang's storage hash strings, packed as fixed-width 32-byte keys."""
    out = bytearray()
    for h in hashes:
        if not isinstance(h, str) or len(h) != 2 * KEY_BYTES:
            raise ValueError(f"not an SGLang storage hash (64 hex digits): {h!r}")
        out += bytes.fromhex(h)
    return bytes(out)


def fp8_wire_dtype(store: torch.dtype, logical: torch.dtype) -> torch.dtype:
    """SGLang keeps fp8 KV in uint8 tensors (``store_dtype``); the daemon is told the logical fp8
    dtype, whose bytes are the same. Any other pair is sent as stored."""
    if store == torch.uint8 and logical.itemsize == 1 and logical != torch.uint8:
        return logical
    return store


def _wire_dtype(kvcache, buf: torch.Tensor) -> torch.dtype:
    """The dtype a device pool's buffer ``buf`` is registered as: its logical fp8 dtype
    (``kvcache.dtype``) for an fp8 pool, else its own."""
    return fp8_wire_dtype(buf.dtype, getattr(kvcache, "dtype", buf.dtype))


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
