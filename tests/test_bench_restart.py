"""benchmarks/bench_restart.py runs end to end on a small kept cache and prints the start to hits,
the baseline start of the same run and the daemon's own adoption time (the figures are the
benchmark's; test_e2e_kept.py checks what a restart finds)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_restart_prints_start_to_hits_against_an_empty_start(tmp_path):
    plot = tmp_path / "restart.png"
    run = subprocess.run([sys.executable, "benchmarks/bench_restart.py", "--sizes", "0.0625", "--runs", "1",
                          "--plot", str(plot)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    m = re.search(r"\((\d+) pages of 256 KiB.*start to hits ([\d.]+) s.*empty start to an answer ([\d.]+) s"
                  r".*the daemon's adoption ([\d.]+) s", run.stdout)
    assert m, run.stdout
    assert int(m.group(1)) == 256 and float(m.group(4)) > 0
    assert plot.stat().st_size > 0
