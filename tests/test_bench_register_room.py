"""benchmarks/bench_register_room.py runs end to end on a small budget and prints, per run, the
Register's time, the probe's longest Stats during it and idle, and their median ratio (the figures
are the benchmark's; test_store_make_room.py checks that the eviction runs in steps and frees its
memory off the loop)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_register_room_prints_each_run_and_the_ratio():
    run = subprocess.run([sys.executable, "benchmarks/bench_register_room.py", "--host-memory", "64MiB",
                          "--page-bytes", "16384", "--runs", "1"], cwd=REPO, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    runs = re.findall(r"Register of (\d+) MiB took [\d.]+ ms, left (\d+) MiB cached; probe's longest Stats "
                      r"meanwhile [\d.]+ ms, idle [\d.]+ ms: [\d.]+x", run.stdout)
    assert len(runs) == 1 and all(int(granted) >= 40 for granted, _ in runs), run.stdout
    assert re.search(r"pages of 16384 B: .* median [\d.]+x", run.stdout), run.stdout
