"""In-process copy speed of one 16 MiB device -> host job per device layout (docs/layouts.md).

The same job as benchmarks/bench_transfer.py's (8 scattered pages of 16 tokens, 32 layers x 2
parts, 8 heads x 256 B a token), run through ``kvserver.copies.transfer.copy_job`` with the pool
described as plain token rows (page rows and token rows), vLLM's FlashInfer (blocks of 16
tokens, K and V interleaved) and FlashInfer HND (per-(token, head) segments). Median of 15.
Run: python benchmarks/bench_layouts.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvserver.copies import transfer
from kvserver.copies.geometry import Geometry
from kvserver.copies.transfer import BufferTable

L, P, H, HB, PS, N, BS, PAGES = 32, 2, 8, 256, 16, 1024, 16, 8
TB = H * HB


def main() -> None:
    chunk = PS * TB
    host = torch.zeros(PAGES * L * P * chunk, dtype=torch.uint8)
    dev = torch.randint(0, 255, (L * P * N * TB,), dtype=torch.uint8)
    hb, db, layer_bytes = host.data_ptr(), dev.data_ptr(), P * N * TB
    host_t = BufferTable(np.array([[hb + (la * P + p) * chunk for p in range(P)] for la in range(L)],
                                  dtype=np.uint64), L * P * chunk, TB)
    dpages = np.random.default_rng(0).permutation(N // PS)[:PAGES]
    tokens = (dpages[:, None] * PS + np.arange(PS)).reshape(-1)

    def run(table: BufferTable, paged: bool) -> float:
        plan = transfer.CopyPlan(np.arange(PAGES, dtype=np.int64), dpages if paged else tokens, paged, PS)
        layers = np.arange(L, dtype=np.int64)
        times = []
        for _ in range(15):
            t = time.perf_counter()
            if transfer.copy_job(plan, layers, host_t, table, False) is None:
                raise SystemExit("the compiled copy kernel (_kvcopy) is missing")
            times.append(time.perf_counter() - t)
        return host.numel() / sorted(times)[7] / 1e9

    plain = np.array([[db + la * layer_bytes + p * N * TB for p in range(P)] for la in range(L)],
                     dtype=np.uint64)
    blocked = np.array([[db + la * layer_bytes + p * BS * TB for p in range(P)] for la in range(L)],
                       dtype=np.uint64)
    fi = Geometry(0, TB, BS, 2 * BS * TB, HB, H, HB, True)
    hnd = Geometry(0, HB, BS, 2 * BS * TB, BS * HB, H, HB, True)
    cases = [
        ("plain, page rows", BufferTable(plain, PS * TB, PS * TB), True),
        ("plain, token rows", BufferTable(plain, TB, TB), False),
        ("FlashInfer (blocks), token rows", BufferTable(blocked, None, TB, fi), False),
        ("FlashInfer HND, head segments", BufferTable(blocked, None, HB, hnd), False),
    ]
    print(f"{host.numel() >> 20} MiB device -> host, {PAGES} scattered pages x {PS} tokens, "
          f"{L} layers x {P} parts, {H} heads x {HB} B")
    for name, table, paged in cases:
        print(f"{name:34s} {run(table, paged):6.2f} GB/s")


if __name__ == "__main__":
    main()
