"""scripts/gpu_check.py's engine runner on CPU, with stand-in engines (the real ones need a GPU):
results are collected, and an engine that hangs or dies is reported with the stage it reached,
within the check's deadline, instead of eating the GPU machine's time."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def passing_engine(address, kind, start, end, num_layers, page_size, num_tokens, transfer_tokens, rounds,
                   out, bench_lock):
    out.put({"range": [start, end], "stage": "write, wipe, load"})
    with bench_lock:
        out.put({"range": [start, end], "kind": kind, "page_size": page_size, "exact": True,
                 "layer0_exact": True, "layer0_ready_before_last_layer": True, "bytes": 1 << 30,
                 "pool_memory_returned": True, "final": True})


def hanging_engine(address, kind, start, end, *rest):
    out = rest[-2]
    out.put({"range": [start, end], "stage": "write, wipe, load"})
    if start == 16:
        time.sleep(120)
    out.put({"range": [start, end], "exact": True, "layer0_exact": True, "bytes": 1,
             "pool_memory_returned": True, "final": True})


def dying_engine(address, kind, start, end, *rest):
    rest[-2].put({"range": [start, end], "stage": "register (IPC open, pinning)"})
    time.sleep(0.2)  # the stage message reaches the pipe before the process ends
    os._exit(3)


def run(target, deadline_s: float) -> tuple[dict, float]:
    gpu_check = load_gpu_check()
    report = {"checks": [], "ok": True}
    t0 = time.monotonic()
    gpu_check.run_plan(mp.get_context("spawn"), "unix:///nowhere", "mha", 16, 1, t0 + deadline_s, report,
                       target=target)
    return report, time.monotonic() - t0


@pytest.fixture(autouse=True)
def importable_targets(monkeypatch):
    """Spawned engines import their target from this module: its folder must be on sys.path."""
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))


def test_results_are_collected():
    report, _ = run(passing_engine, 60)
    assert report["ok"] and sorted(c["range"] for c in report["checks"]) == [[0, 16], [16, 32]]


def test_a_hanging_engine_is_reported_at_the_deadline_with_its_stage():
    with pytest.raises(TimeoutError, match=r"\(16, 32\): 'write, wipe, load'") as err:
        run(hanging_engine, 3)
    assert "(0, 16)" not in str(err.value)  # that one finished


def test_a_dying_engine_is_reported_with_its_stage():
    with pytest.raises(RuntimeError, match=r"died at .*register \(IPC open, pinning\)"):
        run(dying_engine, 60)
