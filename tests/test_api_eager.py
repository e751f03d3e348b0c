"""kvserver.api.eager.bounded: a call that never waits is answered with no timer armed; one that
waits is bounded from the call's start, gets what it waits for, is cancelled and cleans up as under
asyncio.timeout; errors pass through unchanged."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserver.api import eager


@pytest.fixture
def timers(monkeypatch) -> list[float]:
    """The deadlines ``bounded`` armed a timer for."""
    armed: list[float] = []
    real = asyncio.timeout_at

    def spy(when):
        armed.append(when)
        return real(when)

    monkeypatch.setattr(eager.asyncio, "timeout_at", spy)
    return armed


def run(coro):
    return asyncio.run(coro)


def test_a_call_that_never_waits_arms_no_timer(timers) -> None:
    async def quick() -> int:
        return 7

    async def fails() -> int:
        raise KeyError("no such key")

    async def main() -> None:
        assert await eager.bounded(quick(), 1.0) == 7
        with pytest.raises(KeyError, match="no such key"):
            await eager.bounded(fails(), 1.0)
        assert await eager.bounded(quick(), None) == 7

    run(main())
    assert timers == []


def test_a_call_that_waits_gets_what_it_waits_for_within_the_bound(timers) -> None:
    async def waits(fut: asyncio.Future) -> str:
        got = await fut
        await asyncio.sleep(0)
        return got + "!"

    async def late_error() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("after a wait")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_later(0.02, fut.set_result, "answer")
        assert await eager.bounded(waits(fut), 5.0) == "answer!"
        with pytest.raises(ValueError, match="after a wait"):
            await eager.bounded(late_error(), 5.0)

    run(main())
    assert len(timers) == 2


def test_the_bound_counts_from_the_calls_start_and_ends_the_call_where_it_waits(timers) -> None:
    cleaned: list[str] = []

    async def slow() -> None:
        time.sleep(0.15)  # work that holds the loop before the first wait
        try:
            await asyncio.sleep(5)
        finally:
            cleaned.append("finally")  # e.g. a lease taken so far ends here

    async def main() -> float:
        start = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await eager.bounded(slow(), 0.2)
        return start

    start = run(main())
    # The timer is set for 0.2 s after the call began, not 0.2 s after the 0.15 s of work.
    assert len(timers) == 1 and start + 0.2 <= timers[0] < start + 0.3  # wrong: start + 0.35 or later
    assert cleaned == ["finally"]


def test_a_call_cancelled_in_its_first_step_is_cancelled_not_timed_out(timers) -> None:
    async def cancels_itself() -> None:
        asyncio.current_task().cancel()  # as a peer's cancel arriving during the step
        time.sleep(0.15)  # and past the bound before its first wait
        await asyncio.sleep(5)

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await eager.bounded(cancels_itself(), 0.05)

    async def outer() -> None:
        task = asyncio.ensure_future(main())
        await task

    run(outer())
    assert timers == []


def test_the_call_runs_in_its_callers_task() -> None:
    async def whose() -> asyncio.Task | None:
        await asyncio.sleep(0)
        return asyncio.current_task()

    async def main() -> bool:
        return await eager.bounded(whose(), 5.0) is asyncio.current_task()

    assert run(main())


def test_a_cancelled_call_is_cancelled_where_it_waits_and_cleans_up() -> None:
    cleaned: list[str] = []

    async def waits() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cleaned.append("cancelled")
            raise

    async def main() -> None:
        task = asyncio.ensure_future(eager.bounded(waits(), 10.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert cleaned == ["cancelled"]


def test_a_call_that_swallows_its_cancellation_returns_what_it_returns() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "kept"
        return "slept"

    async def main() -> str:
        task = asyncio.ensure_future(eager.bounded(stubborn(), 10.0))
        await asyncio.sleep(0.05)
        task.cancel()
        return await task

    assert run(main()) == "kept"
