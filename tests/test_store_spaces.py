"""Spaces, parts and tenants of the cache index: TP and PP parts, space-wide lookups, tenants kept
apart, quotas and stats."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import K, MiB, ids_of, make_cache, one_part, part_of, put, space_key, stored

from kvserver.errors import FailedPrecondition, InvalidArgument, NoCapacity
from kvserver.store import Keys, PartKey


def test_mla_tp4_ranks_share_one_part():
    cache, _, _ = make_cache()
    space = cache.space(space_key(mla=True, tp=4))
    parts = [part_of(cache, space, tp_shard=0) for _ in range(4)]  # every rank names shard 0
    assert all(p is parts[0] for p in parts) and len(space.parts) == 1
    plans = [cache.prepare_put(p, K("abc")) for p in parts]
    assert [len(p.positions) for p in plans] == [3, 0, 0, 0]
    for plan in plans:
        cache.complete_put(plan, True)
    assert cache.lookup(space, K("abc")) == (3, "")
    assert cache.stats()[0][0].counters.pages == 3
    with pytest.raises(InvalidArgument):
        part_of(cache, space, tp_shard=1)


def test_mha_tp2_two_parts_two_copies():
    cache, _, _ = make_cache()
    space = cache.space(space_key(tp=2))
    rank0, rank1 = part_of(cache, space, 0), part_of(cache, space, 1)
    put(cache, rank0, K("ab"))
    assert cache.lookup(space, K("ab")) == (0, "")  # rank 1 holds nothing yet
    assert cache.lookup(rank0, K("ab")) == (2, "")
    put(cache, rank1, K("ab"))
    assert cache.lookup(space, K("ab")) == (2, "")
    assert len(set(cache.pages.offset[ids_of(cache, rank0, "a") + ids_of(cache, rank1, "a")].tolist())) == 2
    stat = cache.stats()[0][0]
    assert (stat.counters.pages, stat.complete_pages, stat.parts_seen, stat.parts) == (4, 2, 2, 2)


def test_pp3_space_lookup_needs_every_stage():
    cache, _, _ = make_cache(capacity=16 * MiB)
    space = cache.space(space_key(pp=3, layers=6))
    stages = [part_of(cache, space, pp_rank=r) for r in range(3)]
    assert [(p.key.start_layer, p.key.end_layer) for p in stages] == [(0, 2), (2, 4), (4, 6)]
    put(cache, stages[0], K("abcd"))
    put(cache, stages[1], K("abc"))
    assert cache.lookup(space, K("abcd")) == (0, "")  # stage 2 holds nothing
    put(cache, stages[2], K("ab"))
    assert cache.lookup(space, K("abcd")) == (2, "")
    put(cache, stages[2], K("cd"))
    assert cache.lookup(space, K("abcd")) == (3, "")
    assert cache.stats()[0][0].complete_pages == 3
    # pins of a space lookup hold the pages of every stage
    n, lease = cache.lookup(space, K("abc"), pin_ms=1000)
    assert n == 3 and int(cache.pages.pins.sum()) == 9
    cache.release("t", [lease])
    # evicting stage 1's pages drops the space's answer
    cache.make_room(16 * MiB)  # evicts everything evictable
    put(cache, stages[0], K("abcd"))
    put(cache, stages[2], K("abcd"))
    assert cache.lookup(space, K("abcd")) == (0, "")
    assert cache.lookup(stages[0], K("abcd")) == (4, "")


def test_part_layer_range_is_fixed_by_its_first_registration():
    cache, _, _ = make_cache()
    space = cache.space(space_key(pp=2))
    part = cache.part(space, PartKey(0, 1, 2, 4, MiB))
    assert cache.part(space, PartKey(0, 1, 2, 4, MiB)) is part
    with pytest.raises(FailedPrecondition, match=r"\[2, 4\).*\[1, 4\)"):
        cache.part(space, PartKey(0, 1, 1, 4, MiB))
    with pytest.raises(FailedPrecondition):
        cache.part(space, PartKey(0, 1, 2, 4, 2 * MiB))
    for bad in (PartKey(0, 2, 0, 1, MiB), PartKey(0, 0, 0, 5, MiB), PartKey(0, 0, 0, 1, 0)):
        with pytest.raises(InvalidArgument):
            cache.part(space, bad)
    assert len(space.parts) == 1


def test_tenants_with_equal_keys_see_nothing_of_each_other():
    cache, _, _ = make_cache()
    alice, bob = one_part(cache, "alice"), one_part(cache, "bob")
    put(cache, alice, K("abc"))
    assert cache.lookup(bob, K("abc")) == (0, "")
    assert cache.prepare_get(bob, K("abc")).pages == 0
    plan = put(cache, bob, K("abc"))  # bob stores his own copy
    assert (len(plan.positions), plan.present) == (3, 0)
    _, lease = cache.lookup(alice, K("a"), pin_ms=1000)
    assert cache.release("bob", [lease]) == 0
    spaces, tenants = cache.stats("bob")
    assert [s.space.tenant for s in spaces] == ["bob"] and [t.tenant for t in tenants] == ["bob"]
    assert tenants[0].counters.misses == 6
    assert {t.tenant for t in cache.stats()[1]} == {"alice", "bob"}
    assert cache.stats("carol")[1][0].counters.pages == 0


def test_quota_evicts_the_tenants_own_pages():
    cache, _, _ = make_cache(capacity=16 * MiB, quotas={"small": 4 * MiB})
    small, big = one_part(cache, "small"), one_part(cache, "big")
    put(cache, big, K("abcd"))
    put(cache, small, K("abcd"))
    put(cache, small, K("efg"))  # over quota: evicts its own d, c, b, not big's
    assert stored(cache, small, "abcdefg") == "aefg"
    assert stored(cache, big, "abcd") == "abcd"
    plan = put(cache, small, K("hijklm"))  # at most four pages under the quota, the rest dropped
    assert (len(plan.positions), plan.dropped) == (4, 2)
    _, tenants = cache.stats()
    by = {t.tenant: t for t in tenants}
    assert by["small"].counters.bytes == 4 * MiB and by["small"].quota_bytes == 4 * MiB
    assert by["small"].counters.evictions == 3 + 4 and by["big"].counters.evictions == 0
    assert by["big"].quota_bytes == 0  # no default quota


def test_quota_counts_pages_being_written():
    cache, _, _ = make_cache(default_quota=2 * MiB)
    part = one_part(cache)
    first = cache.prepare_put(part, K("ab"))
    second = cache.prepare_put(part, K("cd"))  # the first's pages are being written: not evicted
    assert (len(second.positions), second.dropped) == (0, 2)
    cache.complete_put(first, True)
    assert cache.stats("t")[1][0].quota_bytes == 2 * MiB


def test_quota_of_the_whole_arena_is_none():
    cache, _, _ = make_cache(default_quota=1 << 40)
    assert cache.stats("x")[1][0].quota_bytes == 0


def test_spaces_per_tenant_limit_drops_empty_spaces():
    cache, _, _ = make_cache(max_spaces_per_tenant=2)
    full = cache.space(space_key(model="full"))
    put(cache, part_of(cache, full), K("a"))
    empty = cache.space(space_key(model="empty"))
    third = cache.space(space_key(model="third"))  # the empty one makes way
    assert cache.find_space(empty.key) is None and cache.find_space(third.key) is third
    put(cache, part_of(cache, third), K("a"))
    with pytest.raises(NoCapacity):
        cache.space(space_key(model="fourth"))
    assert cache.space(space_key("other", model="fourth"))  # another tenant's count is its own
    assert cache.space(full.key) is full


def test_a_part_held_across_its_space_being_dropped_keeps_working():
    cache, _, _ = make_cache(max_spaces_per_tenant=1)
    held = part_of(cache, cache.space(space_key(model="held")))
    cache.space(space_key(model="next"))  # drops the empty "held" space
    assert cache.find_space(held.space.key) is None
    put(cache, held, K("ab"))  # brings its space back, the same object
    assert cache.find_space(held.space.key) is held.space
    assert cache.lookup(held.space, K("ab")) == (2, "")


def test_a_space_lease_is_ended_rank_by_rank():
    """A scheduler pins a prefix for every rank; each rank's Get unpins its own part only, so a
    rank that reads later still finds its pages pinned."""
    cache, _, _ = make_cache()
    space = cache.space(space_key(tp=2))
    rank0, rank1 = part_of(cache, space, 0), part_of(cache, space, 1)
    put(cache, rank0, K("ab"))
    put(cache, rank1, K("ab"))
    n, lease = cache.lookup(space, K("abab"), pin_ms=5000)  # a repeated key is pinned once
    assert n == 4 and lease
    assert cache.pages.pins.sum() == 4  # a and b in both parts
    got = cache.prepare_get(rank0, K("ab"), lease)
    cache.complete_get(got, True)
    ids1 = ids_of(cache, rank1, "ab")
    assert cache.pages.pins[ids1].tolist() == [1, 1]  # rank 1 keeps its pins
    assert cache.pages.pins[ids_of(cache, rank0, "ab")].tolist() == [0, 0]
    assert cache.make_room(7 * MiB) is False  # rank 1's pinned slab stays
    assert cache.lookup(rank1, K("ab")) == (2, "")
    got = cache.prepare_get(rank1, K("ab"), lease)
    cache.complete_get(got, True)
    assert cache.pages.pins.sum() == 0 and cache.release("t", [lease]) == 0  # the lease has ended


def test_pinned_pages_per_tenant_are_bounded():
    cache, _, _ = make_cache()
    cache.leases.max_pinned_per_tenant = 3
    part = one_part(cache)
    put(cache, part, K("abcd"))
    n, lease = cache.lookup(part, K("ab"), pin_ms=1000)
    assert n == 2 and lease
    with pytest.raises(NoCapacity, match="pins 2 pages"):
        cache.lookup(part, K("abc"), pin_ms=1000)
    assert cache.pages.pins.sum() == 2  # the refused pin changed nothing
    assert cache.lookup(part, K("c"), pin_ms=1000)[0] == 1


def test_complete_pages_are_counted_as_pages_come_and_go():
    """The count Stats shows, kept up as parts commit and lose keys, equals a recount."""
    import random

    from kvserver.store.complete import CompleteCount, PartCounts
    from kvserver.store.keys import Keys

    rng = random.Random(7)
    counts = PartCounts()
    other = CompleteCount(3, counts)  # another space's counts in the same table stay apart
    other.added(Keys.of([bytes([k]) for k in range(40)]))
    count = CompleteCount(3, counts)
    held: list[set[bytes]] = [set(), set(), set()]
    for _ in range(300):
        part = rng.randrange(3)
        keys = {bytes([rng.randrange(40)]) for _ in range(rng.randrange(1, 8))}
        if rng.random() < 0.6:
            new = sorted(keys - held[part])
            count.added(Keys.of(new))
            held[part] |= set(new)
        else:
            old = sorted(keys & held[part])
            count.removed(Keys.of(old))
            held[part] -= set(old)
        assert count.value == len(held[0] & held[1] & held[2])
    assert counts.index.count == 40 + len(held[0] | held[1] | held[2])  # a key no part holds is gone


def test_a_whole_space_lookup_examines_a_bounded_number_of_pairs(monkeypatch):
    """A whole-space Lookup looks at keys in every part: of a space of many parts it examines at
    most MAX_LOOKUP_PAIRS // parts keys, so its work on the loop does not grow with parts x keys.
    A shorter hit is a correct answer; misses still count every key asked."""
    import kvserver.store.cache as cache_module

    monkeypatch.setattr(cache_module, "MAX_LOOKUP_PAIRS", 16)
    cache, _, _ = make_cache(capacity=16 * MiB)
    space = cache.space(space_key(tp=2))
    parts = [part_of(cache, space, r, page_bytes=MiB // 8) for r in range(2)]
    for part in parts:
        put(cache, part, K("abcdefghijkl"))
    assert cache.lookup(space, K("abcdefghijkl")) == (8, "")  # 16 // 2 parts: the first 8 keys
    assert cache.lookup(parts[0], K("abcdefghijkl")) == (12, "")  # one part: every key
    n, lease = cache.lookup(space, K("abcdefghijkl"), pin_ms=1000)
    assert n == 8 and int(cache.pages.pins.sum()) == 16  # 8 pages in each part pinned once
    counters = cache.stats()[0][0].counters
    assert (counters.hits, counters.misses) == (8 + 12 + 8, 4 + 0 + 4)


def test_a_pinned_lookup_of_distinct_keys_needs_no_dedup(monkeypatch):
    """Distinct keys name distinct pages: pinning them skips the sort that deduplicating costs
    (most of a second at a million pins); repeated keys still pin each page once."""
    import kvserver.store.leases as leases_module

    calls = []

    class CountingNumpy:  # the leases module's numpy, with its np.unique calls counted
        def __getattr__(self, name):
            return getattr(np, name)

        def unique(self, a, *args, **kwargs):
            calls.append(1)
            return np.unique(a, *args, **kwargs)

    monkeypatch.setattr(leases_module, "np", CountingNumpy())
    cache, _, _ = make_cache()
    part = one_part(cache, page_bytes=MiB // 8)
    put(cache, part, K("abcd"))
    n, _ = cache.lookup(part, K("abcd"), pin_ms=1000)
    assert n == 4 and calls == [] and int(cache.pages.pins.sum()) == 4
    n, _ = cache.lookup(part, K("abab"), pin_ms=1000)
    assert n == 4 and calls == [1] and int(cache.pages.pins.sum()) == 6  # a and b once more


def test_a_tenant_pinning_one_page_per_size_class_is_charged_its_slabs():
    """A quota counts what a tenant holds: its slabs whole, not the bytes of its pages. A tenant
    storing one tiny page in each of many size classes and pinning them holds a slab per class;
    charged for them, it stops at its quota, and its pins keep no other tenant's memory from use."""
    cache, arena, _ = make_cache(capacity=16 * MiB, quotas={"hostile": 4 * MiB})
    victim = one_part(cache, "victim")
    put(cache, victim, K("abcdefgh"))  # 4 slabs of 2 MiB
    space = cache.space(space_key("hostile"))
    for i in range(8):  # 8 size classes, one 64-byte page in each, pinned
        part = cache.part(space, PartKey(0, 0, 0, 4, 64 + i)) if i == 0 else cache.part(
            cache.space(space_key("hostile", model=f"m{i}")), PartKey(0, 0, 0, 4, 64 + i))
        put(cache, part, K("z"))
        cache.lookup(part, K("z"), pin_ms=60_000)
    assert cache.slabs.held(cache.tenants.get("hostile").tid) <= 4 * MiB
    assert stored(cache, victim, "abcdefgh") == "abcdefgh"  # the victim lost nothing
    assert len(put(cache, victim, K("ijkl")).positions) == 4  # and stores into what is left
    assert cache.make_room(4 * MiB) and arena.largest_free() >= 4 * MiB  # evicting the victim's own


