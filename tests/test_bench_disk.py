"""benchmarks/bench_disk.py runs end to end on a small size and prints the disk tier's write and
read rates beside plain O_DIRECT's of the same bytes (the figures are the benchmark's; the disk
tier's behaviour is test_disk_tier.py's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_disk_prints_both_rates_against_plain_direct_io(tmp_path):
    # Two threads: a smoke run of the script, which leaves the other test worker its CPU.
    args = ["--gib", "0.0625", "--rounds", "2", "--threads", "2", "--dir", str(tmp_path)]
    run = subprocess.run([sys.executable, "benchmarks/bench_disk.py", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    rounds = re.findall(r"round \d: write plain ([\d.]+) GB/s, tier ([\d.]+) GB/s \(([\d.]+)x\); "
                        r"read plain ([\d.]+) GB/s, tier ([\d.]+) GB/s \(([\d.]+)x\)", run.stdout)
    assert len(rounds) == 2, run.stdout
    assert all(float(v) > 0 for r in rounds for v in r)
    summary = r"0\.06 GiB in pages of 2 MiB: write [\d.]+x plain O_DIRECT, read [\d.]+x plain O_DIRECT"
    assert re.search(summary, run.stdout), run.stdout
