"""scripts/gpu_check.py's engine runners on CPU, with stand-in engines (the real ones need a GPU):
results are collected, and an engine that hangs or dies is reported with the stage it reached,
within the check's deadline, instead of eating the GPU machine's time. The vLLM worker-side
runner also runs its real engines here, on CPU views (scripts/gpu_check_vllm.py works on both)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time

import pytest
import torch

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
    # (8 s: two spawned engines import torch first, which on a loaded 2-core machine took over 3)
    with pytest.raises(TimeoutError, match=r"\(16, 32\): 'write, wipe, load'") as err:
        run(hanging_engine, 8)
    assert "(0, 16)" not in str(err.value)  # that one finished


def test_a_dying_engine_is_reported_with_its_stage():
    with pytest.raises(RuntimeError, match=r"died at .*register \(IPC open, pinning\)"):
        run(dying_engine, 60)


def reporting_probe(out):
    out.put({"kind": "queue_depth", "ok": True, "calls_before_a_wait": 1000})


def hanging_probe(out):
    time.sleep(120)


def dying_probe(out):
    os._exit(3)


def test_the_driver_queue_probe_reports_and_is_never_waited_for_past_its_time(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))  # the real probe's module, spawned
    import gpu_check

    ctx = mp.get_context("spawn")
    got = gpu_check.run_queue_depth(ctx, time.monotonic() + 60, target=reporting_probe)
    assert got["calls_before_a_wait"] == 1000
    t0 = time.monotonic()
    got = gpu_check.run_queue_depth(ctx, time.monotonic() + 2, target=hanging_probe)
    assert not got["ok"] and "no report" in got["error"] and time.monotonic() - t0 < 10
    t0 = time.monotonic()
    got = gpu_check.run_queue_depth(ctx, time.monotonic() + 60, target=dying_probe)
    assert not got["ok"] and "exit 3" in got["error"] and time.monotonic() - t0 < 15
    # The real probe: a report on a GPU, and without one the reason instead of a hang.
    got = gpu_check.run_queue_depth(ctx, time.monotonic() + 60)
    if torch.cuda.is_available():
        assert got["ok"] and all("calls_made" in got[k] for k in ("memcpy", "launch", "event_record")), got
    else:
        assert not got["ok"] and "Traceback" in got["error"]


def test_the_driver_queue_bounds_are_judged_against_the_least_depth_measured(monkeypatch):
    """The daemon's bounds on one stream's calls (512 for the loop's workers and for the plane)
    must stay under the least depth the probe measured for any kind of call; where a kind waited
    at or before them the check fails, and a probe that measured nothing says nothing."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import gpu_check

    def probe(**depths) -> dict:
        got = {"kind": "queue_depth", "ok": True}
        for kind in ("memcpy", "launch", "event_record"):
            d = depths.get(kind, 1024)
            got[kind] = {"calls_before_a_wait": d, "calls_made": 8192 if d is None else d + 1}
        return got

    assert gpu_check.queue_bounds(probe(), 512, 512) == {"least_depth": 1024, "max_queued": 512,
                                                         "plane_max_queued": 512, "fit": True}
    assert gpu_check.queue_bounds(probe(event_record=500), 512, 512)["fit"] is False
    assert gpu_check.queue_bounds(probe(launch=512), 512, 256)["fit"] is False  # at the bound: waits
    assert gpu_check.queue_bounds(probe(memcpy=None, launch=None, event_record=None), 512, 512)["fit"] is True
    assert gpu_check.queue_bounds({"kind": "queue_depth", "ok": False, "error": "x"}, 512, 512)["fit"] is None


# ---- the vLLM worker-side round's runner ------------------------------------------------------


def vllm_standin(address, kind, layout, out, device, ok=True, hang=False):
    label = [["mha", "LBNHC"], ["mha", "LBHNC"], ["mla", "LBNHC"]].index([kind, layout])
    out.put({"range": [label, label + 1], "stage": "worker round"})
    if hang:
        time.sleep(120)
    out.put({"range": [label, label + 1], "kind": f"vllm-worker-{kind}-{layout}", "ok": ok, "final": True})


def vllm_passing(*args):
    vllm_standin(*args)


def vllm_one_failing(address, kind, layout, out, device):
    vllm_standin(address, kind, layout, out, device, ok=layout != "LBHNC")


def vllm_one_hanging(address, kind, layout, out, device):
    vllm_standin(address, kind, layout, out, device, hang=kind == "mla")


def vllm_real(*args):
    """gpu_check.vllm_engine itself (spawned engines import their target by module name)."""
    load_gpu_check().vllm_engine(*args)


def run_vllm(target, deadline_s: float, address: str = "unix:///nowhere") -> dict:
    gpu_check = load_gpu_check()
    report = {"checks": [], "ok": True}
    gpu_check.run_vllm(mp.get_context("spawn"), address, time.monotonic() + deadline_s, report, target=target,
                       device="cpu")
    return report


def test_the_vllm_cases_are_the_rounds():
    import importlib.util as iu

    spec = iu.spec_from_file_location("gpu_check_vllm", os.path.join(ROOT, "scripts", "gpu_check_vllm.py"))
    check = iu.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert load_gpu_check().VLLM_CASES == check.CASES


def test_vllm_results_are_collected():
    report = run_vllm(vllm_passing, 60)
    assert report["ok"] and sorted(c["kind"] for c in report["checks"]) == [
        "vllm-worker-mha-LBHNC", "vllm-worker-mha-LBNHC", "vllm-worker-mla-LBNHC"]


def test_a_failed_vllm_case_fails_the_report():
    report = run_vllm(vllm_one_failing, 60)
    assert not report["ok"]
    assert {c["kind"]: c["ok"] for c in report["checks"]} == {
        "vllm-worker-mha-LBNHC": True, "vllm-worker-mha-LBHNC": False, "vllm-worker-mla-LBNHC": True}


def test_a_hanging_vllm_case_is_reported_at_the_deadline_with_its_stage():
    # The deadline leaves three spawned engines (each importing torch) time to start on a loaded
    # 2-core machine: at 4 s, a CI run under load found all three still 'starting'.
    with pytest.raises(TimeoutError, match=r"vllm: .*\(2, 3\): 'worker round'") as err:
        run_vllm(vllm_one_hanging, 15)
    assert "(0, 1)" not in str(err.value) and "(1, 2)" not in str(err.value)


def test_the_real_vllm_engines_pass_on_cpu(daemon):
    report = run_vllm(vllm_real, 120, daemon.address)
    assert report["ok"], report
    assert sorted(c["kind"] for c in report["checks"]) == [
        "vllm-worker-mha-LBHNC", "vllm-worker-mha-LBNHC", "vllm-worker-mla-LBNHC"]
    assert all(c["exact"] and c["miss_reported"] and c["device"] == "cpu" for c in report["checks"])
