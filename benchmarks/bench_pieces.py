"""What cutting a copy in pieces costs, and what a second copy thread gives, in this process.

A 256 MiB scattered copy (32 layers x K, V, pages of 32 KiB, the daemon's plan and kernel) as one
kernel call, then through ``kvserver.copies.workers`` in pieces of 1, 2 and 4 MiB on one worker, and
in 1 MiB pieces split over two workers at once. Median of --repeats, each in turn so that drift
hits all alike. Run: python benchmarks/bench_pieces.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvserver.copies import transfer
from kvserver.copies.workers import CopyQueue, Work

LAYERS, PARTS, ROW = 32, 2, 32768
HOST_PAGES, DEVICE_PAGES, PAGES = 512, 1024, 128  # 128 pages x 32 KiB x 64 buffers = 256 MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    host = torch.zeros(LAYERS, PARTS, HOST_PAGES * ROW, dtype=torch.uint8)
    dev = torch.ones(LAYERS, PARTS, DEVICE_PAGES * ROW, dtype=torch.uint8)

    def table(t: torch.Tensor) -> transfer.BufferTable:
        bases = np.array([[t[i, p].data_ptr() for p in range(PARTS)] for i in range(LAYERS)], dtype=np.uint64)
        return transfer.BufferTable(bases=bases, row_stride=ROW, row_bytes=ROW)

    ht, dt = table(host), table(dev)
    rng = np.random.default_rng(0)
    plan = transfer.CopyPlan(np.ascontiguousarray(rng.permutation(HOST_PAGES)[:PAGES], dtype=np.int64),
                             np.ascontiguousarray(rng.permutation(DEVICE_PAGES)[:PAGES], dtype=np.int64),
                             True, 16)
    rows = transfer.job_rows(plan, ht, dt)
    copier = transfer.RowCopier(rows, np.arange(LAYERS, dtype=np.int64), ht, dt, False)
    one_worker, two_workers = CopyQueue(1), CopyQueue(2)

    def pieces(queue: CopyQueue, split: int, parallel: bool):
        bounds = [rows.count * s // split for s in range(split + 1)]

        def run(i: int) -> None:
            g, s = divmod(i, split)
            copier.copy(g, g + 1, bounds[s], bounds[s + 1])

        # Parallel pieces go as a load's: a write's take one worker (the other core is the loop's).
        work = lambda: Work(parallel, LAYERS * split, run, parallel=parallel)  # noqa: E731
        return lambda: queue.submit_work(work()).result()

    per_layer_mib = rows.count * ROW * PARTS >> 20  # 8 MiB
    cases = {
        "one kernel call": lambda: copier.copy(0, LAYERS, 0, rows.count),
        "pieces of 4 MiB, 1 worker": pieces(one_worker, per_layer_mib // 4, False),
        "pieces of 2 MiB, 1 worker": pieces(one_worker, per_layer_mib // 2, False),
        "pieces of 1 MiB, 1 worker": pieces(one_worker, per_layer_mib, False),
        "pieces of 1 MiB, 2 workers": pieces(two_workers, per_layer_mib, True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["one kernel call"])
    print(f"256 MiB scattered copy, median of {args.repeats}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<28} {m * 1e3:7.1f} ms  {256 / 1024 / m:5.2f} GiB/s  {m / base:5.2f}x one call")
    one_worker.shutdown()
    two_workers.shutdown()


if __name__ == "__main__":
    main()
