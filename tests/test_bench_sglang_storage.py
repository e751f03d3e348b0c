"""The HiCache backend benchmark runs end to end on a small size and prints its three rows and
the ratio: every figure comes from a run whose last round loaded exactly the stored bytes (the
script checks). Skipped where scripts/install_sglang.sh has not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import sglang_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not sglang_env.sglang_installed(),
                    reason="sglang not installed (scripts/install_sglang.sh)")
def test_bench_sglang_storage_small() -> None:
    script = os.path.join(ROOT, "benchmarks", "bench_sglang_storage.py")
    res = subprocess.run([sys.executable, script, "--pages", "8", "--layers", "4", "--repeats", "2",
                          "--layout", "layer_first", "--host-memory", "256MiB"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = dict(re.findall(r"^\s+(set\+get|in-process copy|staging copies)\s+([\d.]+) ms", res.stdout, re.M))
    assert set(rows) == {"set+get", "in-process copy", "staging copies"}, res.stdout
    assert all(float(ms) > 0 for ms in rows.values())
    assert re.search(r"set\+get / in-process copy: [\d.]+x the time", res.stdout), res.stdout
