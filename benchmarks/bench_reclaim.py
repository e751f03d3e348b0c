"""Seconds from SIGKILL of an engine in the middle of a load to the daemon holding nothing of it.

The daemon runs as a subprocess with its defaults (1 s reclaim grace); engines are the torch-free
test engines, started from a forkserver. Run: python benchmarks/bench_reclaim.py [--kills N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from daemon_proc import DaemonProcess  # noqa: E402
from light_engine import killed_mid_load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=10)
    args = ap.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["light_engine"])
    with tempfile.TemporaryDirectory(prefix="kvreclaim-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--progress-interval-ms", "0",
                          "--log-level", "ERROR")
        times = []
        try:
            for _ in range(args.kills):
                name = f"kvbench-{secrets.token_hex(4)}"
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=killed_mid_load, args=(d.address, name, child))
                proc.start()
                parent.recv()  # its load has started streaming
                os.kill(proc.pid, signal.SIGKILL)
                t0 = time.monotonic()
                proc.join()
                d.wait_for(lambda s: s.num_clients == 0 and s.reserved_bytes == 0, timeout=10)
                times.append(time.monotonic() - t0)
        finally:
            d.stop()
    print(f"reclaim after SIGKILL mid-load, {args.kills} kills: median {statistics.median(times):.2f} s, "
          f"min {min(times):.2f} s, max {max(times):.2f} s")


if __name__ == "__main__":
    main()