def test_a_tenants_pins_count_in_its_quota_and_evict_no_other_tenants_pages():
    """A tenant held to a quota pinned its few pages again and again: each pin's bookkeeping was
    booked against the whole arena only, and past the arena's free allowance the cache evicted
    anyone's least recently used slabs for it, another tenant's first (here 11 of the other's 60
    pages). Its pins now count in what it holds, as its pages' bookkeeping does: past
    its quota they evict its own slabs only, and with none to evict they are refused."""
    cache, arena, _ = make_cache(capacity=64 * MiB, quotas={"small": 2 * MiB})
    big = one_part(cache, "big")  # 1 MiB pages, no quota
    small = one_part(cache, "small", page_bytes=4096)  # 512 pages fill its quota
    big_keys = [f"b{i}".encode() for i in range(61)]
    put(cache, big, big_keys)
    small_keys = [f"s{i}".encode() for i in range(512)]
    put(cache, small, small_keys)  # (the arena full: big's least recently used page goes)
    big_left = int((cache.pages.find(big.gid, Keys.of(big_keys)) >= 0).sum())
    small_tid = cache.tenants.get("small").tid
    small_held = cache.slabs.held(small_tid)
    refused = None
    for _ in range(4000):
        try:
            cache.lookup(small, small_keys, pin_ms=60_000)
        except NoCapacity as exc:
            refused = str(exc)
            break
    assert refused is not None and "bookkeeping" in refused and "small" in refused, refused
    # Within its quota a pin's bookkeeping takes the arena's least recently used memory, as a Put's
    # page would: here what the quota leaves the tenant, less than one of big's slabs.
    left = int((cache.pages.find(big.gid, Keys.of(big_keys)) >= 0).sum())
    assert big_left >= 60 and big_left - left <= 1, (big_left, left)
    assert cache.slabs.held(small_tid, 2 * MiB) <= 2 * MiB
    assert cache.slabs.held(small_tid) > small_held  # its pins, charged
    for lease_id in list(cache.leases.leases):  # every pin given back: its charge too
        cache.release("small", [lease_id])
    assert cache.slabs.held(small_tid) == small_held
    assert int(cache.pages.pins.sum()) == 0


