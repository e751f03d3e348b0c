"""scripts/gpu_check.py's cache round trip on CPU: its plan (decided without a GPU) and its runner,
with stand-in engines (the real ones need CUDA tensors): results are collected, a failed side
fails the report, and a side that hangs is reported with its stage within the deadline."""

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


@pytest.fixture(autouse=True)
def importable_targets(monkeypatch):
    """Spawned engines import their target from this module: its folder must be on sys.path."""
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))


def test_the_plan_is_whole_scattered_pages_that_fit_both_pools():
    gpu_check = load_gpu_check()
    plan = gpu_check.cache_plan(num_tokens=1024, page_size=16, pages=20, extra=3, seed=5)
    assert plan == gpu_check.cache_plan(num_tokens=1024, page_size=16, pages=20, extra=3, seed=5)
    assert plan != gpu_check.cache_plan(num_tokens=1024, page_size=16, pages=20, extra=3, seed=6)
    assert len(plan["tokens"]) == 23 * 16 and plan["pages"] == 20 and plan["page_size"] == 16
    for name, count in (("put_pages", 20), ("get_pages", 23)):
        pages = plan[name]
        assert len(pages) == count == len(set(pages)) and all(0 <= p < 64 for p in pages)
        assert pages != sorted(pages)  # scattered, not one contiguous run
    assert plan["put_pages"] != plan["get_pages"][:20]  # the loader's pages are not the storer's
    default = gpu_check.cache_plan()
    assert len(default["get_pages"]) == gpu_check.CACHE_PAGES + gpu_check.CACHE_EXTRA
    with pytest.raises(ValueError, match="do not fit a pool of 4"):
        gpu_check.cache_plan(num_tokens=64, page_size=16, pages=4, extra=1)


def standin(address, role, plan, out, stored, put_ok=True, hang=False):
    label = [0, 1] if role == "put" else [1, 2]
    out.put({"range": label, "stage": role})
    if role == "put":
        stored.set()
        out.put({"range": label, "kind": "cache-put", "stored": plan["pages"], "ok": put_ok, "final": True})
        return
    assert stored.wait(30)
    if hang:
        time.sleep(120)
    out.put({"range": label, "kind": "cache-get", "pages": plan["pages"], "ok": True, "final": True})


def passing(*args):
    standin(*args)


def failing_put(*args):
    standin(*args, put_ok=False)


def hanging_get(*args):
    standin(*args, hang=True)


def run(target, deadline_s: float) -> tuple[dict, float]:
    gpu_check = load_gpu_check()
    report = {"checks": [], "ok": True}
    t0 = time.monotonic()
    gpu_check.run_cache(mp.get_context("spawn"), "unix:///nowhere", t0 + deadline_s, report, target=target,
                        plan=gpu_check.cache_plan(num_tokens=256, page_size=16, pages=4, extra=1))
    return report, time.monotonic() - t0


def test_both_sides_are_collected():
    report, _ = run(passing, 60)
    assert report["ok"]
    assert sorted(c["kind"] for c in report["checks"]) == ["cache-get", "cache-put"]
    assert all(c["ok"] for c in report["checks"])


def test_a_failed_side_fails_the_report():
    report, _ = run(failing_put, 60)
    assert not report["ok"] and [c["ok"] for c in sorted(report["checks"], key=lambda c: c["kind"])] == [
        True, False]


def test_a_hanging_side_is_reported_at_the_deadline_with_its_stage():
    with pytest.raises(TimeoutError, match=r"cache: .*\(1, 2\): 'get'") as err:
        run(hanging_get, 4)
    assert "(0, 1)" not in str(err.value)  # the put side finished


def kept_standin(address, role, plan, out, stored):
    """The cache round's engines on shared memory: real Puts and Gets through the daemon."""
    import numpy as np
    from cache_engine import CacheEngine

    label = [0, 1] if role == "put" else [1, 2]
    n = plan["pages"]
    keys = [f"kept{i:04d}".encode() for i in range(n)]
    pages = np.arange(n)
    try:
        with CacheEngine(address, pages=16, resilient=False) as eng:
            if role == "put":
                eng.fill(keys, pages)
                r = eng.put(keys, pages)
                stored.set()
                msg = {"kind": "cache-put", "stored": r.stored, "ok": r.stored == n}
            else:
                eng.wipe()
                got = eng.get(keys, pages)
                msg = {"kind": "cache-get", "pages": got, "ok": got == n and eng.wrong(keys, pages) == []}
    except Exception as exc:
        stored.set()
        msg = {"kind": f"cache-{role}", "error": repr(exc), "ok": False}
    out.put({"range": label, "final": True, **msg})


def test_the_kept_round_kills_the_daemon_between_its_engines_and_loads_what_the_first_stored(tmp_path):
    gpu_check = load_gpu_check()
    report = {"checks": [], "ok": True}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    plan = gpu_check.cache_plan(num_tokens=256, page_size=16, pages=4, extra=1)
    gpu_check.run_kept(mp.get_context("spawn"), str(tmp_path), env, time.monotonic() + 120, report,
                       target=kept_standin, plan=plan)
    kinds = {c["kind"]: c for c in report["checks"]}
    assert report["ok"], report
    assert list(kinds) == ["kept-cache-put", "kept-restart", "kept-cache-get"]
    assert kinds["kept-restart"]["adopted_pages"] == 4 and kinds["kept-cache-get"]["pages"] == 4


def test_the_disk_round_reads_back_from_disk_what_the_first_daemon_wrote_behind(tmp_path):
    gpu_check = load_gpu_check()
    report = {"checks": [], "ok": True}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    plan = gpu_check.cache_plan(num_tokens=256, page_size=16, pages=4, extra=1)
    gpu_check.run_kept(mp.get_context("spawn"), str(tmp_path), env, time.monotonic() + 120, report,
                       target=kept_standin, plan=plan, disk=True)
    kinds = {c["kind"]: c for c in report["checks"]}
    assert report["ok"], report
    assert list(kinds) == ["disk-cache-put", "disk-restart", "disk-cache-get", "disk-read-back"]
    assert kinds["disk-restart"]["adopted_pages"] == 4 and kinds["disk-cache-get"]["pages"] == 4
    assert kinds["disk-read-back"]["disk_promoted_pages"] == 4 and kinds["disk-read-back"]["direct_io"]
