"""The cache index does no Python work per key: a lookup of 64k keys (as a request brings them,
packed) costs a small multiple of a bare dict map over the same keys, timed in the same run."""

from __future__ import annotations

import time
from itertools import repeat

import numpy as np
from store_support import MiB, make_cache, part_of, space_key

from kvserver.store import Keys

N = 1 << 16
RATIO = 12  # generous: a per-key Python loop costs ~30x a C-level map


def _best(fn, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_lookup_of_64k_keys_costs_about_a_dict_map():
    # tiny pages so that 64k of them fit in a small arena
    cache, _, _ = make_cache(capacity=128 * MiB)  # 2 MiB slabs of 8192 pages, and their bookkeeping
    space = cache.space(space_key(pp=3, layers=3))
    parts = [part_of(cache, space, pp_rank=r, page_bytes=256) for r in range(3)]
    listed = [i.to_bytes(16, "little") for i in range(N)]
    keys = Keys.unpack(b"".join(listed), 16, N)
    for part in parts:
        plan = cache.prepare_put(part, keys)
        assert len(plan.positions) == N
        cache.complete_put(plan, True)
    index = dict(zip(listed, range(N), strict=True))

    def baseline():
        np.fromiter(map(index.get, listed, repeat(-1)), np.int64, N)

    assert cache.lookup(parts[0], keys) == (N, "")
    assert cache.lookup(space, keys) == (N, "")
    base = _best(baseline)
    part_time = _best(lambda: cache.lookup(parts[0], keys))
    space_time = _best(lambda: cache.lookup(space, keys))
    assert part_time < RATIO * base, (part_time, base)
    assert space_time < 3 * RATIO * base, (space_time, base)
    print(f"64k keys: dict map {base * 1e3:.1f} ms, part {part_time * 1e3:.1f} ms, "
          f"space {space_time * 1e3:.1f} ms")
