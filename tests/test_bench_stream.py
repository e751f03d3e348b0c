"""benchmarks/bench_stream.py runs end to end on small sizes: a row for each direction and size,
both copies' rates and their ratio. The figures are the benchmark's, not this test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvserver.copies import transfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(transfer.copy_rows is None, reason="the copy kernel is not built")
def test_bench_stream_prints_both_copies_for_each_direction_and_size() -> None:
    script = os.path.join(ROOT, "benchmarks", "bench_stream.py")
    res = subprocess.run([sys.executable, script, "--mib", "1", "4", "--repeats", "3"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = re.findall(r"^\| (pool -> arena \(write\)|arena -> pool \(load\)) \| (\d+) MiB \| "
                      r"([\d.]+) GB/s \| ([\d.]+) GB/s \| \*\*([\d.]+)x\*\* \|$", res.stdout, re.M)
    assert [(r[0].split()[0], int(r[1])) for r in rows] == [
        (side, mib) for mib in (1, 4) for side in ("pool", "arena")], res.stdout
    for _, _, memcpy, streamed, ratio in rows:
        assert float(memcpy) > 0 and float(streamed) > 0
        want = float(streamed) / float(memcpy)  # of the printed (rounded) rates: within their rounding
        assert abs(float(ratio) - want) <= 0.005 + 0.01 * want, (ratio, want)
    assert f"streams from {transfer.STREAM_MIN_JOB >> 20} MiB" in res.stdout
