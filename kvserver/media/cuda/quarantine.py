"""GPU resources of released clients whose streams may still run.

GPU work cannot be cancelled. A client failed because its copies stalled (or one whose stream
has not drained when it goes) may still have copies on the GPU that read or write its pinned
host region and its engine's IPC mappings. Those are not released under the GPU: the pool hands
them here, off the clients table and with its host region still reserved, and one background
thread polls each quarantined stream and releases its resources once the stream has drained.
Nobody waits for that meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05


@dataclass(slots=True)
class _Held:
    what: str
    drained: Callable[[], bool]
    release: Callable[[], None]
    since: float = field(default_factory=time.monotonic)
    done: Future = field(default_factory=Future)


class Quarantine:
    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hold(self, what: str, drained: Callable[[], bool], release: Callable[[], None]) -> Future:
        """Keeps ``what`` until ``drained()``, then calls ``release()``; the future completes
        after that (the caller then releases what the GPU might have touched: the host region)."""
        held = _Held(what, drained, release)
        held.done.set_running_or_notify_cancel()
        with self._lock:
            self._held.append(held)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcuda-quarantine", daemon=True)
                self._thread.start()
        logger.warning("quarantined %s: its GPU stream may still run, so its pinned host region and "
                       "IPC mappings stay held until it drains", what)
        return held.done

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            with self._lock:
                held = list(self._held)
            for h in held:
                try:
                    if not h.drained():
                        continue
                except Exception:  # a failed context (sticky error) runs nothing more: release
                    logger.exception("querying the stream of quarantined %s failed", h.what)
                try:
                    h.release()
                except Exception:
                    logger.exception("releasing quarantined %s failed", h.what)
                with self._lock:
                    self._held.remove(h)
                logger.info("released quarantined %s after %.1f s", h.what, time.monotonic() - h.since)
                h.done.set_result(None)


QUARANTINE = Quarantine()
