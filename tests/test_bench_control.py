"""benchmarks/bench_control.py runs end to end on a small budget, its Write and Load too
(--copies), and a Register of many layers (--layers), and prints each step with the probe's
longest call meanwhile (the figures are the
benchmark's; test_core_bounded_cost.py holds the steps to their bounds)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_control_prints_each_step_copies_included():
    args = ["--host-memory", "64MiB", "--rank", "64", "--page-size", "1", "--tokens", str(1 << 17)]
    run = subprocess.run([sys.executable, "benchmarks/bench_control.py", *args, "--copies"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    line = r"^  (\w+) +[\d.]+ s   probe's longest Stats meanwhile +[\d.]+ ms   (.*)$"
    steps = re.findall(line, run.stdout, re.M)
    assert [name for name, _ in steps] == ["Register", "Alloc", "Write", "Load", "Free"], run.stdout
    assert dict(steps)["Write"] == dict(steps)["Load"] == f"{(1 << 17) * 64} bytes", run.stdout


def test_bench_control_registers_a_pool_of_many_layers():
    args = ["--layers", "512", "--tokens", "1024", "--host-memory", "64MiB"]
    run = subprocess.run([sys.executable, "benchmarks/bench_control.py", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pages of 512 B (MLA rank 1, fp8, 512 layers, page 1)" in run.stdout, run.stdout
    line = r"^  (\w+) +[\d.]+ s   probe's longest Stats meanwhile +[\d.]+ ms   (.*)$"
    steps = dict(re.findall(line, run.stdout, re.M))
    assert list(steps) == ["Register", "Alloc", "Free"], run.stdout
    assert re.match(r"\d+ tokens granted", steps["Register"]) and steps["Alloc"] == "1024 tokens", run.stdout