def test_pins_are_charged_to_the_budget():
    """A pin's bookkeeping (its place in its lease's arrays) is booked against the arena while it
    lasts. In a full cache a pin evicts the least recently used slab that holds none of the pages it
    pins; with nothing left to evict it is refused and changes nothing."""
    from kvserver.host.arena import BOOK_ALLOWANCE
    from kvserver.store.leases import PIN_BYTES

    def fill_bookings() -> bool:  # books all the budget has left
        return arena.book(arena.capacity - arena.reserved + arena.capacity // BOOK_ALLOWANCE - arena.booked)

    cache, arena, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("cd"))
    put(cache, part, K("ab"))  # two slabs: c, d's is the least recently used
    before = arena.booked
    n, lease = cache.lookup(part, K("ab"), pin_ms=1000)
    assert n == 2 and arena.booked == before + 2 * PIN_BYTES
    assert cache.release("t", [lease]) == 1 and arena.booked == before
    assert fill_bookings()  # nothing left
    n, lease = cache.lookup(part, K("ab"), pin_ms=1000)  # evicts c, d's slab for the pins' bookkeeping
    assert n == 2 and stored(cache, part, "abcd") == "ab"
    assert fill_bookings()
    with pytest.raises(NoCapacity, match="bookkeeping"):
        cache.lookup(part, K("ab"), pin_ms=1000)  # only a, b's own slab is left: nothing to evict
    assert int(cache.pages.pins.sum()) == 2 and stored(cache, part, "ab") == "ab"


