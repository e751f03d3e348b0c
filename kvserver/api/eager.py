"""Runs a call's coroutine at once, and bounds it in time only if it has to wait.

A Lookup is answered without waiting nearly always (one step of the index, no cluster tier), yet
bounding it with ``asyncio.timeout`` arms and cancels a loop timer each time: 5–20 µs of the event
loop per call, a tenth of a lane Lookup's whole cost. ``bounded`` runs the coroutine's first step
itself; if that step returns, no timer was needed. If the coroutine waits, the rest of it runs
under ``asyncio.timeout`` for what is left of the bound, counted from the call's start, exactly as
if the whole call had been under it (a timeout can only end a coroutine where it waits).
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], waiting: Any) -> Generator[Any, Any, T]:
    """Goes on with a started coroutine that yielded ``waiting`` to its task, as ``yield from``
    would have: what the task sends or throws (a cancellation) goes to the coroutine."""
    while True:
        thrown: BaseException | None = None
        try:
            sent = yield waiting
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            thrown = exc  # thrown below, outside this handler: no false __context__ on what it raises
        try:
            waiting = coro.send(sent) if thrown is None else coro.throw(thrown)
        except StopIteration as done:
            return done.value


async def bounded(coro: Coroutine[Any, Any, T], seconds: float | None) -> T:
    """``await coro`` within ``seconds`` of now (None: no bound); TimeoutError past it, as
    ``asyncio.timeout`` raises. No timer is armed unless the coroutine waits."""
    if seconds is None:
        return await coro
    started = asyncio.get_running_loop().time()
    task = asyncio.current_task()
    cancelling = task.cancelling() if task is not None else 0
    try:
        waiting = coro.send(None)
    except StopIteration as done:  # answered without waiting
        return done.value
    rest = _resume(coro, waiting)
    try:
        if task is not None and task.cancelling() > cancelling:
            # Cancelled during its first step: the cancellation ends it where it waits, as it
            # would under asyncio.timeout (entered now, the timeout would take it for its own).
            return await rest
        async with asyncio.timeout_at(started + seconds):
            return await rest
    finally:
        coro.close()  # a no-op once it has returned or raised
