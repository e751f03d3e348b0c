"""The event loop's share between the cache's long bookkeeping and the short calls engines wait on.

A Lookup, Put or Get of many keys runs in steps (``kvserver.store.steps``) and lets the loop serve
others between two. Letting it go on at once after one pass of the loop still makes every short
call in flight (a Load, a Write, an Alloc: one step of an engine's forward pass waits on it) wait
behind the next step at each of its own turns on the loop (parse, copy submitted, copy done,
answer). So between two steps, a long operation waits while short calls are in flight, for at most
as long as its last step took: a short call's turns then find the loop free, and the long one
still has at least half of the loop however many short calls come.

Primitives: ``LoopShare`` with ``call`` (a call in flight: counted while its handler runs) and
``between_steps`` (what a long operation awaits between two steps); ``in_steps`` (runs an
operation's steps so).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

MAX_WAIT = 0.02  # the longest a long operation waits for short calls between two of its steps
LONG_STEP_S = 0.003  # a step this long, no call in flight, is followed by a pause of BREATHE_S
BREATHE_S = 0.001  # (a third of the step at most: a lease-ending step of 1 Mi pins takes 3-6 ms)

_counted: contextvars.ContextVar[bool] = contextvars.ContextVar("kvserver_call_counted", default=False)


class LoopShare:
    def __init__(self) -> None:
        self.calls = 0  # calls in flight, not running steps
        self._quiet: asyncio.Event | None = None  # set while no call is in flight

    def _event(self) -> asyncio.Event:
        if self._quiet is None:
            self._quiet = asyncio.Event()
            if not self.calls:
                self._quiet.set()
        return self._quiet

    def _add(self, n: int) -> None:
        was = self.calls
        self.calls = was + n
        if self._quiet is not None and (not was) != (not self.calls):  # only a change is told
            if self.calls:
                self._quiet.clear()
            else:
                self._quiet.set()

    def call(self) -> _Call:
        """A call in flight while the block runs (a handler, from its request to its answer)."""
        return _Call(self)

    def long(self) -> _Long:
        """The block runs steps: the call running it is not a short one meanwhile (it does not
        wait for itself, and others do not wait for it)."""
        return _Long(self)

    async def between_steps(self, spent: float) -> None:
        """Lets the loop serve others after a step that took ``spent`` seconds: one pass, and while
        calls are in flight, until none is or ``spent`` (at most ``MAX_WAIT``) has passed."""
        if not self.calls:
            # A call not yet on the loop (grpc's poller thread hands it over, then the loop reads it
            # and starts its handler, a few passes) would wait behind each next step: after a long
            # step, a moment for it to come.
            await asyncio.sleep(BREATHE_S if spent >= LONG_STEP_S else 0)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event().wait(), min(spent, MAX_WAIT))


class _Call:
    """``LoopShare.call``'s block (a class, not a generator: it runs around every handler)."""

    __slots__ = ("share", "token")

    def __init__(self, share: LoopShare) -> None:
        self.share = share

    def __enter__(self) -> None:
        self.share._add(1)
        self.token = _counted.set(True)

    def __exit__(self, *exc: object) -> None:
        self.share._add(-1)  # first: a streaming handler closed from another context still counts out
        with contextlib.suppress(ValueError):
            _counted.reset(self.token)


class _Long:
    """``LoopShare.long``'s block."""

    __slots__ = ("share", "token")

    def __init__(self, share: LoopShare) -> None:
        self.share = share
        self.token: contextvars.Token | None = None

    def __enter__(self) -> None:
        if _counted.get():
            self.share._add(-1)
            self.token = _counted.set(False)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            self.share._add(1)
            with contextlib.suppress(ValueError):
                _counted.reset(self.token)


async def in_steps(share: LoopShare, steps: Generator[None, None, T]) -> T:
    """Runs a cache operation's steps (``kvserver.store.steps``), letting the event loop serve
    others between two (``LoopShare.between_steps``); a caller cancelled meanwhile closes it,
    which undoes what it did."""
    try:
        started = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:  # one step: the loop was never let go, nothing to count
            return done.value
        with share.long():
            while True:
                await share.between_steps(time.perf_counter() - started)
                started = time.perf_counter()
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
    finally:
        steps.close()
