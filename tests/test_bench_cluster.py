"""benchmarks/bench_cluster.py runs end to end on a small size: a Get through two daemons and
Mooncake's own batch_get_into of the same pages, every page checked (the figures are the
benchmark's; the tier's behaviour is test_cluster_tier.py's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from mooncake_master import needs_mooncake

REPO = Path(__file__).resolve().parents[1]


def test_bench_cluster_prints_the_daemon_path_beside_mooncake_s_own():
    needs_mooncake()
    run = subprocess.run([sys.executable, "benchmarks/bench_cluster.py", "--mib", "8", "--rounds", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    rounds = re.findall(r"round \d: daemon ([\d.]+) GB/s, mooncake ([\d.]+) GB/s, ratio ([\d.]+); "
                        r"the load alone ([\d.]+) GB/s; mooncake \+ copy ([\d.]+), "
                        r"in 8 overlapped ([\d.]+) GB/s", run.stdout)
    assert len(rounds) == 2 and all(float(v) > 0 for r in rounds for v in r), run.stdout
    for name in ("daemon / mooncake", "daemon / (mooncake + copy)", "overlapped / (mooncake + copy)"):
        pattern = rf"ratio {re.escape(name)}: median [\d.]+ \(rounds [\d.]+, [\d.]+\)"
        assert re.search(pattern, run.stdout), run.stdout
    m = re.search(r"B pulled (\d+) pages, (\d+) errors", run.stdout)
    assert m and int(m.group(1)) == 8 * 3 and m.group(2) == "0", run.stdout  # a warm-up Get, two rounds
