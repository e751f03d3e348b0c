"""Bookkeeping costs of the cache index (no copying): lookup of 1k and 64k keys in one part and in
a space of 3 PP parts (and, for 1k keys, as the compiled walk from packed keys a Lookup without a
lease takes: ``KVCache.lookup_packed``), and prepare/complete of Put and Get per page, each
against a bare dict lookup of the same keys measured in the same run (the ratio says how close to
C speed it stays).
The index is given the keys as a request brings them (packed, unpacked once outside the timing),
the dict a list of the same keys.
Run: python benchmarks/bench_store.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import time
from itertools import repeat

import numpy as np

from kvserver.host.arena import HostArena
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys, KVCache, PartKey, SpaceKey
from kvserver.store.steps import STEP_KEYS

PAGE_BYTES = 256


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n_max = 1 << 16
    arena = HostArena(3 * n_max * PAGE_BYTES + (32 << 20))
    cache = KVCache(arena)
    key = SpaceKey("bench", "m", KVLayout.mha(2, 4), dtype_named("float16"), 16, 3, 1, 3)
    space = cache.space(key)
    parts = [cache.part(space, PartKey(0, r, r, r + 1, PAGE_BYTES)) for r in range(3)]
    listed = [i.to_bytes(16, "little") for i in range(n_max)]
    packed = b"".join(listed)
    for part in parts:
        cache.complete_put(cache.prepare_put(part, Keys.unpack(packed, 16, n_max)), True)
    index = dict(zip(listed, range(n_max), strict=True))

    print(f"{'operation':<34}{'keys':>7}{'time':>11}{'per key':>10}{'dict':>11}{'ratio':>7}")
    for n in (1 << 10, n_max):
        ls = listed[:n]
        base = best(lambda ls=ls: np.fromiter(map(index.get, ls, repeat(-1)), np.int64, len(ls)), args.rounds)
        ks = Keys.unpack(packed[: 16 * n], 16, n)
        fresh = Keys.unpack(b"".join((i + (1 << 40)).to_bytes(16, "little") for i in range(n)), 16, n)

        def put_cycle(fresh=fresh):
            plan = cache.prepare_put(parts[0], fresh)
            cache.complete_put(plan, False)  # frees them again: every round stores n new pages

        def get_cycle(ks=ks):
            cache.complete_get(cache.prepare_get(parts[0], ks), True)

        rows = {
            "lookup (part)": lambda ks=ks: cache.lookup(parts[0], ks),
            "lookup (3-part space)": lambda ks=ks: cache.lookup(space, ks),
            "lookup (3-part space, pinned)": lambda ks=ks: cache.release(
                "bench", [cache.lookup(space, ks, pin_ms=1000)[1]]),
            "prepare+complete put (new pages)": put_cycle,
            "prepare+complete put (present)": lambda ks=ks: cache.complete_put(
                cache.prepare_put(parts[0], ks), True),
            "prepare+complete get": get_cycle,
        }
        if n <= STEP_KEYS:  # one compiled walk a part from the packed keys (a Lookup with no lease)
            raw = packed[: 16 * n]
            rows["lookup (part), packed walk"] = lambda raw=raw: cache.lookup_packed(parts[0], raw, 16)
            rows["lookup (3-part space), packed walk"] = lambda raw=raw: cache.lookup_packed(space, raw, 16)
        for name, fn in rows.items():
            t = best(fn, args.rounds)
            print(f"{name:<34}{n:>7}{t * 1e3:>9.3f}ms{t / n * 1e9:>8.0f}ns"
                  f"{base * 1e3:>9.3f}ms{t / base:>7.1f}")
    arena.close()


if __name__ == "__main__":
    main()
