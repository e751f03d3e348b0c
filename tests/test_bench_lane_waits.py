"""benchmarks/bench_lane_waits.py runs end to end on small sizes: a row for each case and way of
waiting, with both ratios against the in-process copy, the engine thread's CPU per Write, the Write's
time beyond the data plane's and the Writes whose client slept at the answer. The figures are the
benchmark's, not this test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvserver.copies import transfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(transfer.copy_rows is None, reason="the copy kernel is not built")
def test_bench_lane_waits_prints_every_way_of_waiting_for_each_case() -> None:
    script = os.path.join(ROOT, "benchmarks", "bench_lane_waits.py")
    res = subprocess.run([sys.executable, script, "--mib", "1", "--page-sizes", "16", "--layouts", "mha",
                          "mla", "--layers", "4", "--rounds", "10"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    modes = ("nudge+nap", "nudge+nap, mean pace", "nudge", "nap", "neither")
    rows = re.findall(r"^\| (MHA|MLA) \| 16 \| ([\d.]+) MiB \| "
                      r"(nudge\+nap(?:, mean pace)?|nudge|nap|neither) \| ([\d.]+)x "
                      r"\| ([\d.]+)x \| (\d+) us \| (-?\d+|nan) us \| (\d) of (\d) \| 2 \|$",
                      res.stdout, re.M)
    expected = [(lay, mode) for lay in ("MHA", "MLA") for mode in modes]
    assert [(r[0], r[2]) for r in rows] == expected, res.stdout
    for _, size, _, write, load, cpu, beyond, asleep, answered in rows:
        assert 0 < float(size) <= 1 and float(write) > 0 and float(load) > 0 and int(cpu) > 0
        # Beyond the plane's time: the client's own Python at least (nan: the loop answered, as a
        # busy machine's plane may leave a Write to it).
        assert beyond == "nan" or int(beyond) > 0
        assert int(asleep) <= int(answered) <= 2  # of the Writes the plane answered
    assert any(r[6] != "nan" for r in rows)  # the plane answered
