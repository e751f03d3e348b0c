"""The cache index driven directly: fill, touch, evict; dedup; failed puts; pins by Gets and
leases. Arena of 8 MiB in 2 MiB slabs of two 1 MiB pages: the cache holds eight pages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import store_support as ss
from store_support import PAGE, K, MiB, make_cache, offsets_ok, one_part, part_of, put, space_key, stored

from kvserver.errors import InvalidArgument, NoCapacity
from kvserver.store import MAX_PIN_MS, Keys
from kvserver.store.pages import WRITING
from kvserver.store.steps import run_steps


def _same(a: Keys, b: Keys) -> bool:
    return np.array_equal(a.words, b.words) and np.array_equal(a.lens, b.lens)


def test_keys_unpack():
    assert _same(Keys.unpack(b"aabbcc", 2, 3), Keys.of([b"aa", b"bb", b"cc"]))
    zeros = Keys.unpack(b"a\x00\x00\x00", 2, 2)
    assert _same(zeros, Keys.of([b"a\x00", b"\x00\x00"]))  # trailing zeros kept
    assert not _same(zeros[:1], Keys.of([b"a"]))  # a key and its zero-padded form differ
    assert len(Keys.unpack(b"", 16, 1)) == 0
    wide = bytes(range(40)) + bytes(range(1, 41))  # wider than 32 bytes: kept as digests
    assert _same(Keys.unpack(wide, 40, 2), Keys.of([wide[:40], wide[40:]]))
    assert Keys.unpack(wide, 40, 2).distinct() and not Keys.unpack(wide[:40] * 2, 40, 2).distinct()
    assert Keys.unpack(b"abcabd", 2, 3).firsts().tolist() == [0, 1, 2]
    assert Keys.unpack(b"abab", 2, 2).firsts().tolist() == [0]
    for packed, width in ((b"abc", 2), (b"ab", 0), (b"a" * 65, 65)):
        with pytest.raises(InvalidArgument):
            Keys.unpack(packed, width, 100)
    with pytest.raises(NoCapacity):
        Keys.unpack(b"abcd", 1, 3)


@pytest.mark.parametrize("n", [0, 1, 2, 8, 64, 65, 300])
def test_keys_firsts_and_ranks_as_a_dict_says_with_and_without_repeats(n):
    """Either way ``firsts`` answers (a set's check for a few keys, a sort for more, and the sort
    after a few keys that repeat): first positions ascending, and each key's rank among them."""
    rng = np.random.default_rng(n)
    for repeats in (False, True):
        pool = [rng.bytes(int(w)) for w in rng.choice([1, 8, 16, 17, 32, 48], size=max(1, n))]
        # Keys of 17 to 32 bytes that share their first 16 (they differ only in words the sort
        # must not skip), and keys of one width past 32 bytes beside short ones.
        stem = rng.bytes(16)
        pool = [stem + bytes(8) + i.to_bytes(8, "little") for i in range(max(1, n // 4))] + pool
        rng.shuffle(pool)
        names = [pool[int(i)] for i in rng.integers(0, max(1, n // 3), n)] if repeats else pool[:n]
        if not repeats:
            names = list(dict.fromkeys(names))  # distinct, whatever the draw
        first: dict[bytes, int] = {}
        for i, k in enumerate(names):
            first.setdefault(k, i)
        want = sorted(first.values())
        firsts, rank = Keys.of(names).firsts(ranks=True)
        assert firsts.tolist() == want and firsts.dtype == np.int64
        assert rank.tolist() == [want.index(first[k]) for k in names]
        assert Keys.of(names).firsts().tolist() == want


def test_fill_touch_evict_lru():
    cache, _, _ = make_cache()
    part = one_part(cache)
    plan = put(cache, part, K("abcdefgh"))
    assert (plan.positions.tolist(), plan.present, plan.dropped) == (list(range(8)), 0, 0)
    assert offsets_ok(cache, plan.offsets, PAGE) and len(set(plan.offsets.tolist())) == 8
    # put [a..h]: a is the most recent, h the least. Touch [e, f]: they become the most recent.
    assert cache.lookup(part, K("ef")) == (2, "")
    # put [i, j] -> evicts h and g (the least recently used), then d and c for [k, l]
    put(cache, part, K("ij"))
    assert stored(cache, part, "abcdefgh") == "abcdef"
    put(cache, part, K("kl"))
    assert stored(cache, part, "abcdefghijkl") == "abefijkl"
    assert cache.lookup(part, K("abc")) == (2, "")
    space, tenant = cache.stats()
    assert (space[0].counters.evictions, space[0].counters.pages) == (4, 8)
    assert (space[0].counters.hits, space[0].counters.misses) == (4, 1)
    assert tenant[0].counters.evictions == 4


def test_prefix_loses_its_end_first():
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("abcd"))  # one prefix
    put(cache, part, K("wxyz"))  # another, more recent
    assert cache.lookup(part, K("abcd")) == (4, "")  # now abcd is the more recent prefix
    put(cache, part, K("pq"))  # evicts the end of the older prefix first
    assert stored(cache, part, "abcdwxyz") == "abcdwx"
    put(cache, part, K("rs"))
    assert stored(cache, part, "abcdwxyz") == "abcd"
    # the remaining lookups still find whole prefixes, never a hole in the middle
    assert cache.lookup(part, K("abcd")) == (4, "")
    put(cache, part, K("tuvwxy"))  # takes the four older pages p, q, r, s, then d and c
    assert stored(cache, part, "abcdpqrs") == "ab"  # the prefix lost its end first


def test_dedup_and_racing_puts_store_once():
    cache, _, _ = make_cache()
    part = one_part(cache)
    first = cache.prepare_put(part, K("abc"))
    second = cache.prepare_put(part, K("bcd"))  # b, c being written by the first: waited for
    assert (second.positions.tolist(), second.present, second.waiting.tolist()) == ([2], 0, [0, 1])
    assert cache.lookup(part, K("abcd")) == (0, "")  # nothing visible while being written
    cache.complete_put(second, True)
    cache.complete_put(first, True)
    assert cache.lookup(part, K("abcd")) == (4, "")
    again = put(cache, part, K("abcd"))
    assert (len(again.positions), again.present) == (0, 4)
    repeats = put(cache, part, K("eefe"))  # repeats in one request: the first counts
    assert (repeats.positions.tolist(), repeats.present) == ([0, 2], 2)
    counters = cache.stats()[0][0].counters
    assert (counters.pages, counters.dedup_pages, counters.dedup_bytes) == (6, 6, 6 * PAGE)


def test_failed_put_frees_its_pages():
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("ab"))
    held = cache.bytes
    plan = put(cache, part, K("cdef"), ok=False)
    assert len(plan.positions) == 4
    assert cache.lookup(part, K("abcdef")) == (2, "")
    assert stored(cache, part, "cdef") == "" and part.pages == 2
    assert cache.bytes == held  # the slabs it took were released, being empty
    counters = cache.stats()[0][0].counters
    assert (counters.pages, counters.bytes, counters.evictions) == (2, 2 * PAGE, 0)
    assert len(put(cache, part, K("cdef")).positions) == 4  # and can be stored again


def test_pages_being_written_or_read_are_never_evicted():
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("abcd"))
    get = cache.prepare_get(part, K("abx"))
    assert (get.pages, len(get.offsets)) == (2, 2)
    writing = cache.prepare_put(part, K("efgh"))  # fills the cache
    plan = put(cache, part, K("ijklmn"))  # may evict only c and d: two of six stored
    assert (len(plan.positions), plan.dropped, plan.present) == (2, 4, 0)
    assert stored(cache, part, "abcd") == "ab"
    cache.complete_put(writing, True)
    cache.complete_get(get, True)
    assert stored(cache, part, "abefghij") == "abefghij"
    # with the Get done, a and b are evictable again (LRU among them: after the newer pages)
    put(cache, part, K("opqrstuv"))
    assert stored(cache, part, "ab") == ""


def test_dropped_keys_are_the_last_ones():
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("ab"))
    _, lease = cache.lookup(part, K("ab"), pin_ms=1000)
    plan = put(cache, part, K("cdefghijkk"))  # 6 free pages for 8 new keys; k repeated
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert (plan.present, plan.dropped) == (0, 4)  # i, j, k, k
    assert cache.stats()[1][0].counters.dropped == 4
    assert cache.release("t", [lease]) == 1


def test_leases_pin_until_released_or_expired():
    cache, _, clock = make_cache()
    part = one_part(cache)
    put(cache, part, K("abcdefgh"))
    n, lease = cache.lookup(part, K("fgh"), pin_ms=5000)
    assert n == 3 and len(lease) == 32
    put(cache, part, K("ijklmn"))  # evicts the unpinned least recent ones: e, d, c, b, a, ... not f, g, h
    assert stored(cache, part, "abcdefgh") == "fgh"
    assert cache.release("other", [lease]) == 0  # only its tenant ends it
    clock.now += 4.9
    assert cache.expire_leases() == 0
    clock.now += 0.2
    assert cache.expire_leases() == 1
    assert cache.release("t", [lease]) == 0  # already ended
    put(cache, part, K("opq"))
    assert stored(cache, part, "fgh") == ""
    # a lease released explicitly
    n, lease = cache.lookup(part, K("opq"), pin_ms=MAX_PIN_MS)
    assert cache.release("t", [lease, lease, "nonsense"]) == 1
    assert int(cache.pages.pins.sum()) == 0
    assert cache.lookup(part, K("zz"), pin_ms=100) == (0, "")  # nothing counted: no lease
    for bad in (-1, MAX_PIN_MS + 1):
        with pytest.raises(InvalidArgument):
            cache.lookup(part, K("o"), pin_ms=bad)


def test_a_registrations_leases_end_with_it_and_no_others():
    from kvserver.store.cache import run_steps

    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("abcd"))

    def pin(keys: str, owner: str) -> str:
        return run_steps(cache.lookup_steps(part, K(keys), 5000, owner=owner)).lease_id

    mine = [pin("ab", "engine-1"), pin("c", "engine-1")]
    other, space = pin("d", "engine-2"), pin("a", "")  # another registration's; a space's (no owner)
    assert cache.release_owned("engine-1") == 2 and cache.release_owned("engine-1") == 0
    assert cache.release("t", mine) == 0  # ended already
    assert int(cache.pages.pins.sum()) == 2  # d's and a's
    assert cache.release("t", [other, space]) == 2 and cache.release_owned("engine-2") == 0
    # Released while its Lookup pins in steps: the Lookup ends NotFound, pinning nothing (a
    # KeyError at its next step before).
    from kvserver.errors import NotFound
    from kvserver.store.steps import STEP_KEYS

    many = [f"k{i}".encode() for i in range(2 * STEP_KEYS)]
    cache2, _, _ = make_cache(capacity=64 * MiB)
    part2 = one_part(cache2, page_bytes=4096)
    put(cache2, part2, many)
    steps = cache2.lookup_steps(part2, many, 5000, owner="engine-3")
    next(steps)  # its first step pinned, under a lease
    assert cache2.release_owned("engine-3") == 1
    with pytest.raises(NotFound, match="released"):
        for _ in steps:
            pass
    assert int(cache2.pages.pins.sum()) == 0 and not cache2.leases.leases


def test_get_ends_the_lease_it_names():
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("abcd"))
    _, lease = cache.lookup(part, K("ab"), pin_ms=1000)
    plan = cache.prepare_get(part, K("abcz"), lease_id=lease)
    assert (plan.pages, plan.lease_id) == (3, lease)
    assert cache.prepare_get(part, K("a"), lease_id="unknown").lease_id == ""
    cache.complete_get(plan, False)  # even a failed Get ends it
    assert cache.release("t", [lease]) == 0
    assert int(cache.pages.pins.sum()) == 0
    misses = cache.stats()[0][0].counters.misses
    assert misses == 1  # prepare_get counts the keys it did not load


