"""The cache's host memory: HostArena.reserve_high, slabs at the top of the arena, mixed page size
classes, make_room for client regions, and the budget shared with them."""

from __future__ import annotations

import pytest
from store_support import PAGE, K, MiB, make_cache, offsets_ok, one_part, put, stored

from kvserver.errors import NoCapacity
from kvserver.host.arena import HostArena


def test_reserve_high_carves_from_the_top():
    arena = HostArena(16 * MiB)
    assert arena.reserve_high(MiB) == 14 * MiB  # rounded up to the 2 MiB alignment
    assert arena.reserve_high(4 * MiB) == 10 * MiB
    low = arena.reserve(2 * MiB)
    assert low == 0 and arena.reserved == 8 * MiB
    arena.release(10 * MiB, 4 * MiB)  # a hole in the middle: [2, 14) is free
    assert arena.reserve_high(2 * MiB) == 12 * MiB
    arena.release(14 * MiB, 2 * MiB)
    assert arena.reserve_high(4 * MiB) == 8 * MiB  # [14, 16) is too small: the top of [2, 12)
    with pytest.raises(NoCapacity):
        arena.reserve_high(8 * MiB)
    assert arena.reserve_high(6 * MiB) == 2 * MiB
    assert arena.reserve_high(2 * MiB) == 14 * MiB
    assert arena.largest_free() == 0 and arena.reserved == arena.capacity
    arena.close()


def test_reserve_high_takes_the_highest_range_that_fits():
    arena = HostArena(16 * MiB)
    regions = [arena.reserve(2 * MiB) for _ in range(8)]
    arena.release(regions[1], 2 * MiB)  # free: [2, 4)
    arena.release(regions[4], 2 * MiB)
    arena.release(regions[5], 2 * MiB)  # free: [8, 12)
    arena.release(regions[7], 2 * MiB)  # free: [14, 16)
    assert arena.reserve_high(4 * MiB) == 8 * MiB  # [14, 16) is too small
    assert arena.reserve_high(2 * MiB) == 14 * MiB
    assert arena.reserve_high(2 * MiB) == 2 * MiB
    assert arena.largest_free() == 0 and arena.reserved == arena.capacity
    arena.close()


def test_slabs_gather_at_the_top_and_hooks_see_them():
    cache, arena, _ = make_cache()
    added, removed = [], []
    cache.on_slab_added.append(lambda off, n: added.append((off, n)))
    cache.on_slab_removed.append(lambda off, n: removed.append((off, n)))
    region = arena.reserve(2 * MiB)
    part = one_part(cache)
    put(cache, part, K("abc"))
    assert region == 0 and added == [(6 * MiB, 2 * MiB), (4 * MiB, 2 * MiB)]
    assert cache.bytes == 4 * MiB
    put(cache, part, K("d"), ok=False)
    assert removed == [] and cache.bytes == 4 * MiB  # d's page shares a slab with c: kept
    put(cache, part, K("defgh"))  # 2 MiB more, then the client region: evicts c, b
    assert cache.bytes + 2 * MiB <= arena.capacity and cache.bytes == 6 * MiB
    assert stored(cache, part, "abcdefghi") == "adefgh"


def test_make_room_frees_slabs_but_never_pinned_ones():
    cache, arena, _ = make_cache()
    removed = []
    cache.on_slab_removed.append(lambda off, n: removed.append(arena.largest_free()))
    part = one_part(cache)
    put(cache, part, K("abcdefgh"))  # slabs top down: ab, cd, ef, gh
    _, lease = cache.lookup(part, K("a"), pin_ms=1000)
    get = cache.prepare_get(part, K("c"))
    assert arena.largest_free() == 0
    assert cache.make_room(2 * MiB)
    assert stored(cache, part, "abcdefgh") == "abcdef"  # the least recent slab (gh) went first
    assert removed == [0]  # the hook ran before the slab went back
    # ab is pinned, cd is being read: no window of the arena can hold 6 MiB, so nothing goes
    # (ef could, for nothing).
    assert not cache.make_room(6 * MiB)
    assert stored(cache, part, "abcdefgh") == "abcdef" and arena.largest_free() == 2 * MiB
    cache.complete_get(get, True)
    cache.release("t", [lease])
    assert cache.make_room(8 * MiB) and cache.bytes == 0
    counters = cache.stats()[0][0].counters
    assert (counters.pages, counters.evictions) == (0, 8)


