"""A compact hash index of keys, held in numpy arrays: (owner, key) -> entry id.

Entries are numbered by their user (the cache numbers them by page id); each holds its key's four
words (``keys.WORDS``), its length, its owner (a part or a space) and the next entry of its
bucket's chain, 41 bytes in all, and the buckets hold one int32 for every two entries. No Python
object is kept per key.

Every call costs work in proportion to the keys it names, never to the index's size:
- lookups walk the chains of all the keys at once, one numpy step per chain link; chains stay short
  (two entries a bucket on average) because the hash is seeded at random per process, so a peer
  cannot choose keys that crowd one bucket;
- the index grows one bucket at a time (linear hashing): each insert splits as many buckets as it
  added entries / 2, so no call ever rehashes the whole table;
- a removal walks and relinks only the chains of the buckets it touched.

Lookups and changes run in C where the package was built with a compiler (``kvserver.store._kvindex``:
the same hash and chains, walked and relinked key by key over these arrays, about 10 ns a key),
else in numpy (each call a few numpy steps, whatever the keys: what a large batch wants, though a
Put of a few pages pays tens of microseconds for them).

Primitives: ``KeyIndex`` (``find``, ``insert``, ``remove``, ``keys_of``) and ``BYTES_PER_ENTRY``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np

from kvserver.host.kept import KeptDir
from kvserver.protocol import compiled
from kvserver.store.keys import WORDS, Keys
from kvserver.store.lazy import lazy_zeros

# The compiled walk (csrc/index.c); None where not built (no compiler) or built from other
# sources: the numpy walk.
_kvindex = compiled.extension("kvserver.store._kvindex")

LOAD = 2  # entries per bucket, on average, before a bucket splits
_FIRST_BUCKETS = 64
KEPT = ("words", "lens", "owner")  # the tables a kept index keeps in files
BYTES_PER_ENTRY = 8 * WORDS + 1 + 4 + 4 + 4 * 2 // LOAD  # words, length, owner, chain; buckets (at most 2x)

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)


class KeyIndex:
    def __init__(self, capacity: int = 1024, kept: KeptDir | None = None) -> None:
        # Sized for ``capacity`` entries at once, committed as used (``lazy_zeros``): no call ever
        # copies the index to grow it. ``kept``: the entries (not the chains) are kept in its files,
        # "index.words" and so on (KEPT), so that a restarted daemon finds its keys again.
        def table(name: str, dtype: type, per: int = 1) -> np.ndarray:
            n = capacity * per
            return kept.array(f"index.{name}", n, dtype) if kept else lazy_zeros(n, dtype)

        self.words = table("words", np.uint64, WORDS).reshape(capacity, WORDS)
        self.lens = table("lens", np.uint8)
        self.owner = table("owner", np.int32)
        self.next = lazy_zeros(capacity, np.int32)
        self.head = lazy_zeros(_FIRST_BUCKETS + capacity // LOAD + 1, np.int32)
        self.head[:_FIRST_BUCKETS] = -1
        self.buckets = _FIRST_BUCKETS  # in use: self.head[:self.buckets]
        self.level = _FIRST_BUCKETS  # buckets at the start of this round of splits (a power of 2)
        self.split = 0  # buckets of this round split so far
        # Entries filed: one item, so that the data plane's thread, which files a Put's keys itself
        # (kvserver/lane/csrc/cache.h, cache_store), counts them where the loop does.
        self.counter = np.zeros(1, np.int64)
        seeds = [int.from_bytes(secrets.token_bytes(8), "little") for _ in range(5)]
        seeds[4] |= 1
        self._seeds = tuple(seeds)  # the four words' and the (owner, length) multiplier, odd
        self._c = _kvindex  # None: every call in numpy (a build without a compiler; tests)
        # Told of the bucket counters (buckets, level, split) after an insert changed them (the
        # data plane's copy of them: kvserver/lane/csrc/cache.h). Changes run under the cache's lock.
        self.on_state: Callable[[int, int, int], None] | None = None

    @property
    def count(self) -> int:
        return int(self.counter[0])

    @count.setter
    def count(self, n: int) -> None:
        self.counter[0] = n

    def tables(self) -> tuple:
        """The tables and state the compiled calls take after their first argument(s)."""
        return (self.words, self.lens, self.owner, self.next, self.head, self.buckets, self.level,
                self.split, self._seeds)

    # Hashing and addressing

    def _hash(self, words: np.ndarray, lens: np.ndarray, owner: np.ndarray) -> np.ndarray:
        s = np.array(self._seeds, np.uint64)
        h = (words[:, 0] ^ s[0]) * _M1
        h ^= h >> np.uint64(31)
        h += (words[:, 1] ^ s[1]) * _M2
        h ^= h >> np.uint64(29)
        h += (words[:, 2] ^ s[2]) * _M1
        h ^= h >> np.uint64(31)
        h += (words[:, 3] ^ s[3]) * _M2
        h ^= h >> np.uint64(29)
        h += (owner.astype(np.uint64) << np.uint64(8) | lens.astype(np.uint64)) * s[4]
        h ^= h >> np.uint64(32)
        h *= _M1
        h ^= h >> np.uint64(33)
        return h

    def _bucket(self, h: np.ndarray) -> np.ndarray:
        b = h & np.uint64(self.level - 1)
        if self.split:
            low = b < np.uint64(self.split)
            b[low] = h[low] & np.uint64(2 * self.level - 1)
        return b.astype(np.int64)

    def _buckets_of(self, ids: np.ndarray) -> np.ndarray:
        return self._bucket(self._hash(self.words[ids], self.lens[ids], self.owner[ids]))

    # Lookups

    def find(self, owner: int, keys: Keys) -> np.ndarray:
        """Entry id of each key under ``owner`` (int64), -1 where the index does not hold it."""
        n = len(keys)
        if not n or not self.count:
            return np.full(n, -1, np.int64)
        if self._c is None:
            return self.find_arrays(owner, keys)
        out = np.empty(n, np.int64)
        self._c.find(out, np.ascontiguousarray(keys.words), np.ascontiguousarray(keys.lens), owner,
                      *self.tables())
        return out

    def find_arrays(self, owner: int, keys: Keys) -> np.ndarray:
        """``find`` in numpy: the chains of all keys walked at once, a numpy step per link."""
        n = len(keys)
        out = np.full(n, -1, np.int64)
        if not n or not self.count:
            return out
        words, lens = keys.words, keys.lens
        cur = self.head[self._bucket(self._hash(words, lens, np.full(n, owner, np.int32)))].astype(np.int64)
        pos = np.arange(n)
        while True:
            live = cur >= 0
            pos, cur = pos[live], cur[live]
            if not len(cur):
                return out
            hit = ((self.words[cur] == words[pos]).all(axis=1) & (self.lens[cur] == lens[pos])
                   & (self.owner[cur] == owner))
            out[pos[hit]] = cur[hit]
            pos, cur = pos[~hit], self.next[cur[~hit]].astype(np.int64)

    def keys_of(self, ids: np.ndarray) -> Keys:
        return Keys(self.words[ids], self.lens[ids])

    # Changes

    def insert(self, ids: np.ndarray, owner: int | np.ndarray, keys: Keys) -> None:
        """Files entries ``ids`` (not in the index) under their keys; the keys must be distinct
        and absent for their owner."""
        if not len(ids):
            return
        # Buckets split first, while their chains are short: linked first, 1 Mi keys at once made
        # chains of hundreds of entries that each split then walked (2 s).
        self.fit(len(ids))
        self.words[ids], self.lens[ids] = keys.words, keys.lens
        self.owner[ids] = owner
        self.count += len(ids)
        if self._c is not None:
            self._c.link(np.ascontiguousarray(ids, np.int64), *self.tables())
        else:
            self._link(ids, self._buckets_of(ids))

    def fit(self, more: int = 0) -> None:
        """Splits buckets until the entries, and ``more`` to come, average at most ``LOAD`` a
        bucket: after an insert, and ahead of the entries the data plane's thread files itself
        (which never splits: its chains are longer until this runs, never wrong)."""
        if self.count + more <= LOAD * self.buckets:
            return
        if self._c is not None:
            self.buckets, self.level, self.split = self._c.split(self.count + more, LOAD, *self.tables())
        else:
            self._split_to_load(self.count + more)
        if self.on_state is not None:
            self.on_state(self.buckets, self.level, self.split)

    def remove(self, ids: np.ndarray) -> None:
        """Takes entries ``ids`` (each in the index, each once) out of it: the chains of their
        buckets are walked once, all at once, and relinked around them (no rehash, no sort)."""
        if not len(ids):
            return
        if self._c is not None:
            self._c.unlink(np.ascontiguousarray(ids, np.int64), *self.tables())
            self.count -= len(ids)
            return
        buckets = np.sort(self._buckets_of(ids))
        buckets = buckets[np.r_[True, buckets[1:] != buckets[:-1]]]  # distinct, by a sort
        self.owner[ids] = -1  # marks them gone (an entry in the index has an owner >= 0)
        cur = self.head[buckets].astype(np.int64)
        self.head[buckets] = -1
        chain = np.arange(len(buckets))
        tail = np.full(len(buckets), -1, np.int64)  # per bucket: the last entry kept so far
        while True:
            live = cur >= 0
            chain, cur = chain[live], cur[live]
            if not len(cur):
                break
            after = self.next[cur].astype(np.int64)
            keep = self.owner[cur] >= 0
            c, e = chain[keep], cur[keep]
            t = tail[c]
            first = t < 0
            self.head[buckets[c[first]]] = e[first]
            self.next[t[~first]] = e[~first]
            tail[c] = e
            cur = after
        self.next[tail[tail >= 0]] = -1
        self.count -= len(ids)

    def _members(self, buckets: np.ndarray) -> np.ndarray:
        """Every entry in the chains of ``buckets``."""
        out = []
        cur = self.head[buckets]
        while True:
            cur = cur[cur >= 0]
            if not len(cur):
                break
            out.append(cur)
            cur = self.next[cur]
        return np.concatenate(out).astype(np.int64) if out else np.empty(0, np.int64)

    def _link(self, ids: np.ndarray, buckets: np.ndarray) -> None:
        """Puts entries at the heads of their buckets' chains (several a bucket at once)."""
        if not len(ids):
            return
        order = np.argsort(buckets)
        b, e = buckets[order], ids[order]
        first = np.ones(len(b), bool)
        first[1:] = b[1:] != b[:-1]
        prev = np.empty(len(e), np.int64)
        prev[0] = -1
        prev[1:] = e[:-1]
        self.next[e] = np.where(first, self.head[b], prev)
        last = np.ones(len(b), bool)
        last[:-1] = b[1:] != b[:-1]
        self.head[b[last]] = e[last]

    def _split_to_load(self, count: int) -> None:
        """Splits buckets, in order, until ``count`` entries average at most ``LOAD`` a bucket."""
        while count > LOAD * self.buckets:
            k = min(-(-count // LOAD) - self.buckets, self.level - self.split)
            lo = self.split
            moved = self._members(np.arange(lo, lo + k))
            self.head[lo : lo + k] = -1
            self.head[self.buckets : self.buckets + k] = -1
            self.buckets += k
            self.split += k
            if self.split == self.level:
                self.level *= 2
                self.split = 0
            self._link(moved, self._buckets_of(moved))
