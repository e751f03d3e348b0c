"""The key index against a dict, through inserts, removals, splits, wide keys and several owners,
by both its walks (the compiled one, ``kvserver.store._kvindex``, where it is built, and numpy's);
a table whose links are corrupt is read only inside its arrays by the compiled walk and every
walk ends; arrays that do not agree are refused before a key is looked up."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvserver.store import Keys, index
from kvserver.store.index import KeyIndex


@pytest.fixture
def kvindex():
    if index._kvindex is None:
        if os.environ.get("KVSERVER_EXPECT_PLANE"):  # scripts/sanitize.sh: a skip would hide the job
            pytest.fail("the compiled index walk is not built")
        pytest.skip("the compiled index walk is not built (no compiler)")
    return index._kvindex


def _walk(ix: KeyIndex, owner: int, keys: Keys, kv) -> np.ndarray:
    out = np.empty(len(keys), np.int64)
    kv.find(out, np.ascontiguousarray(keys.words), np.ascontiguousarray(keys.lens), owner, *ix.tables())
    return out


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_both_walks_answer_as_a_dict_through_inserts_removals_and_splits(seed):
    rng = random.Random(seed)
    ix = KeyIndex(1 << 13)
    model: dict[tuple[int, bytes], int] = {}
    free = list(range(1 << 13))
    rng.shuffle(free)
    for _ in range(200):
        if rng.random() < 0.6 and free:
            owner = rng.randrange(5)
            n = min(len(free), rng.randrange(1, 150))
            keys: list[bytes] = []
            while len(keys) < n:  # keys kept whole (up to 32 bytes) and wide ones (kept as digests)
                k = rng.randbytes(rng.choice([1, 3, 8, 16, 17, 31, 32, 33, 64]))
                if (owner, k) not in model and k not in keys:
                    keys.append(k)
            ids = np.array([free.pop() for _ in keys], np.int64)
            ix.insert(ids, owner, Keys.of(keys))
            model.update({(owner, k): int(i) for k, i in zip(keys, ids, strict=True)})
        elif model:
            gone = rng.sample(sorted(model), min(len(model), rng.randrange(1, 200)))
            ids = [model.pop(g) for g in gone]
            ix.remove(np.array(ids, np.int64))
            free += ids
        held = sorted(model)
        for owner in range(5):
            # Its own keys, other owners' keys (absent under this one), and keys never stored.
            probe = [k for _, k in rng.sample(held, min(len(held), 300))]
            probe += [rng.randbytes(8) for _ in range(10)]
            keys = Keys.of(probe)
            want = [model.get((owner, k), -1) for k in probe]
            assert ix.find(owner, keys).tolist() == want
            assert ix.find_arrays(owner, keys).tolist() == want
    assert ix.count == len(model)
    assert ix.split or ix.level > 64, "the walks never met a split table"


def test_a_corrupt_table_is_read_inside_its_arrays_and_every_walk_ends(kvindex):
    ix = KeyIndex(256)
    keys = Keys.of([bytes([i]) * 8 for i in range(200)])
    ix.insert(np.arange(200), 0, keys)
    rng = np.random.default_rng(7)
    for case in range(24):
        saved = ix.next.copy(), ix.head.copy()
        if case % 4 == 0:  # links out of the table, both ways
            ix.next[:200] = rng.integers(-(1 << 31), 1 << 31, 200, dtype=np.int64).astype(np.int32)
        elif case % 4 == 1:  # every chain one cycle through all entries
            ix.next[:200] = np.roll(np.arange(200, dtype=np.int32), 1)
        elif case % 4 == 2:  # every entry its own successor
            ix.next[:200] = np.arange(200, dtype=np.int32)
        else:  # heads anywhere
            ix.head[: ix.buckets] = rng.integers(-5, 1 << 20, ix.buckets).astype(np.int32)
        got = _walk(ix, 0, keys, kvindex)
        assert ((got == -1) | (got == np.arange(200))).all()  # a hit is only ever the key's own entry
        # Keys no entry holds (another owner's): every walk goes round its cycle until its bound.
        assert (_walk(ix, 1, keys, kvindex) == -1).all()
        ix.next[:], ix.head[:] = saved
    assert (_walk(ix, 0, keys, kvindex) == np.arange(200)).all()


def test_arrays_that_do_not_agree_are_refused(kvindex):
    ix = KeyIndex(64)
    keys = Keys.of([b"a", b"b"])
    ix.insert(np.arange(2), 0, keys)
    out = np.empty(2, np.int64)
    words, lens = np.ascontiguousarray(keys.words), keys.lens
    good = [out, words, lens, 0, *ix.tables()]
    kvindex.find(*good)
    assert out.tolist() == [0, 1]
    for at, bad, why in [(0, np.empty(3, np.int64), "same keys"), (2, lens[:1], "same keys"),
                         (1, words[:, :2].copy(), "same keys"), (4, ix.words[:10], "one length"),
                         (4, ix.words[:, :2].copy(), "one length"), (5, ix.lens[:10], "one length"),
                         (7, ix.next[:10], "one length"),
                         (9, len(ix.head) + 1, "not consistent"), (10, 48, "not consistent"),
                         (11, ix.level + 1, "not consistent"), (0, np.empty(2, np.float64), "aligned"),
                         (1, np.ascontiguousarray(keys.words).view(np.uint8), "aligned"),
                         (0, np.empty(17, np.uint8)[1:].view(np.int64), "aligned")]:
        args = list(good)
        args[at] = bad
        with pytest.raises(ValueError, match=why):
            kvindex.find(*args)
    with pytest.raises(BufferError):  # the answer's array must be writable
        kvindex.find(bytes(16), *good[1:])


def _chains(ix: KeyIndex) -> list[set[int]]:
    """Each bucket's chain as a set, checked to end and to hold each entry once."""
    out = []
    for b in range(ix.buckets):
        seen: set[int] = set()
        cur = int(ix.head[b])
        while cur >= 0:
            assert cur not in seen and len(seen) <= ix.count, "a chain that loops"
            seen.add(cur)
            cur = int(ix.next[cur])
        out.append(seen)
    return out


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_compiled_changes_leave_the_tables_as_numpys_do(kvindex, seed):
    """Inserts (with their splits) and removals in C and in numpy, on twin indexes with the same
    seeds: after every change the same state, the same chains (as sets: the order within a chain
    is no one's business) holding every live entry once and no removed one, the same answers."""
    rng = random.Random(seed)
    c, py = KeyIndex(1 << 12), KeyIndex(1 << 12)
    py._c = None
    py._seeds = c._seeds
    model: dict[tuple[int, bytes], int] = {}
    free = list(range(1 << 12))
    rng.shuffle(free)
    for step in range(120):
        if rng.random() < 0.6 and free:
            owner = rng.randrange(3)
            n = min(len(free), rng.randrange(1, 120))
            keys: list[bytes] = []
            while len(keys) < n:
                k = rng.randbytes(rng.choice([1, 8, 16, 24, 32, 48]))
                if (owner, k) not in model and k not in keys:
                    keys.append(k)
            ids = np.array([free.pop() for _ in keys], np.int64)
            for ix in (c, py):
                ix.insert(ids, owner, Keys.of(keys))
            model.update({(owner, k): int(i) for k, i in zip(keys, ids, strict=True)})
        elif model:
            gone = rng.sample(sorted(model), min(len(model), rng.randrange(1, 150)))
            ids = [model.pop(g) for g in gone]
            for ix in (c, py):
                ix.remove(np.array(ids, np.int64))
            free += ids
        assert (c.count, c.buckets, c.level, c.split) == (py.count, py.buckets, py.level, py.split) == (
            len(model), c.buckets, c.level, c.split)
        chains = _chains(c)
        assert chains == _chains(py), f"step {step}: the chains differ"
        live = set(model.values())
        assert set().union(*chains) == live and sum(map(len, chains)) == len(live)
        assert (c.owner == py.owner).all()
        for owner in range(3):
            probe = [k for (o, k) in sorted(model) if o == owner][:200] + [rng.randbytes(8)]
            want = [model.get((owner, k), -1) for k in probe]
            assert c.find(owner, Keys.of(probe)).tolist() == want == py.find(owner, Keys.of(probe)).tolist()
    assert c.level > 64, "the changes never split a round of buckets"


