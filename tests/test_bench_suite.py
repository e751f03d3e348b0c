"""benchmarks/run.py --quick: every suite runs against a real daemon and leaves its JSON, plots and
summary. One run for all suites (seconds), checked for the measured numbers, not their values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITES = ["transfer", "control", "pipeline", "concurrency"]
OPTIONAL = ["multiturn"]  # run and checked when its module is there
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    # multiturn's smoke run has its own test (test_bench_multiturn.py): not run twice.
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), *SUITES, "--quick",
                          "--progress", "on", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"run.py exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return out, res.stdout


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def _times(stats: dict) -> None:
    assert stats["n"] == len(stats["times_s"]) > 0
    assert all(_positive(t) for t in stats["times_s"])
    assert 0 < stats["min_s"] <= stats["p50_s"] <= stats["p99_s"] <= stats["max_s"]


def _doc(out: Path, name: str) -> dict:
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["suite"] == name and doc["quick"] is True
    assert "benchmarks/run.py" in doc["command"] and "--quick" in doc["command"]
    m = doc["machine"]
    assert _positive(m["cpu_count"]) and m["cpu_model"] and m["python"] and m["torch"] and m["grpcio"]
    assert m["date"].startswith("20")
    return doc


def test_every_suite_prints_its_summary_and_writes_png_plots(quick):
    out, stdout = quick
    for name in SUITES:
        section = stdout.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "|---" in section, f"{name}: no summary table in\n{stdout}"
        _doc(out, name)
        plots = sorted(out.glob(f"{name}*.png"))
        assert plots, f"{name}: no plot"
        for p in plots:
            assert p.read_bytes()[:8] == PNG and p.stat().st_size < 150_000, p


def test_the_entry_point_has_every_suite_with_its_interface():
    """run.py runs multiturn too (its smoke run is test_bench_multiturn.py's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    assert run.SUITES == SUITES + OPTIONAL
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        for name in run.SUITES:
            mod = importlib.import_module(f"suites.{name}")
            assert mod.NAME == name
            assert all(callable(getattr(mod, f)) for f in ("add_args", "run", "plot", "summary")), name
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_transfer_measures_every_method_of_every_case(quick):
    doc = _doc(quick[0], "transfer")
    assert doc["rows"] and doc["params"]["sizes_mib"] == [1, 4]
    for r in doc["rows"]:
        assert _positive(r["bytes"]) and r["pages"] * r["page_size"] == r["tokens"]
        assert set(r["methods"]) == {"memcpy", "in-process write", "in-process load", "daemon write",
                                     "daemon load"}
        for m in r["methods"].values():
            _times(m)
            assert len(m["times_s"]) == r["repeats"] and _positive(m["gb_per_s"])
        assert _positive(r["ratio_write"]) and _positive(r["ratio_load"])
    # MHA pages of 16 tokens are 2 MiB: larger than the 1 MiB case, which is skipped and said so.
    assert [(s["layout"], s["page_size"], s["size_mib"]) for s in doc["skipped"]] == [("mha", 16, 1)]


def test_control_measures_each_lane_and_the_bare_calls(quick):
    doc = _doc(quick[0], "control")
    names = {r["name"]: r for r in doc["rows"]}
    assert {"grpc.aio unary", "grpc sync unary"} <= set(names)
    for lane in doc["params"]["lanes"]:
        for op in ("write", "load", "round trip"):
            r = names[f"{op} [{lane}]"]
            assert r["lane"] == lane and r["n"] == doc["params"]["trips"]
            _times(r)
    for r in names.values():
        _times(r)


def test_pipeline_times_every_layer(quick):
    doc = _doc(quick[0], "pipeline")
    (r,) = doc["rows"]
    layers = doc["params"]["layers"]
    for run in r["time_to_layer_s"]:
        assert len(run) == layers and _positive(run[0])
        assert all(a <= b for a, b in zip(run, run[1:], strict=False))
    _times(r["first_layer"])
    _times(r["whole"])
    assert 0 < r["first_over_whole_median"] <= 1


def test_concurrency_reports_each_engine_count(quick):
    doc = _doc(quick[0], "concurrency")
    assert [r["engines"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        assert len(r["ops_per_engine"]) == r["engines"] and all(n > 0 for n in r["ops_per_engine"])
        assert _positive(r["aggregate_gb_per_s"]) and _positive(r["ratio_to_one_engine"])
        assert r["bytes_moved"] == r["ops"] * doc["params"]["op_bytes"]
        _times(r["write"])
        _times(r["load"])
