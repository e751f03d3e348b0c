"""The copy kernel's rows with streaming stores against the same rows with memcpy, in one process.

Rows of --row-kib KiB (32: one (layer, part) of a 16-token page of 8 KV heads x 128 in bf16) at
scattered offsets, between a shared-memory buffer (as an engine's pool is) and private anonymous
memory (as the daemon's arena is), both ways; --mib of them a copy, over buffers twice that. Each
figure is the median of --repeats copies, memcpy and streamed in turn so that the machine's drift
hits both alike. The daemon streams a job of ``STREAM_MIN_JOB`` bytes or more (stream.h), so its
sizes below that are shown for what the choice leaves out. Run: python benchmarks/bench_stream.py
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

from kvserver.copies import transfer


def buffer(shared: bool, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    if shared:
        fd = os.memfd_create("kvserver-bench-stream")
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    else:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, np.uint8)
    arr[:] = 1  # every page touched before timing
    return mm, arr


def measure(mib: int, row: int, repeats: int, to_shared: bool, rng: np.random.Generator) -> dict[str, float]:
    nbytes = mib << 20
    rows = nbytes // row
    src_mm, src = buffer(not to_shared, 2 * nbytes)
    dst_mm, dst = buffer(to_shared, 2 * nbytes)
    src_off = (rng.permutation(2 * rows)[:rows] * row).astype(np.int64)
    dst_off = (rng.permutation(2 * rows)[:rows] * row).astype(np.int64)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats + 1):
        for stream in (False, True):
            t0 = time.perf_counter()
            transfer.copy_rows(dst.ctypes.data, dst_off.ctypes.data, src.ctypes.data, src_off.ctypes.data,
                               rows, row, stream)
            if i:  # the first round warms both
                times[stream].append(time.perf_counter() - t0)
    del src, dst
    src_mm.close()
    dst_mm.close()
    return {"memcpy": nbytes / statistics.median(times[False]) / 1e9,
            "stream": nbytes / statistics.median(times[True]) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--row-kib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if transfer.copy_rows is None:
        raise SystemExit("the copy kernel (_kvcopy) is not built")
    rng = np.random.default_rng(0)
    print(f"rows of {args.row_kib} KiB; the daemon streams from {transfer.STREAM_MIN_JOB >> 20} MiB a job")
    print("| copy | size | memcpy | streamed | streamed / memcpy |")
    print("|---|---|---|---|---|")
    for mib in args.mib:
        for to_shared, name in ((False, "pool -> arena (write)"), (True, "arena -> pool (load)")):
            r = measure(mib, args.row_kib << 10, args.repeats, to_shared, rng)
            print(f"| {name} | {mib} MiB | {r['memcpy']:.2f} GB/s | {r['stream']:.2f} GB/s | "
                  f"**{r['stream'] / r['memcpy']:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