def test_compiled_changes_refuse_what_does_not_fit_before_writing(kvindex):
    ix = KeyIndex(64)
    ix.insert(np.arange(3), 0, Keys.of([b"a", b"b", b"c"]))
    before = ix.next.copy(), ix.head.copy(), ix.owner.copy()
    state = ix.tables()
    for ids, why in [(np.array([0, 64]), "outside"), (np.array([-1]), "outside"),
                     (np.array([0.0]), "aligned")]:
        with pytest.raises(ValueError, match=why):
            kvindex.unlink(ids, *state)
        with pytest.raises(ValueError, match=why):
            kvindex.link(ids, *state)
    bad_state = list(state)
    bad_state[5] = ix.buckets + 1  # nhead is not level + split
    with pytest.raises(ValueError, match="not consistent"):
        kvindex.unlink(np.array([0]), *bad_state)
    short = list(state)
    short[4] = ix.head[: ix.buckets]  # no room for one more bucket
    with pytest.raises(ValueError, match="no room"):
        kvindex.split(10 * ix.buckets, 2, *short)
    with pytest.raises(ValueError, match="one length"):
        kvindex.link(np.array([0]), ix.words[:10], *state[1:])
    assert all((a == b).all() for a, b in zip(before, (ix.next, ix.head, ix.owner), strict=True))
    assert kvindex.unlink(np.array([1]), *state) == 1
    assert ix.find(0, Keys.of([b"a", b"b", b"c"])).tolist() == [0, -1, 2]


