"""What one cache call touches: its own keys, a bounded window of a size class and the slabs' own
counts, never every page of the table. The page table's arrays are watched: any array operation
over them records how many elements it went over; a Put that evicts must stay far below the table.

Also: the per-slab counts of what keeps pages (pins, readers, pages being written) always equal
what the pages say, and a removed key leaves its neighbours in its chain (the index against a dict
through inserts, removals and splits: test_store_index.py)."""

from __future__ import annotations

import random

import numpy as np
from store_support import K, MiB, make_cache, one_part, part_of, put, space_key

from kvserver.store import Keys
from kvserver.store.eviction import RANK_WINDOW
from kvserver.store.index import KeyIndex
from kvserver.store.pages import _ARRAYS, WRITING
from kvserver.store.slabs import MAX_SLAB_PAGES

TINY = 64  # bytes a page: the most pages a budget can hold


class Watched(np.ndarray):
    """An array that records the largest operand of any ufunc over it (``np.add.at`` counts the
    indices it is given, not the array it adds into)."""

    widest = 0

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if method == "at":
            Watched._saw(np.size(inputs[1]))
        else:
            for x in inputs:
                if isinstance(x, Watched):
                    Watched._saw(x.size)
        args = [np.asarray(x) if isinstance(x, Watched) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, Watched) else o for o in out)
        return getattr(ufunc, method)(*args, **kwargs)

    @classmethod
    def _saw(cls, n: int) -> None:
        cls.widest = max(cls.widest, int(n))


def watched_cache(capacity: int):
    cache, arena, clock = make_cache(capacity, slab_bytes=8 * MiB)
    for name in _ARRAYS:
        setattr(cache.pages, name, getattr(cache.pages, name).view(Watched))
    return cache


def fill(cache, part, n: int, salt: int) -> None:
    for start in range(0, n, 1 << 16):
        names = range(start, min(n, start + (1 << 16)))
        put(cache, part, [(salt << 40 | i).to_bytes(16, "little") for i in names])


BOUND = RANK_WINDOW + 2 * MAX_SLAB_PAGES  # a window of the class, plus a slab


def test_a_put_that_evicts_its_own_class_ranks_a_window_not_the_class():
    cache = watched_cache(128 * MiB)
    part = one_part(cache, page_bytes=TINY)
    fill(cache, part, cache.pages.size, salt=1)  # more keys than the budget holds: the class is full
    held = cache.stats()[0][0].counters.pages
    assert held > 2 * BOUND and cache.pages.size > 2 * BOUND  # so that a pass over either shows
    Watched.widest = 0
    fill(cache, part, held, salt=2)  # as many new keys: every one evicts, the class ranked again and again
    counters = cache.stats()[0][0].counters
    assert counters.pages == held and counters.evictions >= 2 * held - cache.pages.size
    assert Watched.widest <= BOUND, f"went over {Watched.widest} pages of a {cache.pages.size}-page table"


def test_a_put_that_evicts_other_classes_passes_over_slabs_not_pages():
    cache = watched_cache(128 * MiB)
    tiny = one_part(cache, page_bytes=TINY)
    fill(cache, tiny, cache.pages.size, salt=1)
    assert cache.pages.in_slabs > 2 * BOUND
    other = part_of(cache, cache.space(space_key(model="other")), page_bytes=16 << 10)
    tiny_pages = cache.stats()[0][0].counters.pages
    Watched.widest = 0
    plan = put(cache, other, [(3 << 40 | i).to_bytes(16, "little") for i in range(4096)])
    assert len(plan.positions) == 4096  # 64 MiB: it took slabs of the tiny class
    assert cache.stats()[0][0].counters.pages < tiny_pages - 4 * MAX_SLAB_PAGES  # whole slabs of it
    assert Watched.widest <= BOUND, f"went over {Watched.widest} pages of a {cache.pages.size}-page table"


def test_no_slab_holds_more_than_the_most_pages():
    cache, _, _ = make_cache(64 * MiB, slab_bytes=8 * MiB)
    part = one_part(cache, page_bytes=TINY)
    put(cache, part, [b"k%d" % i for i in range(1000)])
    assert {len(s.pages) for s in cache.slabs.slabs.values()} == {MAX_SLAB_PAGES}


def holds_by_pages(cache) -> dict[int, int]:
    p = cache.pages
    out = {}
    for sid, slab in cache.slabs.slabs.items():
        ids = slab.pages
        out[sid] = int(p.pins[ids].sum() + p.readers[ids].sum() + (p.state[ids] == WRITING).sum())
    return out


def test_the_slabs_counts_of_what_holds_their_pages_match_the_pages():
    """Pins, reads and writes are counted per slab as they happen (eviction reads only those
    counts): after any mix of calls, each slab's count is what its pages say."""
    rng = random.Random(7)
    cache, _, clock = make_cache(16 * MiB)
    parts = [one_part(cache, tenant, page_bytes=b) for tenant, b in (("a", MiB // 8), ("b", MiB // 4))]
    open_gets, open_puts = [], []
    for _ in range(400):
        part = rng.choice(parts)
        names = [b"%d" % rng.randrange(200) for _ in range(rng.randrange(1, 24))]
        op = rng.randrange(6)
        if op == 0:
            open_puts.append(cache.prepare_put(part, names))
        elif op == 1 and open_puts:
            cache.complete_put(open_puts.pop(rng.randrange(len(open_puts))), rng.random() < 0.8)
        elif op == 2:
            cache.lookup(part, names, pin_ms=rng.choice([0, 1000]))
        elif op == 3:
            open_gets.append(cache.prepare_get(part, names))
        elif op == 4 and open_gets:
            cache.complete_get(open_gets.pop(rng.randrange(len(open_gets))), True)
        else:
            clock.now += rng.choice([0, 2])
            cache.expire_leases()
        holds = cache.pages.slab_holds
        assert {s: int(holds[s]) for s in cache.slabs.slabs} == holds_by_pages(cache)
    for plan in open_puts:
        cache.complete_put(plan, True)
    for plan in open_gets:
        cache.complete_get(plan, True)
    clock.now += 100
    cache.expire_leases()
    assert all(cache.pages.slab_holds[s] == 0 for s in cache.slabs.slabs)


def test_a_removed_key_leaves_its_neighbours_in_the_chain():
    index = KeyIndex(64)
    keys = K("abcdefghijklmnopqrstuvwxyz")
    index.insert(np.arange(26), 0, Keys.of(keys))
    index.remove(np.arange(0, 26, 3))
    got = index.find(0, Keys.of(keys)).tolist()
    assert got == [-1 if i % 3 == 0 else i for i in range(26)]


def test_a_key_repeated_across_a_lookups_steps_is_pinned_and_unpinned_alike(monkeypatch):
    """A lease's steps may pin one page twice (a key named in two steps): its release takes both
    pins off, and the slab's count agrees with its pages throughout."""
    import kvserver.store.cache as cache_module

    monkeypatch.setattr(cache_module, "STEP_KEYS", 4)
    cache, _, _ = make_cache(16 * MiB)
    part = one_part(cache, page_bytes=MiB // 8)
    put(cache, part, K("abcd"))
    found, lease = cache.lookup(part, K("abcdabcd"), pin_ms=1000)
    assert found == 8 and lease
    assert int(cache.pages.pins.sum()) == 8
    assert {s: int(cache.pages.slab_holds[s]) for s in cache.slabs.slabs} == holds_by_pages(cache)
    assert cache.release("t", [lease]) == 1
    assert int(cache.pages.pins.sum()) == 0
    assert all(cache.pages.slab_holds[s] == 0 for s in cache.slabs.slabs)