def test_make_room_skips_slabs_being_written():
    cache, arena, _ = make_cache(capacity=4 * MiB)
    part = one_part(cache)
    plan = cache.prepare_put(part, K("ab"))
    assert not cache.make_room(4 * MiB)
    cache.complete_put(plan, True)
    assert cache.make_room(4 * MiB)


def test_mixed_page_size_classes():
    cache, arena, _ = make_cache(capacity=12 * MiB)
    small = one_part(cache, page_bytes=PAGE)
    large = one_part(cache, "u", page_bytes=3 * MiB)  # one 4 MiB slab holds one large page
    plan = put(cache, large, K("AB"))
    assert offsets_ok(cache, plan.offsets, 3 * MiB) and cache.bytes == 8 * MiB
    plan = put(cache, small, K("abcd"))  # 4 MiB left: two slabs of small pages
    assert offsets_ok(cache, plan.offsets, PAGE) and cache.bytes == 12 * MiB
    put(cache, small, K("ef"))  # no room: evicts small pages of its class (d, c) first
    assert stored(cache, small, "abcdef") == "abef" and stored(cache, large, "AB") == "AB"
    _, lease = cache.lookup(small, K("abef"), pin_ms=1000)  # pinned: no small page can go
    plan = put(cache, small, K("ghij"))  # a whole large slab goes, the least recent (B)
    assert stored(cache, large, "AB") == "A"
    assert len(plan.positions) == 4 and offsets_ok(cache, plan.offsets, PAGE)
    assert stored(cache, small, "abefghij") == "abefghij"
    cache.release("t", [lease])
    cache.lookup(large, K("A"), pin_ms=1000)
    # a large page takes whole small slabs, least recent first, until a 4 MiB range is free
    put(cache, large, K("C"))
    assert stored(cache, small, "abefghij") == "ghij" and stored(cache, large, "AC") == "AC"
    assert cache.bytes == 12 * MiB == arena.reserved


def test_budget_is_never_exceeded():
    cache, arena, _ = make_cache(capacity=32 * MiB)
    regions = [arena.reserve(6 * MiB)]
    part = one_part(cache)
    for i in range(40):
        keys = [bytes([i, j]) for j in range(7)]
        put(cache, part, keys)
        assert cache.bytes + 6 * MiB * len(regions) <= arena.capacity
        assert arena.reserved == cache.bytes + 6 * MiB * len(regions)
        if i in (9, 19, 29):  # client regions fragment the arena: three fit
            assert cache.make_room(6 * MiB)
            regions.append(arena.reserve(6 * MiB))
    counters = cache.stats()[0][0].counters
    assert counters.bytes == counters.pages * PAGE <= cache.bytes


def test_the_bookkeeping_of_tiny_pages_is_charged_to_the_budget():
    """Every cached page costs the daemon BYTES_PER_PAGE of bookkeeping beside its bytes; past
    1/64 of the budget that is charged to it, so a cache of tiny pages holds fewer of them and
    the daemon's memory (slabs plus bookkeeping) stays within the budget."""
    import numpy as np

    from kvserver.host.arena import BOOK_ALLOWANCE
    from kvserver.store import Keys
    from kvserver.store.pages import BYTES_PER_PAGE

    cache, arena, _ = make_cache(capacity=32 * MiB)
    part = one_part(cache, page_bytes=64)
    n = 1 << 15
    for i in range(16):
        keys = Keys.unpack(np.arange(i * n, (i + 1) * n, dtype=np.uint64).repeat(2).tobytes(), 16, n)
        put(cache, part, keys)
        assert arena.booked == cache.pages.in_slabs * BYTES_PER_PAGE
        assert arena.reserved + arena.booked - arena.capacity // BOOK_ALLOWANCE <= arena.capacity
    assert cache.pages.in_slabs * (64 + BYTES_PER_PAGE) <= arena.capacity + arena.capacity // BOOK_ALLOWANCE
    assert part.pages > (arena.capacity // (64 + BYTES_PER_PAGE)) // 2  # and still a full cache
    cache.make_room(arena.capacity)
    assert arena.booked == 0 and arena.reserved == 0  # slabs gone, bookkeeping with them
