"""benchmarks/bench_release.py runs end to end on a small region and prints both releases and the
ratio (the figures are the benchmark's; test_core_bounded_cost.py checks that a release's pages go
back in a worker, not on the loop)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_release_prints_both_releases_and_the_ratio():
    run = subprocess.run([sys.executable, "benchmarks/bench_release.py", "--gib", "0.5"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    lags = [float(x) for x in re.findall(r"the loop's longest lag ([\d.]+) ms", run.stdout)]
    assert len(lags) == 2 and "lag ratio worker / loop" in run.stdout, run.stdout