def test_lease_limit_per_tenant():
    cache, _, clock = make_cache(max_leases_per_tenant=2)
    part = one_part(cache)
    put(cache, part, K("a"))
    leases = [cache.lookup(part, K("a"), pin_ms=1000)[1] for _ in range(2)]
    with pytest.raises(NoCapacity):
        cache.lookup(part, K("a"), pin_ms=1000)
    assert int(cache.pages.pins.sum()) == 2  # the refused lookup pinned nothing
    clock.now += 2
    assert cache.lookup(part, K("a"), pin_ms=1000)[0] == 1  # expired ones make way
    assert cache.release("t", leases) == 0


def test_touch_order_of_a_get():
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("abcdefgh"))
    plan = cache.prepare_get(part, K("hg"))  # after it, h then g are the most recent
    cache.complete_get(plan, True)
    stamps = cache.pages.stamp[cache.pages.find(part.gid, Keys.of(K("hgabcdef")))]
    assert (np.diff(stamps) < 0).all()


def test_a_put_that_evicts_many_slabs_ranks_them_once(monkeypatch):
    """Ranking other classes' slabs costs a pass over every page of the cache: done once per Put,
    not once per evicted slab (which made a Put that evicts across classes quadratic)."""
    import kvserver.store.cache as cache_module

    cache, _, _ = make_cache(32 * MiB)
    small = one_part(cache, page_bytes=PAGE // 16)  # 32 pages to a 2 MiB slab
    put(cache, small, [b"s%d" % i for i in range(16 * 32)])  # every slab of the arena
    assert cache.stats()[0][0].counters.pages == 16 * 32
    calls = []
    real = cache_module.lru_slabs
    monkeypatch.setattr(cache_module, "lru_slabs", lambda *a, **k: calls.append(1) or real(*a, **k))
    big = part_of(cache, cache.space(space_key(model="big")))  # 2 pages to a slab
    plan = put(cache, big, [b"b%d" % i for i in range(16)])  # needs 8 of the small class's slabs
    assert (len(plan.positions), plan.dropped) == (16, 0)
    assert len(calls) == 1
    small_pages = [s for s in cache.stats()[0] if s.space.model == "m"][0].counters.pages
    assert small_pages == 8 * 32  # the other eight slabs were left alone


@pytest.mark.parametrize("key_bytes", [1, 8, 16, 17, 32, 64])
def test_a_packed_get_finds_and_holds_what_prepare_get_does(key_bytes):
    """KVCache.prepare_get_packed (the compiled walk, digests and holds in one call: hit.h) against
    prepare_get of the same keys unpacked, on one cache: the same hit, page ids, offsets, readers,
    slab holds and misses, for keys committed, being written, held by another tenant's part, absent
    and repeated; narrow keys zero-padded, wide ones digested. A page whose slab is outside the
    slab table is refused with nothing held."""
    rng = np.random.default_rng(key_bytes)
    cache, _, _ = make_cache()
    part = one_part(cache, page_bytes=64 * 1024)
    other = one_part(cache, tenant="u", page_bytes=64 * 1024)
    if cache.pages.hold_hit(part.gid, b"", 1, hold=False) is None:
        pytest.skip("built without a compiler")
    pool = [rng.integers(0, 256, key_bytes, np.uint8).tobytes() for _ in range(40)]
    pool = list(dict.fromkeys(pool))
    put(cache, part, pool[:20])
    put(cache, other, pool[15:30])
    writing = cache.prepare_put(part, pool[20:24])  # being written: a Get stops there
    space = part.space
    for _ in range(200):
        keys = [pool[i] for i in rng.integers(0, len(pool), rng.integers(0, 12))]
        if rng.random() < 0.5:  # most Gets ask for a stored prefix first
            keys = pool[: rng.integers(0, 22)] + keys
        packed = b"".join(keys)
        before = (cache.pages.readers.copy(), cache.pages.slab_holds.copy(), space.counters.misses)
        got = cache.prepare_get_packed(part, packed, key_bytes)
        got_ids = got.page_ids.tolist()
        held = (cache.pages.readers - before[0], cache.pages.slab_holds - before[1],
                space.counters.misses - before[2])
        cache.complete_get(got, True)
        assert np.array_equal(cache.pages.readers, before[0])
        assert np.array_equal(cache.pages.slab_holds, before[1])
        want = cache.prepare_get(part, Keys.unpack(packed, key_bytes, 100))
        want_ids = want.page_ids.tolist()
        expect = (cache.pages.readers - before[0], cache.pages.slab_holds - before[1],
                  space.counters.misses - before[2] - held[2])
        cache.complete_get(want, True)
        assert got.pages == want.pages and got.lease_id == ""
        assert got_ids == want_ids and len(got_ids) == want.pages
        assert got.offsets.tolist() == want.offsets.tolist()
        assert np.array_equal(held[0], expect[0]) and np.array_equal(held[1], expect[1])
        assert held[2] == expect[2] == len(keys) - want.pages
    assert int(cache.pages.readers.sum()) == 0
    cache.complete_put(writing, True)
    ids = cache.pages.find(part.gid, Keys.of(pool[:1]))
    cache.pages.slab[ids[0]] = len(cache.pages.slab_holds)  # a slab past the slab table
    before = (cache.pages.readers.copy(), cache.pages.slab_holds.copy())
    with pytest.raises(ValueError):
        cache.prepare_get_packed(part, b"".join(pool[1:3] + pool[:1]), key_bytes)
    assert np.array_equal(cache.pages.readers, before[0])
    assert np.array_equal(cache.pages.slab_holds, before[1])


@pytest.mark.parametrize("key_bytes", [16, 32, 33, 48])
def test_a_packed_get_of_many_keys_walks_them_in_blocks_as_prepare_get_does(key_bytes):
    """The compiled hit walks (and digests, past 32 bytes) a request's keys 64 at a time, as far as
    its stored prefix goes: a prefix that ends on either side of a block's edge, or runs through
    every key of several blocks, is found as prepare_get finds it."""
    cache, _, _ = make_cache(32 * MiB)
    part = one_part(cache, page_bytes=4096)
    if cache.pages.hold_hit(part.gid, b"", 1, hold=False) is None:
        pytest.skip("built without a compiler")
    rng = np.random.default_rng(key_bytes)
    keys = list(dict.fromkeys(rng.integers(0, 256, key_bytes, np.uint8).tobytes() for _ in range(300)))
    stored = 200
    put(cache, part, keys[:stored])
    for end in (0, 1, 63, 64, 65, 127, 128, 129, 199, 200):
        asked = keys[:end] + keys[stored : stored + 5] + keys[:3]  # then misses, then stored keys again
        packed = b"".join(asked)
        got = cache.prepare_get_packed(part, packed, key_bytes)
        want = cache.prepare_get(part, Keys.unpack(packed, key_bytes, 1000))
        assert got.pages == want.pages == end
        assert got.page_ids.tolist() == want.page_ids.tolist()
        assert got.offsets.tolist() == want.offsets.tolist()
        cache.complete_get(got, True)
        cache.complete_get(want, True)
    assert int(cache.pages.readers.sum()) == 0


@pytest.mark.parametrize("key_bytes", [4, 16, 32])
def test_a_put_of_keys_all_stored_is_counted_as_prepare_put_counts_it(key_bytes):
    """KVCache.prepare_put_present (one compiled walk, nothing held or taken) answers only a Put
    whose every key the part has committed, repeats included, with prepare_put's plan and counters
    for it; a key absent, being written or stored only in another part leaves it to prepare_put
    (None), with nothing counted or changed."""
    cache, _, _ = make_cache()
    part = one_part(cache, page_bytes=64 * 1024)
    other = one_part(cache, tenant="u", page_bytes=64 * 1024)
    if cache.pages.hold_hit(part.gid, b"", 1, hold=False) is None:
        pytest.skip("built without a compiler")
    keys = [bytes([i]) * key_bytes for i in range(1, 9)]
    put(cache, part, keys[:5])
    put(cache, other, keys[5:7])
    writing = cache.prepare_put(part, keys[7:8])
    space, tenant = part.space, cache.tenants.get("t")

    def state():
        return (cache.pages.readers.copy(), cache.pages.slab_holds.copy(), cache.pages.state.copy(),
                dataclasses.astuple(space.counters), dataclasses.astuple(tenant.counters))

    def same(a, b):
        return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                   for x, y in zip(a, b, strict=True))

    for ask in ([0, 1, 2], [4, 0, 4, 1], [3]):
        chosen = [keys[i] for i in ask]
        before = state()
        got = cache.prepare_put_present(part, b"".join(chosen), key_bytes)
        after = state()
        assert got is not None and (got.present, got.dropped, got.positions.size, got.page_ids.size) == (
            len(ask), 0, 0, 0)
        cache.complete_put(got, True)
        want = cache.prepare_put(part, chosen)
        cache.complete_put(want, True)
        assert (want.present, want.dropped, want.positions.size) == (len(ask), 0, 0)
        counted = [np.subtract(b, a) for a, b in zip(before[3:], after[3:], strict=True)]
        again = [np.subtract(b, a) for a, b in zip(after[3:], state()[3:], strict=True)]
        assert all(np.array_equal(x, y) for x, y in zip(counted, again, strict=True)), "counted otherwise"
        assert same(before[:3], after[:3]), "a page was held or changed"
    for ask in ([0, 5], [5], [0, 7], [7], [2, 3, 4, 0, 1, 6]):  # absent, another part's, being written
        before = state()
        assert cache.prepare_put_present(part, b"".join(keys[i] for i in ask), key_bytes) is None
        assert same(before, state())
    cache.complete_put(writing, True)
    assert cache.prepare_put_present(part, keys[7], key_bytes) is not None


