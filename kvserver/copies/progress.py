"""Per-layer progress from a copy thread to the event loop without the GIL: a counter the copy
kernel stores into, and an eventfd it bumps, which the loop watches with add_reader."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np


class LayerSignal:
    """``interval``: least seconds between two signals (the last layer always signals), so the
    loop wakes at most once an interval however many layers land."""

    def __init__(self, interval: float = 0.0, total: int = 0) -> None:
        self.interval = interval
        self.total = total
        self._last = time.monotonic()
        # [layers done, 1 once a CUDA load's layer events are all recorded]; written by the copier
        self.counter = np.zeros(2, dtype=np.int64)
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._holders = 2  # the copy thread's job and the loop's watcher

    def publish(self, layers_done: int) -> None:
        """For copies done in Python: what the kernel does after each layer."""
        self.counter[0] = layers_done
        now = time.monotonic()
        if layers_done >= self.total or now - self._last >= self.interval:
            self._last = now
            os.eventfd_write(self.fd, 1)

    def mark_recorded(self) -> None:
        self.counter[1] = 1
        os.eventfd_write(self.fd, 1)

    @property
    def layers_done(self) -> int:
        return int(self.counter[0])

    @property
    def recorded(self) -> bool:
        return bool(self.counter[1])

    def watch(self, loop: asyncio.AbstractEventLoop, changed: asyncio.Event) -> None:
        """Sets ``changed`` whenever the copy thread signals."""

        def ready() -> None:
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                return
            changed.set()

        loop.add_reader(self.fd, ready)

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.fd)
        self.release()

    def release(self) -> None:
        """Closes the fd once both the copy job and the watcher are done with it, never before:
        the number could be reused while one of them still writes to or watches it."""
        self._holders -= 1
        if self._holders == 0:
            os.close(self.fd)
