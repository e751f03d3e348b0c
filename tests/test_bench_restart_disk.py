"""benchmarks/bench_restart.py --tier disk runs end to end on a small disk tier: the daemon started
on the directory serves the pages from disk, and the start to hits, the baseline start and the
adoption of the disk's index are printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_restart_on_the_disk_tier(tmp_path):
    args = ["--tier", "disk", "--dir", str(tmp_path), "--sizes", "0.0625", "--runs", "1"]
    run = subprocess.run([sys.executable, "benchmarks/bench_restart.py", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    m = re.search(r"\((\d+) pages of 256 KiB.*start to hits ([\d.]+) s.*the daemon's adoption ([\d.]+) s",
                  run.stdout)
    assert m, run.stdout
    assert int(m.group(1)) == 256 and float(m.group(3)) > 0
