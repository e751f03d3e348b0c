"""A circuit breaker for the cluster store: once a call fails for want of the store (its master
unreachable, or no answer within the deadline), no call is made for a while, every cluster
lookup and Get a miss at once; then one probe at a time asks whether the store answers again,
waiting twice as long after each failed probe, up to a bound. A failure of a call that started
before the breaker last closed is old news and changes nothing.

Primitives: ``Breaker`` (``allow``, ``probe_due``, ``failed``, ``succeeded``, ``epoch``,
``open``, ``trips``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    def __init__(self, first_wait: float = 0.5, max_wait: float = 8.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_wait, self.max_wait, self.clock = first_wait, max_wait, clock
        self.open = False
        self.trips = 0  # times it opened
        self.epoch = 0  # times it closed: a call started in an older epoch cannot open it
        self._wait = first_wait
        self._until = 0.0  # while open: no probe before then

    def allow(self) -> bool:
        """Whether a call (not a probe) may be made now."""
        return not self.open

    def probe_due(self) -> bool:
        """While open, whether a probe may be made now (it is then the only one until it ends)."""
        if not self.open or self.clock() < self._until:
            return False
        self._until = float("inf")  # one probe at a time: ``failed`` or ``succeeded`` sets the next
        return True

    def failed(self, epoch: int | None = None, probe: bool = False) -> bool:
        """A call (started in ``epoch``; None: now) or a probe failed for want of the store.
        Returns whether this opened the breaker."""
        if epoch is not None and epoch != self.epoch:
            return False
        now = self.clock()
        if not self.open:
            self.open = True
            self.trips += 1
            self._wait = self.first_wait
            self._until = now + self._wait
            return True
        if probe:  # only a failed probe backs off; calls failing meanwhile change nothing
            self._wait = min(self.max_wait, self._wait * 2)
            self._until = now + self._wait
        return False

    def succeeded(self) -> None:
        self.open = False
        self.epoch += 1
        self._wait = self.first_wait
        self._until = 0.0
