"""benchmarks/bench_engine_faults.py runs end to end on small sizes, as a subprocess (it stops its
daemon with SIGSTOP): it prints the stopped-daemon, burst and stuck-Put lines, and holds the
figures the fixes give (every figure's own bound is its test's: test_vllm_connector.py and
test_sglang_linker.py). Skipped without vLLM."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_env

REPO = Path(__file__).resolve().parents[1]

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)


def test_bench_engine_faults_small():
    args = ["--steps", "3", "--burst", "24", "--finished", "6"]
    run = subprocess.run([sys.executable, "benchmarks/bench_engine_faults.py", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    worst = re.search(r"vLLM scheduler: worst schedule\(\) (\d+) ms \(bound lookup_timeout_s (\d+) ms", out)
    assert worst and int(worst.group(1)) < int(worst.group(2)) + 500, out
    assert re.search(r"burst of 24: 24 of 24 hits", out), out
    held = re.search(r"blocks back after ([\d.]+) s \(bound: .*?([\d.]+) s;", out)
    assert held and float(held.group(1)) < float(held.group(2)) + 2, out