@pytest.mark.parametrize("key_bytes", [2, 16, 40])
def test_a_packed_lookup_finds_counts_and_touches_as_lookup_steps_does(key_bytes):
    """KVCache.lookup_packed (one compiled walk, nothing held) against lookup_steps of the same
    keys, for a part and for a space of one part: the same pages found, the same hits and misses,
    the found pages touched in the same order (the first the most recent), nothing held."""
    cache, _, _ = make_cache()
    part = one_part(cache, page_bytes=64 * 1024)
    if cache.pages.hold_hit(part.gid, b"", 1, hold=False) is None:
        pytest.skip("built without a compiler")
    rng = np.random.default_rng(key_bytes)
    keys = [bytes([i]) * key_bytes for i in range(1, 30)]
    put(cache, part, keys[:20])
    writing = cache.prepare_put(part, keys[20:22])
    space = part.space
    p = cache.pages
    for _ in range(60):
        ask = [keys[i] for i in rng.integers(0, len(keys), rng.integers(0, 10))]
        if rng.random() < 0.6:
            ask = keys[: rng.integers(0, 23)] + ask
        packed = b"".join(ask)
        for target in (part, space):
            before = (space.counters.hits, space.counters.misses, p.readers.copy(), p.slab_holds.copy())
            got = cache.lookup_packed(target, packed, key_bytes)
            mid = (space.counters.hits, space.counters.misses)
            ids = p.find(part.gid, Keys.unpack(packed, key_bytes, 100))[: got.pages]
            stamps = p.stamp[ids].copy()
            want = run_steps(cache.lookup_steps(target, Keys.unpack(packed, key_bytes, 100)))
            assert (got.pages, got.lease_id, got.lower) == (want.pages, "", 0)
            counted = (mid[0] - before[0], mid[1] - before[1])
            again = (space.counters.hits - mid[0], space.counters.misses - mid[1])
            assert counted == again == (got.pages, len(ask) - got.pages)
            # the same order of recency: the first key the most recent, as lookup_steps leaves it
            order = np.argsort(-stamps, kind="stable")
            assert np.array_equal(order, np.argsort(-p.stamp[ids], kind="stable"))
            assert np.array_equal(p.readers, before[2]) and np.array_equal(p.slab_holds, before[3])
    cache.complete_put(writing, True)


