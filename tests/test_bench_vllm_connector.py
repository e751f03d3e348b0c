"""The vLLM connector benchmark runs end to end on a small size and prints its rows and ratios; the
script checks that its last load gave exactly the stored blocks. Skipped without vLLM."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import vllm_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)


def test_bench_vllm_connector_small(monkeypatch, capsys) -> None:
    path = os.path.join(ROOT, "benchmarks", "bench_vllm_connector.py")
    spec = importlib.util.spec_from_file_location("bench_vllm_connector", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", [path, "--blocks", "4", "--layers", "4", "--repeats", "2",
                                      "--layout", "LHBNC", "--host-memory", "16MiB"])
    bench.main()
    out = capsys.readouterr().out
    row = r"^\s+(save \(Put\)|load \(Get, per layer\)|in-process copy)\s+([\d.]+) ms"
    rows = dict(re.findall(row, out, re.M))
    assert len(rows) == 3 and all(float(ms) > 0 for ms in rows.values()), out
    assert re.search(r"save / in-process copy: [\d.]+x the time; load / in-process copy: [\d.]+x", out), out
    assert re.search(r"layer 0 usable after [\d.]+ ms of a [\d.]+ ms load \([\d.]+/4 of it\)", out), out
