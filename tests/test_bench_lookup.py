"""benchmarks/bench_lookup.py runs end to end on small sizes: a Lookup timed inside an in-process
daemon, with the index's compiled walk and digests and with their numpy and hashlib versions, for
keys of 16 and 32 bytes, beside a dict; every timed Lookup found every key (the script checks). The
figures are the benchmark's, not this test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvserver.store import index

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_lookup_prints_the_lookup_in_the_daemon_against_a_dict() -> None:
    script = os.path.join(ROOT, "benchmarks", "bench_lookup.py")
    res = subprocess.run([sys.executable, script, "--rounds", "20", "--keys", "1024,4096"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = re.findall(r"^(engine \(its part\)|scheduler \(the space\))\s+(\d+)\s+(\d+)\s+([\d.]+)µs\s+"
                      r"([\d.]+)µs\s+([\d.]+)µs\s+([\d.]+)×$", res.stdout, re.M)
    assert [(r[0].split()[0], int(r[1]), int(r[2])) for r in rows] == [
        (who, width, n) for width in (16, 32) for n in (1024, 4096) for who in ("engine", "scheduler")
    ], res.stdout
    assert all(float(v) > 0 for r in rows for v in r[3:]), res.stdout
    built = "yes" if index._kvindex is not None else "not built"
    for width in (16, 32):
        assert re.search(rf"target: a Lookup of 1k keys of {width} bytes in the daemon ≤ 50 µs: [\d.]+ µs "
                         rf"\((met|not met); compiled walk and digests: {built}\)", res.stdout), res.stdout
