"""The HiCache backend benchmark runs end to end on a small size and prints its three rows and
the ratio: every figure comes from a run whose last round loaded exactly the stored bytes (the
script checks). Run in this process (SGLang is imported once per test session), the daemon as a
subprocess as the script starts it. Skipped where scripts/install_sglang.sh has not run."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import sglang_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if not sglang_env.sglang_installed():
    pytest.skip("sglang not installed (scripts/install_sglang.sh)", allow_module_level=True)


def test_bench_sglang_storage_small(monkeypatch, capsys) -> None:
    path = os.path.join(ROOT, "benchmarks", "bench_sglang_storage.py")
    spec = importlib.util.spec_from_file_location("bench_sglang_storage", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", [path, "--pages", "8", "--layers", "4", "--repeats", "2",
                                      "--layout", "layer_first", "--host-memory", "16MiB"])
    try:
        bench.main()
    finally:
        sglang_env.restore()
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\s+(set\+get|in-process copy|staging copies)\s+([\d.]+) ms", out, re.M))
    assert set(rows) == {"set+get", "in-process copy", "staging copies"}, out
    assert all(float(ms) > 0 for ms in rows.values())
    assert re.search(r"set\+get / in-process copy: [\d.]+x the time", out), out
