"""benchmarks/bench_start.py runs end to end and prints both daemons' starts, their memory, whether
torch is mapped and the ratio (the figures are the benchmark's; test_server_without_torch.py checks
that the daemon loads no torch)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_start_prints_both_starts_and_the_ratio():
    run = subprocess.run([sys.executable, "benchmarks/bench_start.py", "--runs", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    row = r"^\| {} \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| (\d+) \| (\w+) \|$"
    shipped = re.search(row.format("as shipped"), run.stdout, re.M)
    base = re.search(row.format(r"torch imported first \(baseline\)"), run.stdout, re.M)
    assert shipped and base, run.stdout
    assert shipped.group(3) == "no" and base.group(3) == "yes", run.stdout
    assert float(shipped.group(1)) > 0 and int(shipped.group(2)) < int(base.group(2)), run.stdout
    assert re.search(r"start as shipped / baseline: [\d.]+$", run.stdout, re.M), run.stdout
