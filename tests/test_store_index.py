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
    kv.find(out, np.ascontiguousarray(keys.words), np.ascontiguousarray(keys.lens), owner, ix.w0, ix.w1,
            ix.lens, ix.owner, ix.next, ix.head, ix.buckets, ix.level, ix.split, int(ix._s0), int(ix._s1),
            int(ix._s2))
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
            while len(keys) < n:  # narrow keys, 16-byte keys, and wide ones (kept as digests)
                k = rng.randbytes(rng.choice([1, 3, 8, 16, 17, 32, 64]))
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
    seeds = int(ix._s0), int(ix._s1), int(ix._s2)
    good = [out, words, lens, 0, ix.w0, ix.w1, ix.lens, ix.owner, ix.next, ix.head, ix.buckets, ix.level,
            ix.split, *seeds]
    kvindex.find(*good)
    assert out.tolist() == [0, 1]
    for at, bad, why in [(0, np.empty(3, np.int64), "same keys"), (2, lens[:1], "same keys"),
                         (5, ix.w1[:10], "one length"), (8, ix.next[:10], "one length"),
                         (10, len(ix.head) + 1, "not consistent"), (11, 48, "not consistent"),
                         (12, ix.level + 1, "not consistent"), (0, np.empty(2, np.float64), "aligned"),
                         (1, np.ascontiguousarray(keys.words).view(np.uint8), "aligned"),
                         (0, np.empty(17, np.uint8)[1:].view(np.int64), "aligned")]:
        args = list(good)
        args[at] = bad
        with pytest.raises(ValueError, match=why):
            kvindex.find(*args)
    with pytest.raises(BufferError):  # the answer's array must be writable
        kvindex.find(bytes(16), *good[1:])