@pytest.mark.parametrize("key_bytes", [16, 32, 40])
def test_a_packed_lookup_of_a_space_of_several_parts_answers_as_lookup_steps_does(key_bytes):
    """A whole-space Lookup of a TP group (two parts) as one compiled walk a part: the leading keys
    every part holds, the same counters, each part's found pages touched in key order as
    lookup_steps touches them, nothing held; a space with a part missing finds nothing."""
    cache, _, _ = make_cache(32 * MiB)
    tp = cache.space(space_key("t", tp=2))
    a = part_of(cache, tp, 0, page_bytes=64 * 1024)
    if cache.pages.hold_hit(a.gid, b"", 1, hold=False) is None:
        pytest.skip("built without a compiler")
    rng = np.random.default_rng(key_bytes)
    keys = [rng.bytes(key_bytes) for _ in range(40)]
    assert cache.lookup_packed(tp, b"".join(keys[:5]), key_bytes).pages == 0  # part 1 not there yet
    b = part_of(cache, tp, 1, page_bytes=64 * 1024)
    put(cache, a, keys[:30])
    put(cache, b, keys[:12] + keys[14:25])  # b misses keys 12 and 13
    both = set(keys[:12] + keys[14:25])
    p = cache.pages
    for _ in range(40):
        ask = keys[: rng.integers(0, 32)] + [keys[i] for i in rng.integers(0, 40, rng.integers(0, 6))]
        packed = b"".join(ask)
        before = (tp.counters.hits, tp.counters.misses, p.readers.copy(), p.slab_holds.copy())
        stamp0 = p.stamp.copy()
        got = cache.lookup_packed(tp, packed, key_bytes)
        mid = (tp.counters.hits, tp.counters.misses)
        parsed = Keys.unpack(packed, key_bytes, 100)
        ids = [p.find(part.gid, parsed)[: got.pages] for part in (a, b)]
        untouched = np.ones(len(p.stamp), bool)
        untouched[np.concatenate(ids)] = False
        assert np.array_equal(p.stamp[untouched], stamp0[untouched]), "a page past the answer was touched"
        stamps = [p.stamp[i].copy() for i in ids]
        want = run_steps(cache.lookup_steps(tp, parsed))
        held = [k in both for k in ask] + [False]
        assert (got.pages, got.lease_id) == (want.pages, "") == (held.index(False), "")
        again = (tp.counters.hits - mid[0], tp.counters.misses - mid[1])
        assert (mid[0] - before[0], mid[1] - before[1]) == again == (got.pages, len(ask) - got.pages)
        for i, st in zip(ids, stamps, strict=True):  # each part's pages in the same recency order
            assert (i >= 0).all()
            assert np.array_equal(np.argsort(-st, kind="stable"), np.argsort(-p.stamp[i], kind="stable"))
        assert np.array_equal(p.readers, before[2]) and np.array_equal(p.slab_holds, before[3])


