"""benchmarks/bench_put.py runs end to end on small sizes: a lane Put of new keys into a full cache
on a daemon whose data plane stores it and on one whose loop does (KVSERVER_PLANE_PUTS=0), and a
binary Write of the same pages on each, for a 1-layer and a 2-layer registration, each row a
measured figure. The figures are the benchmark's, not this test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_put_prints_every_row() -> None:
    script = os.path.join(ROOT, "benchmarks", "bench_put.py")
    res = subprocess.run([sys.executable, script, "--trips", "100", "--block", "50", "--layers", "2",
                          "--host-memory-mib", "48", "--fill", "1.2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-4000:]
    row = r"\s+p50\s+[\d.]+ us\s+p99\s+[\d.]+ us\s+CPU per call: daemon\s+\d+ us\s+engine\s+\d+ us$"
    for layers, kib in ((1, 64), (2, 128)):
        head = rf"^{layers} layer\(s\), 1 page\(s\) of {kib} KiB a Put, 48MiB of host memory, full:$"
        assert re.search(head, out, re.M), out
    for label in ("Put of new keys", "binary Write, the same pages"):
        for side in ("plane", "loop"):
            assert len(re.findall(rf"^  {label} \[{side}\]{row}", out, re.M)) == 2, out
    assert len(re.findall(r"^  Put's p50, the plane's / the loop's: [\d.]+x$", out, re.M)) == 2, out
