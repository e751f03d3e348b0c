"""What an engine's scheduler thread does while the daemon does not answer: it does not wait.

A call made on the thread that schedules an engine's steps (a lookup at admission) waits at most
its own bound. Once one such call fails as a miss (a deadline, an outage, a refused ticket), the
gate closes: later calls answer a miss at once, without touching the daemon, while a background
thread probes it (backing off from ``first`` to ``cap`` seconds between probes); the first probe
that gets an answer opens the gate again. So a stopped or stuck daemon costs the scheduler one
bounded wait, not one per step or one per backoff window.

Primitives: ``AwayGate`` (``open``, ``failed``, ``close``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("kvclient")


class AwayGate:
    def __init__(self, probe: Callable[[], bool], *, first: float = 0.25, cap: float = 2.0,
                 name: str = "kvserver-probe") -> None:
        self._probe = probe  # True when the daemon answered (it may raise: not answered)
        self.first = first
        self.cap = cap
        self.name = name
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.closings = 0  # how many times a failure closed it

    @property
    def open(self) -> bool:
        return self._open.is_set()

    def failed(self) -> None:
        """A call failed as a miss: calls miss without waiting until a probe gets an answer."""
        with self._lock:
            if self._stop.is_set():
                return
            if self._open.is_set():
                self._open.clear()
                self.closings += 1
                logger.warning("kvserver: the daemon did not answer; calls miss at once until it does")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._probing, name=self.name, daemon=True)
                self._thread.start()

    def _probing(self) -> None:
        delay = self.first
        while not self._stop.wait(delay):
            try:
                answered = bool(self._probe())
            except Exception as exc:  # not answered; the next probe may be
                logger.debug("kvserver: probe failed: %s", exc)
                answered = False
            if answered:
                with self._lock:
                    self._open.set()
                    self._thread = None
                logger.info("kvserver: the daemon answers again")
                return
            delay = min(self.cap, delay * 2)

    def close(self) -> None:
        """Stops probing (the engine shuts down)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.cap + 1)
