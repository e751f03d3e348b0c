"""The daemon's first look for a GPU, when several CUDA registrations arrive at once.

CuPy's ``cuda.is_available()`` marks CUDA unavailable before it asks the driver, so a second
caller during the first one's driver start (a second or more on a real GPU) was told "no CUDA
driver", and that answer could be the one kept for the daemon's life. CuPy with a GPU cannot run
here: this stand-in has the same order of steps, with a slow first driver call."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from kvserver.media.cuda import runtime


class _Runtime:
    def __init__(self) -> None:
        self.calls = 0

    def getDeviceCount(self) -> int:  # noqa: N802 (CuPy's name)
        self.calls += 1
        time.sleep(0.3)  # the driver's start
        return 1


def _standin() -> types.ModuleType:
    rt = _Runtime()
    state = {"available": None}

    def is_available() -> bool:  # as CuPy's: the flag is False while the driver starts
        if state["available"] is None:
            state["available"] = False
            state["available"] = rt.getDeviceCount() > 0
        return state["available"]

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(is_available=is_available, runtime=rt)
    return cupy


@pytest.fixture
def standin(monkeypatch):
    cupy = _standin()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    runtime._probe_once.cache_clear()
    yield cupy
    runtime._probe_once.cache_clear()


def test_registrations_arriving_while_the_driver_starts_all_get_the_gpu(standin) -> None:
    got: list = []

    def register() -> None:
        try:
            got.append(runtime.require_cuda())
        except Exception as exc:  # noqa: BLE001  (what the test reports)
            got.append(exc)

    threads = [threading.Thread(target=register) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # each arrives while the first is still starting the driver
    for t in threads:
        t.join(10)
    assert got == [standin] * 4
    assert standin.cuda.runtime.calls == 1  # one probe; the others waited for its answer
    assert runtime.require_cuda() is standin
