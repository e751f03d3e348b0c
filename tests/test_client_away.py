"""AwayGate: after one failed call, calls miss at once until a background probe gets an answer;
the probe backs off, and never runs on the caller's thread."""

from __future__ import annotations

import threading
import time

from kvclient.away import AwayGate


def test_the_gate_closes_on_a_failure_and_opens_at_the_first_answer():
    answers = iter([False, False, True])
    callers = []
    held = threading.Event()

    def probe() -> bool:
        callers.append(threading.current_thread().name)
        held.wait(10)  # the first probe is held until the caller has shown it does not wait for it
        return next(answers)

    gate = AwayGate(probe, first=0.01, cap=0.04)
    assert gate.open
    gate.failed()
    assert not gate.open
    deadline = time.monotonic() + 5
    while not callers and time.monotonic() < deadline:
        time.sleep(0.005)
    assert callers, "no probe ran"
    t = time.monotonic()
    gate.failed()  # again while the held probe runs: still one probe thread, and no wait for it
    assert not gate.open and time.monotonic() - t < 5, "the caller waited for the probe"
    held.set()
    deadline = time.monotonic() + 5
    while not gate.open and time.monotonic() < deadline:
        time.sleep(0.005)
    assert gate.open and len(callers) == 3 and gate.closings == 1
    assert all(name == "kvserver-probe" for name in callers)
    gate.close()


def test_a_probe_that_raises_is_not_an_answer_and_close_stops_probing():
    calls = []

    def probe() -> bool:
        calls.append(1)
        raise OSError("daemon away")

    gate = AwayGate(probe, first=0.01, cap=0.02)
    gate.failed()
    time.sleep(0.1)
    assert not gate.open and len(calls) >= 2
    gate.close()
    n = len(calls)
    time.sleep(0.1)
    assert len(calls) == n  # no probe after close
    gate.failed()  # closed for good: no thread starts again
    time.sleep(0.05)
    assert len(calls) == n
