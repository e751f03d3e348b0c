"""The cache benchmark runs end to end in its quick mode and prints both tables: every figure it
prints comes from a run whose Get returned exactly the bytes that were Put (the script checks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_cache_quick() -> None:
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_cache.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    lookup = [line.split() for line in lines if re.match(r"\s*(1024|8192)\s+\d", line)]
    assert [row[0] for row in lookup] == ["1024", "8192"], res.stdout
    for row in lookup:
        ratios = [float(x.rstrip("x")) for x in row[4:]]
        assert len(ratios) == 2 and all(r > 0 for r in ratios), row
    transfer = [line.split() for line in lines if re.match(r"\s*8\s+\d+\.\d+", line)]
    assert len(transfer) == 2, res.stdout  # cache vs index API; kept cache vs plain
    for row in transfer:
        figures = [float(x.rstrip("x")) for x in row[1:]]
        assert len(figures) == 6 and all(f > 0 for f in figures), transfer
    assert "--host-memory-dir" in res.stdout
