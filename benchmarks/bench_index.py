"""The cache's bookkeeping: bytes of daemon memory per cached page, and what a full cache of tiny
pages costs beside its budget.

A cache over a real arena of --mib MiB is filled with 64-byte pages by Puts of 64Ki packed keys
(as requests bring them) until it holds no more; the process's resident memory is read before and
after (the arena itself is not written: no engine copies here, so what grows is the bookkeeping).
The baseline, in the same run, is the per-key Python objects an index of the same keys costs
(a dict of key bytes to page ids with the keys listed per page and the free ids listed as ints,
as the cache kept them before its index became arrays). Prints the bytes per page of each, their
ratio, the cache's pages and its bookkeeping as a share of the budget, and a Put's and a Lookup's
time on the event loop.

Run: python benchmarks/bench_index.py [--mib 256]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import sys
import time

import numpy as np

from kvserver.host.arena import HostArena
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys, KVCache, PartKey, SpaceKey
from kvserver.store.pages import BYTES_PER_PAGE

MiB = 1 << 20
PAGE_BYTES = 64
BATCH = 1 << 16


def rss() -> int:
    """Resident bytes of this process, what the allocator kept of freed memory given back first
    (glibc keeps freed blocks for reuse: they would count as the cache's, more or less by chance)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packed(start: int, n: int) -> bytes:
    return (np.arange(start, start + n, dtype=np.uint64).repeat(2) * np.uint64(0x9E3779B97F4A7C15)).tobytes()


def fill_cache(mib: int) -> tuple[int, int, float, float]:
    """(pages cached, resident bytes grown, a Put's mean seconds, a Lookup's mean seconds)."""
    arena = HostArena(mib * MiB)
    cache = KVCache(arena)
    key = SpaceKey("bench", "m", KVLayout.mha(1, 16), dtype_named("float16"), 1, 1, 1, 1)
    part = cache.part(cache.space(key), PartKey(0, 0, 0, 1, PAGE_BYTES))
    gc.collect()
    before = rss()
    put_times, lookup_times = [], []
    start = 0
    while True:
        keys = Keys.unpack(packed(start, BATCH), 16, BATCH)
        t = time.perf_counter()
        plan = cache.prepare_put(part, keys)
        cache.complete_put(plan, True)
        put_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        cache.lookup(part, keys)
        lookup_times.append(time.perf_counter() - t)
        start += BATCH
        if plan.dropped or part.pages < start:  # full: this Put stored less, or evicted
            break
    del keys, plan  # the last request's own arrays are not the cache's bookkeeping
    gc.collect()
    grown = rss() - before
    return part.pages, grown, float(np.mean(put_times)), float(np.mean(lookup_times))


def fill_dict(pages: int) -> int:
    """Resident bytes grown by the per-key Python objects of an index of ``pages`` pages."""
    gc.collect()
    before = rss()
    index: dict[bytes, int] = {}
    keys: list[bytes | None] = []
    free: list[int] = []
    for start in range(0, pages, BATCH):
        n = min(BATCH, pages - start)
        batch = np.frombuffer(packed(start, n), dtype="V16").tolist()
        ids = list(range(start, start + n))
        index.update(zip(batch, ids, strict=True))
        keys.extend(batch)
        free.extend(range(start + 10**9, start + 10**9 + n))  # the free list as it held the ids
    gc.collect()
    grown = rss() - before
    del index, keys, free
    return grown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="the cache's host memory budget")
    args = ap.parse_args()
    pages, grown, put_s, lookup_s = fill_cache(args.mib)
    base = fill_dict(pages)
    per, base_per = grown / pages, base / pages
    budget = args.mib * MiB
    print(f"cache of {args.mib} MiB, {PAGE_BYTES}-byte pages: {pages} pages cached "
          f"({pages * PAGE_BYTES / MiB:.1f} MiB of pages)")
    print(f"bookkeeping: {per:.1f} bytes a page measured ({BYTES_PER_PAGE} charged to the budget); "
          f"{grown / MiB:.1f} MiB, {grown / budget:.0%} of the budget")
    print(f"baseline (Python objects per key, same keys): {base_per:.1f} bytes a page, "
          f"{base / MiB:.1f} MiB, {base / budget:.0%} of the budget")
    print(f"ratio index / baseline: {per / base_per:.2f}")
    print(f"a Put of {BATCH} keys: {put_s * 1e3:.1f} ms; a Lookup of them: {lookup_s * 1e3:.1f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