def test_leases_released_at_once_leave_no_heap_behind():
    """Pinning Lookups each released at once (a peer asking ``pin_ms`` 60 s, 10k times a second):
    the expiry heap is rebuilt from the live leases once it holds twice as many entries and more,
    not kept until each released lease's time would have passed."""
    cache, _, _ = make_cache()
    part = one_part(cache)
    put(cache, part, K("abc"))
    for _ in range(5000):
        _, lease = cache.lookup(part, K("abc"), pin_ms=60_000)
        assert cache.release("t", [lease]) == 1
    assert len(cache.leases.leases) == 0
    assert len(cache.leases._heap) <= 1025  # 2 x the live leases + 1024, past which it is rebuilt
    _, kept = cache.lookup(part, K("a"), pin_ms=60_000)
    for _ in range(3000):
        _, lease = cache.lookup(part, K("abc"), pin_ms=60_000)
        cache.release("t", [lease])
    assert kept in cache.leases.leases and any(lease_id == kept for _, lease_id in cache.leases._heap)


def test_pages_set_aside_leave_their_part_at_once_and_are_freed_later():
    """A failed pull's pages, whose transfer may still land: out of their part at once (their keys
    stored again in other pages), still being written (never taken nor evicted) until freed."""
    cache, _, _ = make_cache()
    part = one_part(cache)
    plan = cache.prepare_put(part, K("ab"))
    ids = plan.page_ids.copy()
    cache.set_aside(ids)
    plan.page_ids = plan.page_ids[:0]  # (as the pull settles it: its other pages only)
    cache.complete_put(plan, True)
    assert ss.ids_of(cache, part, "ab") == [-1, -1] and part.pages == 0
    assert (cache.pages.state[ids] == WRITING).all()
    put(cache, part, K("abcdef"))  # the keys again, and the rest of the memory: nothing evicted
    assert stored(cache, part, "abcdef") == "abcdef"
    assert not set(ss.ids_of(cache, part, "ab")) & set(ids.tolist())
    assert (cache.pages.state[ids] == WRITING).all() and part.space.counters.evictions == 0
    cache.free_stash(ids)
    assert not (cache.pages.state[ids] == WRITING).any()
    put(cache, part, K("gh"))  # the freed pages serve again
    assert stored(cache, part, "abcdefgh") == "abcdefgh"
