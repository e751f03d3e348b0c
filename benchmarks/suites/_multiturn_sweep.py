"""Per-call transfer time by size, the measured reason behind the tiers' load and write times: the
same pages moved by the in-process kernel, the index API (Write, Load) and the node-wide cache
(Put of fresh keys, Get of stored ones), each size's calls run in turn (median of ``repeats``)."""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable

from _multiturn_dp import CacheReplica
from _multiturn_tiers import IndexHost, InProcessHost


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def sweep(inproc: InProcessHost, index: IndexHost, replica: CacheReplica, sizes: list[int],
          repeats: int) -> list[dict]:
    dev = inproc.dev
    rows = []
    fresh = iter(range(1 << 30))
    for n in sizes:
        slots = list(range(n))
        dev.fill(10_000, 0, slots)
        replica.dev.fill(10_000, 0, slots)
        host_slots = list(range(n))
        host = index.client.alloc(n * dev.geom.page)
        dev_tokens = dev.tokens(slots)
        stored = [hashlib.blake2b(f"sweep/{n}/{i}".encode(), digest_size=16).digest() for i in range(n)]
        replica.client.put(b"".join(stored), slots)

        def put(n=n, slots=slots) -> None:
            k = next(fresh)
            keys = [hashlib.blake2b(f"sweep-put/{k}/{i}".encode(), digest_size=16).digest() for i in range(n)]
            replica.client.put(b"".join(keys), slots)

        def get(stored=stored, slots=slots, n=n) -> None:
            handle = replica.client.get(b"".join(stored), slots)
            assert handle.pages(timeout=60) == n, "the pages to Get were evicted"
            handle.wait(timeout=60)

        try:
            t = _interleaved({
                "inprocess_write": lambda h=host_slots, s=slots: inproc._copy(h, s, False),
                "inprocess_load": lambda h=host_slots, s=slots: inproc._copy(h, s, True),
                "index_write": lambda h=host, d=dev_tokens: index.client.write(host_indices=h,
                                                                               device_indices=d),
                "index_load": lambda h=host, d=dev_tokens: index.client.load(host_indices=h,
                                                                              device_indices=d).wait(60),
                "cache_put": put,
                "cache_get": get,
            }, repeats)
        finally:
            index.client.free(host)
        row = {"pages": n, "bytes": n * dev.geom.page_bytes}
        row.update({f"{k}_ms": v * 1e3 for k, v in t.items()})
        rows.append(row)
    return rows


def sizes_for(device_pages: int, quick: bool) -> list[int]:
    want = [1, 8] if quick else [1, 4, 16, 64, 256]
    return sorted({min(n, device_pages) for n in want})

