"""Worker threads that the process's exit does not wait for, for the cluster store's questions.

A question to Mooncake Store (which names it holds) touches no memory of the daemon's, and a hung
master keeps it for 30 s; in a ``ThreadPoolExecutor`` it would hold up the daemon's exit that
long. These threads are daemon threads: the daemon waits for the calls that move its pages
(pulls, puts) and leaves the questions behind.

Primitives: ``DaemonThreads`` (``submit``, ``shutdown``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


class DaemonThreads:
    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._n = n
        for i in range(n):
            threading.Thread(target=self._run, daemon=True, name=f"{name}-{i}").start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` in one of the threads; its outcome settles the returned future on the
        calling loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((loop, fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            loop, fut, fn, args = item
            result, error = None, None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the loop, whatever it is
                error = exc

            def settle(fut=fut, result=result, error=error) -> None:
                if fut.done():
                    return
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed: the daemon is gone
                pass

    def shutdown(self) -> None:
        """Each thread ends after the call it is in (not waited for)."""
        for _ in range(self._n):
            self._queue.put(None)
