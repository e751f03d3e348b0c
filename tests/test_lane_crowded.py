"""A lane waiter spins only while it has its CPU to itself (docs/lane.md, "Waiting"): a spin in
which another thread ran on its CPU (the yield handed it over) ends, and three such spins, each
soon after the last, make the process's waits sleep at once for the crowded window; one alone
changes nothing, and a window of 0 turns it off. The compiled waits and the Python ones alike, on a
real ring, with a real process spinning on the waiter's CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvclient._transport import lane as lane_mod

PATHS = ["compiled", "python"]


@pytest.fixture
def shared_cpu():
    """This thread pinned to one CPU, and a process spinning on that CPU; both undone after."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    hog = subprocess.Popen([sys.executable, "-c",
                            f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"])
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.2)  # the hog is up and spinning
        yield
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()


@pytest.fixture
def lane(request):
    """A lane with no daemon (its slot never answered), waiting in compiled code or in Python;
    the process's crowded window given back as it was."""
    if request.param == "compiled" and lane_mod._wire is None:
        pytest.skip("the compiled client calls are not built")
    saved = lane_mod.crowded()[0]
    lane_mod.crowded(1.0)  # the default window, none under way, no strikes
    ln = lane_mod.ClientLane.standalone(slots=1)
    if request.param == "python":
        ln._c = None
    try:
        yield ln
    finally:
        ln.close()
        lane_mod.crowded(saved)


def _state(ln) -> tuple[float, float, int]:
    """(window, seconds left of the time without spins, spins that found the CPU shared) of the
    waits ``ln`` makes."""
    if ln._c is None:
        c = lane_mod._Crowded
        return c.window, max(0.0, c.until - time.monotonic()), c.noticed
    return lane_mod.crowded()


def _spin_out(ln, spin: float = 0.01) -> None:
    """A wait that spins up to ``spin`` s, then sleeps to its deadline: nothing answers it."""
    assert ln._wait(0, time.monotonic() + spin + 0.005, spin=spin) == lane_mod._TIMEOUT


@pytest.mark.parametrize("lane", PATHS, indirect=True)
def test_three_spins_that_find_the_cpu_shared_make_the_waits_sleep_at_once(shared_cpu, lane) -> None:
    _, _, seen = _state(lane)
    for _ in range(lane_mod.CROWDED_STRIKES):
        _spin_out(lane)
    _, left, noticed = _state(lane)
    assert noticed == seen + lane_mod.CROWDED_STRIKES, "a spin did not find its CPU shared"
    assert left > 0.5, "three spins in a row found the CPU shared, and the waits still spin"
    cpu = time.thread_time()
    _spin_out(lane)  # asleep at once: it takes no CPU to speak of, and finds nothing
    assert time.thread_time() - cpu < 0.003
    assert _state(lane)[2] == noticed


@pytest.mark.parametrize("lane", PATHS, indirect=True)
def test_a_spin_that_finds_the_cpu_shared_now_and_then_changes_nothing(shared_cpu, lane) -> None:
    _, _, seen = _state(lane)
    _spin_out(lane)
    assert _state(lane)[1:] == (0.0, seen + 1)  # found, and the next wait spins all the same
    time.sleep(1.5 * lane_mod.CROWDED_STRIKE_GAP_SECONDS)
    _spin_out(lane)
    _spin_out(lane)  # two in a row, the one before too long ago: no third
    assert _state(lane)[1:] == (0.0, seen + 3)


@pytest.mark.parametrize("lane", PATHS, indirect=True)
def test_a_crowded_window_of_0_never_stops_the_spins(shared_cpu, lane) -> None:
    lane_mod.crowded(0)
    _, _, seen = _state(lane)
    for _ in range(2 * lane_mod.CROWDED_STRIKES):
        _spin_out(lane, 0.002)
    assert _state(lane) == (0.0, 0.0, seen)


@pytest.mark.parametrize("text,want", [("0", 0.0), ("250", 0.25), ("60000", 60.0), ("-1", 1.0),
                                       ("60001", 1.0), ("often", 1.0), ("nan", 1.0)])
def test_a_crowded_window_from_the_environment_is_checked(monkeypatch, caplog, text, want) -> None:
    monkeypatch.setenv("KVCLIENT_LANE_CROWDED_MS", text)
    assert lane_mod._crowded_window() == pytest.approx(want)
    assert ("is not a number of milliseconds" in caplog.text) == (text not in ("0", "250", "60000"))


def test_a_crowded_window_is_bounded() -> None:
    for bad in (-1.0, 3601.0, float("nan")):
        with pytest.raises(ValueError):
            lane_mod.crowded(bad)