def test_a_large_put_into_a_space_of_several_parts_splits_its_counts_buckets_ahead(monkeypatch):
    """The counts of a space of several parts file a Put's new keys all at once. They were linked
    into the buckets there were, then split: chains of hundreds of entries walked split by split,
    1.7-2.0 s of the event loop for a Put of 1 Mi pages. The buckets are split first now, so each
    key is linked into a chain of about ``LOAD`` entries."""
    from kvserver.store.complete import CompleteCount, PartCounts
    from kvserver.store.index import LOAD
    from kvserver.store.keys import Keys

    n = 1 << 16
    count = CompleteCount(4, PartCounts(n))
    index, seen = count.counts.index, []

    def linking() -> None:
        seen.append((index.count, LOAD * index.buckets))

    if index._c is not None:
        class Linker:  # the compiled walk, told when it links
            def __getattr__(self, name):
                return getattr(real, name)

            def link(self, *args):
                linking()
                return real.link(*args)

        real = index._c
        monkeypatch.setattr(index, "_c", Linker())
    else:
        real_link = index._link
        monkeypatch.setattr(index, "_link", lambda *a: (linking(), real_link(*a))[1])
    count.added(Keys.unpack(np.arange(n, dtype=np.uint64).repeat(2).tobytes(), 16, n))
    assert seen and all(entries <= room for entries, room in seen), seen
    assert count.value == 0 and index.count == n


def test_a_put_beyond_its_quota_evicts_only_what_its_quota_can_take_from_other_tenants():
    """A tenant whose Put wants more pages than its quota holds, in an arena full of another
    tenant's pages, evicts the slabs its quota can still take, not the other tenant's whole cache."""
    cache, arena, _ = make_cache(capacity=20 * MiB, quotas={"small": 4 * MiB})  # 2 slabs of 2 pages
    big = one_part(cache, "big")
    put(cache, big, [b"b%d" % i for i in range(20)])  # the arena full: 10 slabs of big's
    assert big.pages == 20
    small = one_part(cache, "small")
    plan = put(cache, small, [b"s%d" % i for i in range(8)])  # wants 4 slabs, its quota holds 2
    assert (len(plan.positions), plan.dropped) == (4, 4)
    assert big.pages == 16 and big.space.counters.evictions == 4
    assert arena.available < 2 * MiB  # no slab's worth of memory left empty
