"""How late an event loop's timer runs while some work is awaited on it: what every other caller
of the loop waited (used by tests and by benchmarks/bench_release.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def lag_during(work: Callable[[], Awaitable], settle: float = 0.05) -> tuple[float, float]:
    """(the loop's longest lateness, the work's own time) while ``work()`` is awaited, a timer due
    every 2 ms running beside it from ``settle`` seconds before to ``settle`` seconds after."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.002)
            lags.append(loop.time() - t - 0.002)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(settle)
    started = time.perf_counter()
    await work()
    took = time.perf_counter() - started
    await asyncio.sleep(settle)
    stop.set()
    await task
    return max(lags), took
