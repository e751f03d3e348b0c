"""benchmarks/bench_large_put.py runs end to end and prints, per Put, its time, the probe's longest
Stats during it and idle, and their median ratio (the figures are the benchmark's;
test_store_steps.py checks that a Put's pages are committed in steps)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_large_put_prints_each_put_and_the_ratio():
    run = subprocess.run([sys.executable, "benchmarks/bench_large_put.py", "--host-memory", "256MiB",
                          "--tp", "2", "--puts", "1"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    puts = re.findall(r"TP 2, Put 1: (\d+) stored in [\d.]+ ms; probe's longest Stats meanwhile [\d.]+ ms, "
                      r"idle [\d.]+ ms: [\d.]+x", run.stdout)
    assert puts == [str(1 << 17)], run.stdout
    median = r"TP 2: probe's longest Stats during a Put over idle, median [\d.]+x"
    assert re.search(median, run.stdout), run.stdout