@pytest.mark.parametrize("seed", [1, 2])
def test_compiled_hold_and_touch_change_the_page_table_as_numpys_do(kvindex, seed):
    """PageTable.hold and touch in C and in numpy on twin tables: the same readers, slab holds,
    stamps, slab stamps and tick after every call, repeated ids included; an id or a slab outside
    the tables is refused with nothing changed."""
    from kvserver.store.pages import PageTable

    rng = np.random.default_rng(seed)
    c, py = PageTable(4096), PageTable(4096)
    py._c = None
    for t in (c, py):
        t.slab[:4096] = np.arange(4096) // 300
        t.new_slab(13)
    for _ in range(200):
        ids = rng.integers(0, 4096, rng.integers(0, 40)).astype(np.int64)
        if rng.random() < 0.5:
            by = int(rng.choice([1, -1, 3]))
            for t in (c, py):
                t.hold(ids, by)
        else:
            for t in (c, py):
                t.touch(ids)
        for name in ("readers", "stamp"):
            assert np.array_equal(getattr(c, name), getattr(py, name)), name
        assert np.array_equal(c.slab_holds, py.slab_holds) and np.array_equal(c.slab_stamp, py.slab_stamp)
        assert c.ticks[0] == py.ticks[0]
    before = (c.readers.copy(), c.slab_holds.copy(), c.stamp.copy(), int(c.ticks[0]))
    for bad in ([1, 4096], [-1], [2, 5]):
        if bad == [2, 5]:
            c.slab[5] = 99  # a slab id past slab_holds
        with pytest.raises(ValueError):
            c.hold(np.array(bad, np.int64))
        with pytest.raises(ValueError):
            c.touch(np.array(bad, np.int64))
    assert np.array_equal(c.readers, before[0]) and np.array_equal(c.slab_holds, before[1])
    assert np.array_equal(c.stamp, before[2]) and c.ticks[0] == before[3]


@pytest.mark.parametrize("compiled", [True, False])
def test_fit_splits_ahead_for_entries_filed_elsewhere_and_the_count_is_one_shared_item(compiled):
    """The data plane files a Put's keys itself (never splitting) and counts them in the index's
    one shared item: ``fit(n)`` splits the buckets ahead for n more entries, and ``fit()`` after
    entries were counted there, as ``insert`` splits after its own; the walks find every key
    either way."""
    if compiled and index._kvindex is None:
        pytest.skip("the compiled index walk is not built (no compiler)")
    ix = KeyIndex(1 << 12)
    if not compiled:
        ix._c = None
    assert ix.counter.shape == (1,) and ix.count == 0
    ix.fit(1000)
    assert ix.buckets * index.LOAD >= 1000
    buckets = ix.buckets
    keys = Keys.of([i.to_bytes(8, "little") for i in range(1000)])
    ix.insert(np.arange(1000, dtype=np.int64), 3, keys)
    assert ix.buckets == buckets, "the room was made ahead"
    ix.counter[0] += 500  # as the plane counts what it files (here: counted only)
    assert ix.count == 1500
    ix.fit()
    assert ix.buckets * index.LOAD >= 1500
    assert ix.find(3, keys).tolist() == list(range(1000))
    assert ix.find_arrays(3, keys).tolist() == list(range(1000))
