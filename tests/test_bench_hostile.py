"""benchmarks/bench_hostile.py runs end to end in short phases: it prints the victim's Load
percentiles and the loop's lag for the idle and the hostile phase, their ratio, and every attack
ran without an error (the figures are the benchmark's, recorded in docs/performance.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _attacks() -> set[str]:
    """The benchmark's attacks (every one runs by default), read from its module."""
    spec = importlib.util.spec_from_file_location("bench_hostile", REPO / "benchmarks" / "bench_hostile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.ATTACKS)


def _run(seconds: int) -> dict[str, str]:
    run = subprocess.run([sys.executable, "benchmarks/bench_hostile.py", "--seconds", str(seconds),
                          "--host-memory", "512MiB"],
                         cwd=REPO, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(re.findall(r"p99 [\d.]+ ms; loop lag p99 <= [\d.]+ ms", run.stdout)) == 2, run.stdout
    assert "victim p99 ratio hostile / idle" in run.stdout, run.stdout
    assert re.search(r"found the CPU shared \(idle, cpu, hostile\): \d+, \d+, \d+\n", run.stdout), run.stdout
    rounds = dict(re.findall(r"  ([a-zA-Z ]+): (-?\d+) rounds", run.stdout))
    assert set(rounds) == _attacks(), run.stdout
    assert all(int(n) >= 0 for n in rounds.values()), run.stdout  # none stopped on an error
    return rounds


def test_bench_hostile_prints_both_phases_and_every_attack():
    """Every attack at once, as the benchmark runs by default, in short phases (the figures are the
    benchmark's to measure, not this test's): each ran to the end without an error, and the lanes'
    attacks, which need no setup of their own, served rounds."""
    rounds = _run(2)
    assert int(rounds["full lanes"]) > 0 and int(rounds["doorbell flood"]) > 0, rounds
