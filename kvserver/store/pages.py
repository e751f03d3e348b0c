"""The per-page state of the cache as growable numpy arrays, indexed by page id.

Primitives: ``PageTable`` (arrays: LRU stamp, pins, readers, state, part, tenant, arena offset,
slab and page bytes; ``index``, the key of each page filed under its part), ``PageTable.take`` /
``give`` (page ids for a new slab and back), ``PageTable.touch`` (prefix-end-first stamps),
``PageTable.hold`` / ``pin`` / ``write`` and their undoing (what keeps a page, and its slab, from
eviction, counted per slab as it happens) and ``BYTES_PER_PAGE`` (what the
table and its index hold per page).

Per slab the table keeps, as pages change, its newest stamp and how many holds its pages carry
(pins, readers and pages being written), so that choosing slabs to evict costs a pass over the
slabs, never one over the pages.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvserver.host.arena import BOOK_ALLOWANCE
from kvserver.host.kept import KeptDir
from kvserver.store.index import BYTES_PER_ENTRY, KeyIndex, _kvindex
from kvserver.store.index import KEPT as INDEX_KEPT
from kvserver.store.keys import MAX_KEY_BYTES, WORD_BYTES, Keys
from kvserver.store.lazy import lazy_zeros
from kvserver.store.lock import CacheLock
from kvserver.store.stack import IdPool

UNUSED = 0  # id not in any slab
FREE = 1  # in a slab, holds nothing
WRITING = 2  # being written: invisible to lookup and get, never evicted
COMMITTED = 3  # stored: visible, evictable unless pinned or being read

_ARRAYS = {
    "stamp": np.int64,
    "pins": np.int32,
    "readers": np.int32,
    "state": np.int8,
    "part": np.int32,
    "tenant": np.int32,
    "offset": np.int64,
    "slab": np.int32,
    "nbytes": np.int64,
}
# Pages of one slab at most: 2 MiB of the smallest (64-byte) pages. Evicting a slab takes each of
# its keys out of the index on the event loop; 32 Ki keys cost a few milliseconds.
MAX_SLAB_PAGES = 1 << 15
KEPT = ("state", "offset", "slab", "stamp")  # what a kept table keeps of a page (with its key)
ALLOCATE_IDS = 1 << 16  # kept records are given memory this many ids at a time
MIN_PAGE_BYTES = 64  # the smallest host page a registration may have (see kvserver.core)
# Bookkeeping bytes per page: the arrays above, its key index entry, its place in a free list or
# the spare ids (4), and the entry a space of several parts may keep for its key (complete.py).
BYTES_PER_PAGE = sum(np.dtype(t).itemsize for t in _ARRAYS.values()) + 2 * (BYTES_PER_ENTRY + 4)


def max_pages(capacity: int) -> int:
    """The most pages an arena of ``capacity`` can hold: all of the smallest pages an engine may
    have (64 bytes, as registrations require) and their bookkeeping, past its free allowance."""
    budget = capacity + capacity // BOOK_ALLOWANCE
    return max(1 << 16, min((1 << 31) - 1, budget // (MIN_PAGE_BYTES + BYTES_PER_PAGE)))


class PageTable:
    """Arrays of per-page state; an array doubles when the ids run out."""

    def __init__(self, capacity: int = 1 << 16, kept: KeptDir | None = None, sums: bool = False) -> None:
        # Every array is sized for ``capacity`` pages at once and committed as it is used (ids are
        # handed out from the lowest): the table never grows, so no call copies it. ``kept``: the
        # arrays of KEPT and the index's entries are files there, so that a page's record outlives
        # the daemon (kvserver.store.keep); their memory is taken ahead of the ids handed out.
        # ``sums``: a check of each page's bytes is kept too (``sum``, the disk tier's CRC-32C).
        self.size = capacity  # the most page ids there can be
        self._ids = IdPool(capacity)
        # The recency tick: the stamp the last page made recent has (one item, which the data
        # plane's thread raises too, as it makes the pages of a Lookup it walks recent).
        self.ticks = np.zeros(1, np.int64)
        self.kept = kept
        self._allocated = 0  # ids whose kept records have their memory
        for name, dtype in _ARRAYS.items():
            table = kept.array(f"pages.{name}", capacity, dtype) if kept and name in KEPT else None
            setattr(self, name, table if table is not None else lazy_zeros(capacity, dtype))
        self.kept_names = KEPT + (("sum",) if sums else ())
        self.sum = (kept.array("pages.sum", capacity, np.uint32) if kept and sums
                    else lazy_zeros(capacity if sums else 1, np.uint32))
        self.index = KeyIndex(capacity, kept)
        self._c = _kvindex  # hold and touch in C; None: in numpy (a build without a compiler; tests)
        # The bytes of keys wider than 32 bytes (the index keeps their digest), for KV events:
        # committed as written, 64 bytes a page that has such a key; not kept across restarts.
        self.wide = lazy_zeros(capacity * MAX_KEY_BYTES, np.uint8).reshape(capacity, MAX_KEY_BYTES)
        if kept is not None and not self._allocate_range(capacity - 1, capacity):
            # Lookups index the tables with -1 for a miss: the last item is read, and a read of a
            # hole in a shared tmpfs mapping takes memory (SIGBUS if there is none): it has it now.
            raise OSError(f"no room in {kept.path} for the page records")
        self.slab_stamp = np.zeros(64, np.int64)  # per slab id: the newest stamp of its pages
        self.slab_holds = np.zeros(64, np.int64)  # per slab id: pins + readers + pages being written
        # Per slab id: being evicted in steps (``KVCache.make_room_steps``): none of its pages is
        # handed out or evicted by anyone else meanwhile.
        self.slab_leaving = np.zeros(64, bool)
        # The cache's lock (kvserver.store.lock), which every change below checks is held (None: a
        # table of its own, as tests make); and who is told of new slab_holds and slab_stamp arrays
        # (the plane).
        self.lock: CacheLock | None = None
        self.on_slabs: Callable[[np.ndarray, np.ndarray], None] | None = None

    def _check_locked(self) -> None:
        if self.lock is not None:
            self.lock.check()

    def take(self, n: int) -> np.ndarray | None:
        """``n`` unused page ids, ascending where possible; None if the table has fewer left (or,
        kept, its file system has no room for their records)."""
        ids = self._ids.take(n)
        if ids is not None and len(ids) and self.kept is not None and int(ids.max()) >= self._allocated:
            if not self.allocate(int(ids.max()) + 1):
                self._ids.give(ids)
                return None
        return ids

    def allocate(self, upto: int) -> bool:
        """Takes the memory of kept records up to id ``upto`` (rounded up to ``ALLOCATE_IDS``)."""
        upto = min(self.size, -(-upto // ALLOCATE_IDS) * ALLOCATE_IDS)
        if upto <= self._allocated:
            return True
        if not self._allocate_range(self._allocated, upto):
            return False
        self._allocated = upto
        return True

    def _allocate_range(self, start: int, end: int) -> bool:
        tables = [(f"pages.{n}", getattr(self, n)) for n in self.kept_names]
        tables += [(f"index.{n}", getattr(self.index, n)) for n in INDEX_KEPT]
        for name, table in tables:
            size = table.nbytes // len(table)  # bytes an id: a key's words are a row of four
            if not self.kept.allocate(name, start * size, (end - start) * size):
                return False
        return True

    def give(self, ids: np.ndarray) -> None:
        """Page ids of a released slab go back to the spare ids."""
        self._check_locked()
        self.state[ids] = UNUSED
        self._ids.give(ids)

    def restore_ids(self, ids: np.ndarray) -> None:
        """Adopting a kept table: exactly ``ids`` are in slabs (their records hold), no other."""
        self._ids.restore(ids)
        self.allocate(self._ids.fresh)

    def restore_stamps(self) -> None:
        """Adopting a kept table: the adopted pages' stamps become their ranks, 1..N, in the
        order they had (whatever a file held, recency goes on from N, far from any overflow)."""
        n = self._ids.fresh
        committed = np.flatnonzero(self.state[:n] == COMMITTED)
        ranked = committed[np.argsort(self.stamp[committed], kind="stable")]
        self.stamp[ranked] = np.arange(1, len(ranked) + 1, dtype=np.int64)
        self.ticks[0] = len(ranked) + 1
        np.maximum.at(self.slab_stamp, self.slab[committed], self.stamp[committed])

    @property
    def high(self) -> int:
        """One past the highest page id ever handed out: no id above is in a slab."""
        return self._ids.fresh

    @property
    def in_slabs(self) -> int:
        """Page ids held by slabs."""
        return self._ids.in_use

    def touch(self, ids: np.ndarray) -> None:
        """Marks pages used, in key order: the first is made the most recently used. (In C, the
        tick taken at once, as the data plane's thread takes it: ``kv_touch``.)"""
        n = len(ids)
        if n and self._c is not None:
            ids = np.ascontiguousarray(ids, np.int64)
            self._c.touch(self.stamp, self.slab, self.slab_stamp, ids, self.ticks)
        elif n:  # (no plane without the compiled modules: nothing else raises the tick)
            tick = int(self.ticks[0])
            stamps = np.arange(tick + n, tick, -1, dtype=np.int64)
            self.stamp[ids] = stamps
            np.maximum.at(self.slab_stamp, self.slab[ids], stamps)  # its slabs' recency, kept as it goes
            self.ticks[0] = tick + n

    def new_slab(self, sid: int) -> None:
        """A slab id starts (again): not used yet."""
        self._check_locked()
        if sid >= len(self.slab_stamp):
            size = max(2 * len(self.slab_stamp), sid + 1)
            for name in ("slab_stamp", "slab_holds", "slab_leaving"):
                old = getattr(self, name)
                grown = np.zeros(size, old.dtype)
                grown[: len(old)] = old
                setattr(self, name, grown)
            if self.on_slabs is not None:
                self.on_slabs(self.slab_holds, self.slab_stamp)
        self.slab_stamp[sid] = 0
        self.slab_holds[sid] = 0
        self.slab_leaving[sid] = False

    # What keeps pages from eviction: every change goes through these, so the slabs' counts hold.

    def hold(self, ids: np.ndarray, n: int = 1) -> None:
        """Marks pages as being read (ids may repeat: each occurrence counts); ``n`` -1 undoes."""
        if not len(ids):
            return
        self._check_locked()
        self._count(self.readers, ids, n)

    def _count(self, counts: np.ndarray, ids: np.ndarray, n: int) -> None:
        """counts[id] += n and slab_holds[slab[id]] += n for each id (repeats count each time)."""
        if self._c is not None:  # the same in C: two np.add.at cost ~10 us on a busy loop, this ~1
            self._c.hold(counts, self.slab, self.slab_holds, np.ascontiguousarray(ids, np.int64), n)
            return
        np.add.at(counts, ids, n)
        np.add.at(self.slab_holds, self.slab[ids], n)

    @property
    def compiled(self) -> bool:
        """Whether ``hold_hit`` walks in C (False in a build without a compiler)."""
        return self._c is not None and self.index._c is not None

    def hold_hit(self, part: int, packed: bytes, key_bytes: int,
                 hold: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """The page ids and offsets of the leading keys packed in ``packed`` (``key_bytes`` each,
        checked by the caller) that ``part`` has committed, those pages held (``hold``; not with
        ``hold`` False): what ``find``, the state check and ``hold`` give, in one compiled call
        (digests included). None in a build without a compiler (the caller takes those steps)."""
        if not self.compiled:
            return None
        if hold:
            self._check_locked()
        n = len(packed) // key_bytes
        ids, offsets = np.empty(n, np.int64), np.empty(n, np.int64)
        m = self._c.hit(ids, offsets, packed, key_bytes, part, *self.index.tables(), self.state, self.offset,
                        self.readers, self.slab, self.slab_holds, hold)
        return ids[:m], offsets[:m]

    def pin(self, ids: np.ndarray, n: int = 1) -> None:
        """Pins pages once more (each occurrence: a lease's steps may pin a page twice); ``n`` -1
        unpins."""
        if not len(ids):
            return
        self._check_locked()
        self._count(self.pins, ids, n)  # (a lease of a million pages: ms in C, 0.16 s with np.add.at)

    def write(self, ids: np.ndarray) -> None:
        """Free pages start being written: invisible to lookups, never evicted."""
        self._check_locked()
        self.state[ids] = WRITING
        np.add.at(self.slab_holds, self.slab[ids], 1)

    def commit(self, ids: np.ndarray) -> None:
        """Pages being written are stored."""
        self._check_locked()
        self.state[ids] = COMMITTED
        np.add.at(self.slab_holds, self.slab[ids], -1)

    def busy_slabs(self, sids: np.ndarray) -> np.ndarray:
        """Mask of the slabs with a pinned page, a page being read or one being written."""
        return self.slab_holds[sids] > 0

    def find(self, part: int, keys: Keys) -> np.ndarray:
        """Page id of each key in part ``part`` (being written or committed), -1 where none."""
        return self.index.find(part, keys)

    def set_keys(self, ids: np.ndarray, part: int, keys: Keys) -> None:
        """Files free pages under their keys in ``part`` (keys distinct and absent from it)."""
        self._check_locked()
        self.index.insert(ids, part, keys)
        wide = keys.lens > WORD_BYTES
        if wide.any():  # a wide key's bytes, or zeros where unknown (rows of narrow keys are not read)
            rows = ids[wide]
            if keys.raw is None:
                self.wide[rows] = 0
            else:
                w = keys.raw.shape[1]
                self.wide[rows, :w] = keys.raw[wide]
                self.wide[rows, w:] = 0

    def keys_of(self, ids: np.ndarray) -> Keys:
        keys = self.index.keys_of(ids)
        if len(keys):
            longest = int(keys.lens.max())
            if longest > WORD_BYTES:
                keys.raw = self.wide[ids, :longest]
        return keys

    def clear(self, ids: np.ndarray) -> None:
        """Makes pages free: no key, no part, no stamp."""
        self._check_locked()
        self.index.remove(ids[self.part[ids] >= 0])
        written = ids[self.state[ids] == WRITING]
        np.add.at(self.slab_holds, self.slab[written], -1)
        self.state[ids] = FREE
        self.part[ids] = -1
        self.tenant[ids] = -1
        self.stamp[ids] = 0
