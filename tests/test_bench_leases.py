"""benchmarks/bench_leases.py runs end to end on small sizes and prints, for each way leases end
(one Release, the holder's Unregister, expiry in one sweep), the window, the probe's longest Stats
meanwhile and idle, and their ratio (the figures are the benchmark's; test_store_steps.py checks
that leases end in steps)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_leases_prints_each_way_leases_end():
    run = subprocess.run([sys.executable, "benchmarks/bench_leases.py", "--leases", "4", "--pins", "4096",
                          "--expiry-ms", "4000", "--host-memory", "64MiB"],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 leases of 4096 pins each (16384 pins), budget 64MiB" in run.stdout, run.stdout
    line = (r"^  (\w+) +ended within +([\d.]+) ms; probe's longest Stats meanwhile +[\d.]+ ms, "
            r"idle +[\d.]+ ms: [\d.]+x$")
    ways = re.findall(line, run.stdout, re.M)
    assert [w for w, _ in ways] == ["release", "unregister", "expiry"], run.stdout
    assert float(dict(ways)["expiry"]) == 1500.0, run.stdout  # from the leases' end past the next sweep
