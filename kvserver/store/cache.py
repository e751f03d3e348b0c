"""The node-wide KV cache index: spaces, parts, keys to pages, eviction, leases and quotas.

Primitives: ``KVCache`` with ``space`` / ``part`` (get or create), ``lookup``, ``prepare_put`` /
``complete_put``, ``prepare_get`` / ``complete_get``, ``release`` / ``expire_leases`` (leases),
``make_room`` (free arena room for a client region) and ``stats``. It copies nothing and knows no
gRPC: the daemon calls it on its event loop and copies bytes to and from the offsets it returns.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple, TypeVar

import numpy as np

from kvserver.errors import FailedPrecondition, InvalidArgument, NoCapacity, NotFound
from kvserver.host.regions import REGION_ALIGN, Regions, align_up
from kvserver.host.room import Room
from kvserver.store.complete import PartCounts
from kvserver.store.counters import CacheCounters
from kvserver.store.eviction import EvictionQueue, lru_slabs
from kvserver.store.keep import Keep, Recovery, adopt
from kvserver.store.keys import Keys, as_keys, leading
from kvserver.store.leases import LeaseTable
from kvserver.store.lock import CacheLock
from kvserver.store.pages import COMMITTED, WRITING, PageTable, max_pages
from kvserver.store.plans import GetPlan, PutPlan, PutPlans
from kvserver.store.quotas import Tenant, Tenants
from kvserver.store.slabs import Slab, SlabPool
from kvserver.store.spaces import Part, PartKey, Space, SpaceKey
from kvserver.store.stats import SpaceStat, TenantStat
from kvserver.store.steps import STEP_KEYS, run_steps

logger = logging.getLogger(__name__)

DROPS_LOG_SECONDS = 60.0  # Puts' dropped pages are logged at most this often
T = TypeVar("T")

MAX_PIN_MS = 60_000
# (key, part) pairs one Lookup examines: a whole-space Lookup looks at the keys in every part, so
# of a space of many parts it examines fewer keys (a shorter hit is a correct answer, and the work
# on the event loop no longer grows with parts x keys).
MAX_LOOKUP_PAIRS = 1 << 20
# (key, part) pairs one step of a compiled Lookup walks (``lookup_packed_steps``): 20-30 ns a pair
# on the 2-core VM of docs/performance.md (about 70 ns for keys over 32 bytes, digested as it
# goes), so a step costs the event loop no more than a numpy step of STEP_KEYS keys (about 0.3 ms).
PACKED_STEP_PAIRS = 4 * STEP_KEYS
# Lines a kept catalog may hold past twice the parts held (or twice what its last compaction kept)
# before it is written whole again (``Keep.compact``: about 0.7 KB a line).
CATALOG_SLACK = 1024
# Pages a step of ``make_room_steps`` evicts: their keys out of the index, about 0.2 us a page on
# the 2-core VM of docs/performance.md (a slab holds up to MAX_SLAB_PAGES, 32 Ki).
EVICT_STEP_PAGES = 4 * STEP_KEYS
Lower = Callable[[Part, Keys], np.ndarray]  # which of a part's keys a lower tier holds (bool mask)


def _locked(method):
    """The method runs under the cache's lock (kvserver.store.lock)."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        with self.lock:
            return method(self, *args, **kw)
    return run


def _locked_steps(method):
    """The generator method's steps each run under the cache's lock, which no yield holds."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        return _steps_under(self.lock, method(self, *args, **kw))
    return run


def _steps_under(lock: CacheLock, steps: Generator[None, None, T]) -> Generator[None, None, T]:
    try:
        while True:
            with lock:
                try:
                    next(steps)
                except StopIteration as stop:
                    return stop.value
            yield
    except BaseException:  # given up between two steps: what its steps hold is let go under the lock
        with lock:
            steps.close()
        raise


class Found(NamedTuple):
    """What a Lookup found: ``pages`` leading keys, pinned under ``lease_id`` if asked, of which
    ``lower`` only in the tier below, and ``cluster`` only in the cluster (after the others)."""

    pages: int
    lease_id: str
    lower: int = 0
    cluster: int = 0


class KVCache:
    def __init__(self, arena: Regions, *, default_quota: int = 0, quotas: Mapping[str, int] = {},  # noqa: B006
                 slab_bytes: int = 8 << 20, max_spaces_per_tenant: int = 256,
                 max_leases_per_tenant: int = 4096, clock: Callable[[], float] = time.monotonic,
                 sums: bool = False, what: str = "host cache") -> None:
        self.arena = arena
        self.what = what  # the tier, as logs name it
        self._drops_logged_at = -DROPS_LOG_SECONDS  # (monotonic) when Puts' dropped pages were logged
        self._drops_unlogged = 0  # pages dropped since
        self._drops_last: tuple[Tenant, int] | None = None  # the latest drop's tenant and page size
        self._drops_timer: asyncio.TimerHandle | None = None  # logs them once the minute is over
        self.clock = clock
        self.max_spaces_per_tenant = max_spaces_per_tenant
        kept = arena.kept  # a kept arena keeps the cache's records beside it (kvserver.store.keep)
        self.pages = PageTable(max_pages(arena.capacity), kept, sums)
        # Held around every change of the pages and the index (kvserver.store.lock): the data plane
        # walks and holds pages for a Get under it.
        self.lock = self.pages.lock = CacheLock()
        self.part_counts = PartCounts(self.pages.size)
        self.slabs = SlabPool(arena, self.pages, slab_bytes)
        self.leases = LeaseTable(self.pages, max_leases_per_tenant, clock, book=self._book_pins,
                                 unbook=self._unbook_pins)
        self.tenants = Tenants(arena.capacity, default_quota, quotas)
        # Listeners of keys becoming complete in a space (held by every part: stored True) and
        # ceasing to be (stored False): KV events (kvserver.events). Called on the loop, with
        # keys that carry wide keys' bytes.
        self.on_complete: list[Callable[[bool, Space, Keys], None]] = []
        self.on_slab_added = self.slabs.on_slab_added
        self.on_slab_removed = self.slabs.on_slab_removed
        self._spaces: dict[SpaceKey, Space] = {}
        # Spaces dropped while empty, kept while something still refers to them, so that a later
        # space() or a call through a held Part brings back the same object.
        self._dropped: weakref.WeakValueDictionary[SpaceKey, Space] = weakref.WeakValueDictionary()
        self._parts: dict[int, Part] = {}
        self._queues: dict[tuple[int, int], EvictionQueue] = {}  # per size class (tenant, page bytes)
        # Gives back the free pages set aside for the data plane's Puts (``take_stash``): those of
        # one size class (tenant id, page bytes), or every one (None), freed (their slabs kept,
        # even empty), and says the slabs they were in; called with the lock held before the loop
        # evicts for itself, so that the stashes cost a stored page its place as little as can be.
        self.on_reclaim: Callable[[tuple[int, int | None] | None], list[int]] | None = None
        self._next_gid = 0
        self._adopting = False
        self.keep = self.slabs.keep = Keep(kept, arena.capacity) if kept else None

    @_locked
    def adopt(self) -> Recovery | None:
        """Takes back what a kept cache's files hold (None if the cache is not kept): call once,
        before anything else, with the slab hooks in place."""
        if self.keep is None:
            return None
        self._adopting = True
        try:
            return adopt(self, self.keep)
        finally:
            self._adopting = False

    def adopt_part(self, space_key: SpaceKey, part_key: PartKey, gid: int) -> Part:
        """A kept part, under its number (``adopt``)."""
        part = self.part(self.space(space_key), part_key, gid)
        if part.gid != gid:
            raise FailedPrecondition(f"part {gid} and part {part.gid} are the same part")
        return part

    def next_gid(self, gid: int) -> None:
        """New parts are numbered from ``gid`` on (past every number a kept cache's catalog names)."""
        self._next_gid = max(self._next_gid, gid)

    @_locked
    def trim_to_quotas(self) -> int:
        """Evicts each tenant's least recently used slabs while it holds more than its quota (a
        kept cache adopted under smaller quotas); returns the pages evicted."""
        evicted = 0
        for tenant in list(self.tenants.by_name.values()):
            before = tenant.counters.pages
            self._evict_lru(self._tenant_slabs(tenant.tid), lambda t=tenant: not t.quota
                            or self.slabs.held(t.tid, t.quota) <= t.quota)
            evicted += before - tenant.counters.pages
        return evicted

    @_locked
    def adopt_pages(self, ids: np.ndarray) -> None:
        """Kept committed pages, in adopted slabs, back in their parts' indexes and counters."""
        if not len(ids):
            return
        p = self.pages
        owners = p.index.owner[ids].astype(np.int64)
        order = np.argsort(owners, kind="stable")
        uniq, starts = np.unique(owners[order], return_index=True)
        for gid, chunk in zip(uniq.tolist(), np.split(ids[order], starts[1:]), strict=True):
            part = self._parts[gid]
            tenant = self.tenants.get(part.space.key.tenant)
            keys = p.index.keys_of(chunk)
            p.part[chunk] = gid
            p.tenant[chunk] = tenant.tid
            p.index.insert(chunk, gid, keys)
            part.pages += len(chunk)
            self._tell(True, part.space, keys, part.space.complete.added(keys))
            for c in (part.space.counters, tenant.counters):
                c.pages += len(chunk)
                c.bytes += len(chunk) * part.key.page_bytes

    @property
    def bytes(self) -> int:
        """Arena bytes held in slabs."""
        return self.slabs.bytes

    # Spaces and parts

    def space(self, key: SpaceKey) -> Space:
        space = self._spaces.get(key)
        if space is not None:
            return space
        tenant = self.tenants.get(key.tenant)
        # Adoption takes back every space that holds pages, as many as the daemon held (a space
        # used through a held Part comes back past the limit); they are empty until their pages come.
        if tenant.spaces >= self.max_spaces_per_tenant and not self._adopting:
            self._drop_empty_spaces(tenant)
        if tenant.spaces >= self.max_spaces_per_tenant and not self._adopting:
            raise NoCapacity(
                f"tenant {key.tenant!r} has {tenant.spaces} KV spaces holding pages, the most allowed"
            )
        space = self._dropped.pop(key, None) or Space(key, self.part_counts)
        self._adopt(space, tenant)
        return space

    def part_of(self, gid: int) -> Part | None:
        """The part numbered ``gid`` (None if no space holding it is registered)."""
        return self._parts.get(gid)

    def find_space(self, key: SpaceKey) -> Space | None:
        return self._spaces.get(key)

    def _adopt(self, space: Space, tenant: Tenant) -> None:
        self._spaces[space.key] = space
        tenant.spaces += 1
        for part in space.parts.values():
            self._parts[part.gid] = part

    def _live(self, space: Space) -> Space:
        """The space, registered again if it was dropped while empty and is used through a Part."""
        if self._spaces.get(space.key) is not space:
            self._dropped.pop(space.key, None)
            self._adopt(space, self.tenants.get(space.key.tenant))
        return space

    def _drop_empty_spaces(self, tenant: Tenant) -> None:
        empty = [s for s in self._spaces.values() if s.key.tenant == tenant.name and not s.counters.pages]
        for space in empty:
            self._drop_space(space, tenant)

    def _drop_space(self, space: Space, tenant: Tenant) -> None:
        del self._spaces[space.key]
        self._dropped[space.key] = space
        tenant.spaces -= 1
        for part in space.parts.values():
            del self._parts[part.gid]

    def drop_if_empty(self, key: SpaceKey) -> None:
        """The space of ``key`` dropped if it holds no page (as at its tenant's limit of spaces):
        undoes a ``space`` whose call was refused after it."""
        space = self._spaces.get(key)
        if space is not None and not space.counters.pages:
            self._drop_space(space, self.tenants.get(key.tenant))

    def part(self, space: Space, key: PartKey, gid: int = -1) -> Part:
        sk = space.key
        if not (0 <= key.tp_shard < sk.tp_shards and 0 <= key.pp_rank < sk.pp_size):
            raise InvalidArgument(
                f"part (tp_shard {key.tp_shard}, pp_rank {key.pp_rank}) is outside a space of "
                f"{sk.tp_shards} TP shards and {sk.pp_size} PP stages"
            )
        if not (0 <= key.start_layer < key.end_layer <= sk.num_layers) or key.page_bytes <= 0:
            raise InvalidArgument(
                f"part layers [{key.start_layer}, {key.end_layer}) of {sk.num_layers} and page_bytes "
                f"{key.page_bytes}: the range must be non-empty and inside the model, page_bytes > 0"
            )
        self._live(space)
        existing = space.parts.get((key.tp_shard, key.pp_rank))
        if existing is not None:
            if existing.key != key:
                old = existing.key
                raise FailedPrecondition(
                    f"PP stage {key.pp_rank} (TP shard {key.tp_shard}) of this KV space holds layers "
                    f"[{old.start_layer}, {old.end_layer}) in pages of {old.page_bytes} bytes; this "
                    f"registration names layers [{key.start_layer}, {key.end_layer}) in pages of "
                    f"{key.page_bytes} bytes, whose pages would not be interchangeable"
                )
            return existing
        if gid < 0:
            gid, self._next_gid = self._next_gid, self._next_gid + 1
        part = Part(space, key, gid)
        if self.keep is not None and not self._adopting:  # (an adopted part's line is there)
            self.keep.part_added(part)
        space.parts[(key.tp_shard, key.pp_rank)] = part
        self._parts[part.gid] = part
        keep = self.keep
        held = len(self._parts)
        if keep is not None and keep.catalog_lines > 2 * max(held, keep.compacted) + CATALOG_SLACK:
            # Its lines of parts gone: the parts of the spaces held, and of those dropped while empty
            # that a Part may still hold (one may store again, under its number). Those stay until
            # the garbage collector finds their cycles; the next compaction waits for the file to
            # double what this one kept, so that they never make every new part one.
            dropped = [p for sp in list(self._dropped.values()) for p in sp.parts.values()]
            keep.compact([*self._parts.values(), *dropped])
        return part

    # Lookup

    def lookup(self, target: Part | Space, keys: Keys | Sequence[bytes], pin_ms: int = 0) -> tuple[int, str]:
        """How many leading keys are stored (in every part of a space), pinned under a new lease
        for ``pin_ms`` if given (expired leases making way first, all of them: ``make_way_steps``);
        see ``lookup_steps``."""
        if pin_ms:
            run_steps(self.make_way_steps(self.parts_of(target)[0].key.tenant))
        found = run_steps(self.lookup_steps(target, keys, pin_ms))
        return found.pages, found.lease_id

    @_locked_steps
    def lookup_steps(self, target: Part | Space, keys: Keys | Sequence[bytes], pin_ms: int = 0,
                     lower: Lower | None = None, owner: str = "") -> Generator[None, None, Found]:
        """``lookup`` in steps of at most ``STEP_KEYS`` keys, yielding between them so that the
        daemon's event loop serves others meanwhile. Each step pins what it found before the next
        one runs; a lookup given up midway ends its lease, whose ``pin_ms`` counts from the answer.
        ``lower``: a tier below (the disk's ``holds``); a key it holds counts as found, unpinned,
        and ``Found.lower`` says how many of the keys found are there only. ``owner``: the
        registration asking, whose release ends its lease (``release_owned``)."""
        keys = as_keys(keys)
        if not 0 <= pin_ms <= MAX_PIN_MS:
            raise InvalidArgument(f"pin_ms must be between 0 and {MAX_PIN_MS}, got {pin_ms}")
        space, parts = self.parts_of(target)
        space = self._live(space)
        tenant = self.tenants.get(space.key.tenant)
        if pin_ms and keys:
            self.leases.check(tenant.name)
        asked = len(keys)
        if len(parts) > 1:
            keys = keys[: max(1, MAX_LOOKUP_PAIRS // len(parts))]
        total = len(keys) if parts else 0
        n = below = 0
        counted: list[list[np.ndarray]] = []  # per step, per part: the page ids found
        lease_id = ""
        try:
            while n < total:
                step = keys[n : n + STEP_KEYS]
                m, found = len(step), []
                for part in parts:
                    ids = self.pages.find(part.gid, step[:m])
                    mine = (ids >= 0) & (self.pages.state[ids] == COMMITTED)
                    m = leading(mine if lower is None else mine | lower(part, step[:m]))
                    found.append((ids, mine))
                # Each part's own pages in memory (pinned), whatever the other parts hold where;
                # without a tier below, the leading ``m`` of every part are all its own.
                if lower is None:
                    got = [ids[:m] for ids, _ in found]
                else:
                    got = [ids[:m][mine[:m]] for ids, mine in found]
                    here = np.logical_and.reduce([mine[:m] for _, mine in found])
                    below += m - int(np.count_nonzero(here))
                # A pin refused for the tenant's limits: the lease so far ends. Pages the tier
                # below holds are not pinned (the Get that follows reads them back).
                if pin_ms and any(len(g) for g in got):
                    # Distinct keys are distinct pages (a page holds one key of one part): no dedup then.
                    ids, distinct = np.concatenate(got), step[:m].distinct()
                    if lease_id:
                        self._still_held(lease_id, tenant.name)
                        self.leases.extend(lease_id, tenant.name, ids, distinct=distinct)
                    else:
                        # Its time starts at the answer: no expiry ends it between two steps.
                        lease_id = self.leases.add(tenant.name, ids, None, distinct=distinct, owner=owner)
                counted.append(got)
                n += m
                if m < len(step) or n == total:
                    break
                yield
        except BaseException:
            if lease_id:
                self.leases.end(lease_id, tenant.name)
            raise
        if lease_id:  # (held still: no step ran since the last one looked)
            self.leases.start(lease_id, pin_ms)
        self._count(space, n, asked - n)
        # Touched once at the end, in key order, so that the first key is the most recent. Pages
        # a step found unpinned may have gone since; a stamp on a page that changed only moves it
        # in the LRU order.
        for j in range(len(parts) if counted else 0):
            self.pages.touch(np.concatenate([got[j] for got in counted]))
        return Found(n, lease_id, below)

    def lookup_packed(self, target: Part | Space, packed: bytes, key_bytes: int) -> Found | None:
        """``lookup_packed_steps`` all at once, each part's keys in one walk (a Lookup of one
        step: ``packed_step_keys``); None where the package has no compiled index."""
        if not self.pages.compiled:
            return None
        space, parts, asked, total = self._packed_bounds(target, packed, key_bytes)
        found = self._walk_packed(parts, memoryview(packed), key_bytes, 0, total)
        return self._found_packed(space, asked, found)

    def lookup_packed_steps(self, target: Part | Space, packed: bytes,
                            key_bytes: int) -> Generator[None, None, Found] | None:
        """``lookup_steps`` without a lease or a tier below, of keys packed as a request packs them
        (checked by the caller), for a part or a whole space (every part of a space of several, a
        TP or PP group's): compiled walks from the packed keys (``PageTable.hold_hit``, nothing
        held), each part's over the keys every part before it holds, in steps of
        ``packed_step_keys(target)`` keys; the same leading pages, the same counters and the same
        touches as ``lookup_steps``. Nothing changes until its last step. None where the package has
        no compiled index (``lookup_steps`` then)."""
        if not self.pages.compiled:
            return None
        return self._lookup_packed(target, packed, key_bytes)

    def packed_step_keys(self, target: Part | Space) -> int:
        """Keys one step of ``lookup_packed_steps`` walks: at most ``PACKED_STEP_PAIRS`` (key, part)
        pairs, and never fewer keys than a step of ``lookup_steps``."""
        return max(STEP_KEYS, PACKED_STEP_PAIRS // max(1, len(self.parts_of(target)[1])))

    def parts_of(self, target: Part | Space) -> tuple[Space, list[Part]]:
        """The space of a Lookup's target and the parts it looks in: a part, or every part of a
        space that has them all (none of one that does not: it holds no whole page)."""
        if isinstance(target, Part):
            return target.space, [target]
        full = len(target.parts) == target.key.num_parts
        return target, list(target.parts.values()) if full else []

    def _lookup_packed(self, target: Part | Space, packed: bytes,
                       key_bytes: int) -> Generator[None, None, Found]:
        space, parts, asked, total = self._packed_bounds(target, packed, key_bytes)
        step_keys = self.packed_step_keys(target)
        view = memoryview(packed)
        n = 0
        counted: list[list[np.ndarray]] = []  # per step, per part: the page ids found
        while n < total:
            end = min(total, n + step_keys)
            counted.append(self._walk_packed(parts, view, key_bytes, n, end))
            n += len(counted[-1][0])
            if n < end or n == total:
                break
            yield
        return self._found_packed(space, asked, [np.concatenate(ids) for ids in zip(*counted, strict=True)])

    def _found_packed(self, space: Space, asked: int, found: list[np.ndarray]) -> Found:
        """A packed Lookup's end, ``found`` each part's pages of the leading keys every part holds:
        its hits and misses counted, each part's pages touched once, in key order (the first key
        the most recent, as ``lookup_steps`` touches them)."""
        n = len(found[0]) if found else 0
        self._count(space, n, asked - n)
        for ids in found:
            self.pages.touch(ids)
        return Found(n, "")

    def _packed_bounds(self, target: Part | Space, packed: bytes,
                       key_bytes: int) -> tuple[Space, list[Part], int, int]:
        """A packed Lookup's space (live), parts, keys asked, and keys it walks (as ``lookup_steps``
        bounds a space of many parts)."""
        space, parts = self.parts_of(target)
        asked = len(packed) // key_bytes
        total = min(asked, max(1, MAX_LOOKUP_PAIRS // len(parts))) if len(parts) > 1 else asked
        if not parts:
            total = 0
        return self._live(space), parts, asked, total

    def _walk_packed(self, parts: list[Part], view: memoryview, key_bytes: int, start: int,
                     end: int) -> list[np.ndarray]:
        """Each part's page ids of the leading keys ``start``..``end`` every part holds, each part
        walking only the keys the parts before it hold (nothing held)."""
        m, found = end - start, []
        if m <= 0:
            return []
        for part in parts:
            got = self.pages.hold_hit(part.gid, view[start * key_bytes: (start + m) * key_bytes], key_bytes,
                                      hold=False)
            assert got is not None  # (compiled: checked before)
            found.append(got[0])
            m = min(m, len(got[0]))
        return [ids[:m] for ids in found]

    # Put

    def prepare_put(self, part: Part, keys: Keys | Sequence[bytes], plane_pages: int = -1) -> PutPlan:
        """Takes pages for the keys the part does not hold (see ``prepare_put_steps``)."""
        return run_steps(self.prepare_put_steps(part, keys, plane_pages))

    def prepare_put_steps(self, part: Part, keys: Keys | Sequence[bytes], plane_pages: int = -1,
                          counted: bool = True) -> Generator[None, None, PutPlan]:
        """``prepare_put`` in steps of at most ``STEP_KEYS`` keys. Once a step cannot store all of
        its keys the budget is full: the keys after it are dropped whole, so that what is stored
        is a prefix. A Put given up midway frees what its steps took. The data plane's stashes are
        given back for it (``_allocate``) before anything is evicted, but for a Put of at most
        ``plane_pages`` new pages (one the plane would have stored: its registration's stash's
        size), which evicts first, as the stash's next fill would, and leaves the stash.
        ``counted`` False: pages a Get brings up from a tier below, not a Put: its keys found
        stored or left out are not the space's Put counters' (dedup, dropped)."""
        keys = as_keys(keys)
        plans = PutPlans(part, len(keys))
        start = 0
        # The pages earlier steps found stored, held until the last step is planned: a later
        # step's room is never made by evicting them (they are this Put's prefix).
        kept: list[np.ndarray] | None = [] if len(keys) > STEP_KEYS else None
        try:
            while start < len(keys):
                plan = self._prepare_put(part, keys[start : start + STEP_KEYS], plane_pages, counted, kept)
                plans.add(start, plan)
                start += STEP_KEYS
                if plan.dropped or start >= len(keys):
                    break
                yield
        except BaseException:
            for plan in plans.steps:
                self.complete_put(plan, False)
            raise
        finally:
            for ids in kept or ():
                self.hold(ids, -1)
        rest = max(0, len(keys) - start)
        if rest and counted:
            tenant = self.tenants.get(part.space.key.tenant)
            for c in (part.space.counters, tenant.counters):
                c.dropped += rest
        return plans.plan(rest)

    @_locked
    def _prepare_put(self, part: Part, keys: Keys, plane_pages: int = -1, counted: bool = True,
                     kept: list[np.ndarray] | None = None) -> PutPlan:
        """A step of ``prepare_put_steps``; the pages it finds stored are held and added to
        ``kept`` (unless None) for the steps after it."""
        space = self._live(part.space)
        tenant = self.tenants.get(space.key.tenant)
        page_bytes = part.key.page_bytes
        ids = self.pages.find(part.gid, keys)
        missing = np.flatnonzero(ids < 0)
        # Keys another Put is still writing: neither stored nor present until that copy is over.
        waiting = np.flatnonzero(self.pages.state[ids[ids >= 0]] == WRITING)
        if len(waiting):
            waiting = np.flatnonzero(ids >= 0)[waiting]
        if kept is not None:
            found = ids[ids >= 0]
            found = found[self.pages.state[found] == COMMITTED]
            self.pages.hold(found)
            kept.append(found)
        if len(missing):
            firsts = keys.take(missing).firsts()  # of repeated keys the earliest is stored
            positions = missing[firsts]
            held = ids[ids >= 0]
            self.pages.hold(held)  # the present pages are not evicted for this Put
            try:
                reclaim = "last" if len(positions) <= plane_pages else "first"
                new = self._allocate(tenant, page_bytes, len(positions), reclaim=reclaim)
            finally:
                self.pages.hold(held, -1)
            stored = positions[: len(new)]
            dropped = 0
            if len(new) < len(positions):
                # Every key from the first one left out on, whatever it is (one stored already
                # too): dropped keys are the last ones, and the leading len(keys) - dropped are
                # what the part holds (the prefix a Lookup finds).
                first = int(positions[len(new)])
                dropped = len(keys) - first
                waiting = waiting[waiting < first]
        else:
            new = stored = np.empty(0, np.int64)
            dropped = 0
        present = len(keys) - len(new) - dropped - len(waiting)
        if len(new):
            p = self.pages
            p.write(new)
            p.part[new] = part.gid
            p.tenant[new] = tenant.tid
            p.set_keys(new, part.gid, keys.take(stored))
            part.pages += len(new)
        for c in (space.counters, tenant.counters):
            c.pages += len(new)
            c.bytes += len(new) * page_bytes
            if counted:
                c.dedup_pages += present
                c.dedup_bytes += present * page_bytes
                c.dropped += dropped
        if dropped and counted:
            self._log_drops(tenant, page_bytes, dropped)
        return PutPlan(part, stored, self.pages.offset[new], present, dropped, new, waiting)

    def _log_drops(self, tenant: Tenant, page_bytes: int, n: int) -> None:
        """Puts' pages left unstored are counted (``dropped``) and logged: at once, then at most
        every ``DROPS_LOG_SECONDS`` with what was dropped meanwhile (a timer logs them once that
        time is over, and ``log_drops`` at the stop), and why room was short."""
        self._drops_unlogged += n
        self._drops_last = (tenant, page_bytes)
        wait = self._drops_logged_at + DROPS_LOG_SECONDS - time.monotonic()
        if wait <= 0:
            self.log_drops()
        elif self._drops_timer is None:
            try:
                self._drops_timer = asyncio.get_running_loop().call_later(wait, self.log_drops)
            except RuntimeError:  # no loop here (a tool's own cache): the next drop logs them
                pass

    def log_drops(self) -> None:
        """Logs the Puts' pages dropped and not logged yet, if any."""
        if self._drops_timer is not None:
            self._drops_timer.cancel()
            self._drops_timer = None
        if not self._drops_unlogged or self._drops_last is None:
            return
        tenant, page_bytes = self._drops_last
        if not self.slabs.fitting(page_bytes, tenant.quota):
            why = f"not one slab of {page_bytes}-byte pages fits under tenant {tenant.name}'s quota"
        elif tenant.quota and tenant.counters.bytes + page_bytes > tenant.quota:
            why = f"tenant {tenant.name} is at its quota and its pages are pinned or being read"
        else:
            why, aside = f"{self.arena.available} bytes of {self.arena.capacity} are free", 0
            if self.arena.held:  # registrations' rooms: evicted slabs and free ranges, nobody's
                aside = sum(slab.nbytes for slab in self.slabs.slabs.values()
                            if self.pages.slab_leaving[slab.sid])
                why += (f", {self.arena.held} held for registrations making room (and {aside} bytes of "
                        "cached pages being evicted for them)")
            why += ", the rest in " + (f"{self.bytes - aside} bytes of cached pages (pinned or being read) "
                                       "and " if self.bytes > aside else "") + "engines' regions"
        logger.warning("the %s left %d pages of Puts unstored (%s): Lookups will miss them",
                       self.what, self._drops_unlogged, why)
        self._drops_logged_at, self._drops_unlogged = time.monotonic(), 0

    def prepare_put_present(self, part: Part, packed: bytes, key_bytes: int) -> PutPlan | None:
        """``prepare_put`` of at most ``STEP_KEYS`` keys packed as a request packs them (checked
        by the caller) where the part has every one of them stored already: nothing to take or
        copy, each key counted present, from one compiled walk (``PageTable.hold_hit``). None
        where a key is not stored (or is being written), or the package has no compiled index:
        ``prepare_put`` then."""
        n = len(packed) // key_bytes
        got = self.pages.hold_hit(part.gid, packed, key_bytes, hold=False)
        if got is None or len(got[0]) < n:
            return None
        self._count_present(self._live(part.space), n, part.key.page_bytes)
        return PutPlan(part, np.empty(0, np.int64), np.empty(0, np.int64), n, 0)

    @_locked
    def take_stash(self, part: Part, want: int, evict: bool) -> np.ndarray:
        """Up to ``want`` free pages of the part's size set aside for the Puts the data plane
        stores itself (``DataPlane.stash``; docs/design.md, "A Put on the data plane"): free pages
        and slabs grown within the tenant's quota, or (``evict``) taken as a Put takes pages
        (``_allocate``: its own least recently used pages first); marked being written (never
        evicted, in no part, found by no walk) and the tenant's; the index's buckets split ahead
        for them to be filed (``KeyIndex.fit``). No other stash is given back for them."""
        tenant = self.tenants.get(part.space.key.tenant)
        ids = self._allocate(tenant, part.key.page_bytes, want, evict=evict, reclaim="never")
        if len(ids):
            self.pages.write(ids)
            self.pages.tenant[ids] = tenant.tid
            self.pages.index.fit(len(ids))
        return ids

    @_locked
    def free_stash(self, ids: np.ndarray, release_empty: bool = True) -> list[int]:
        """Pages set aside by ``take_stash`` and never filed, back among the free ones (their slabs
        released where left empty, unless told not to); returns the slabs they were in."""
        if not len(ids):
            return []
        self.pages.clear(ids)
        return self.slabs.give(ids, release_empty=release_empty)

    def settle_stored(self, part: Part, ids: np.ndarray, present: int) -> None:
        """The end of a Put the data plane stored itself: its pages ``ids``, which the plane filed
        under ``part``, committed and held (kvserver/lane/csrc/cache.h, ``cache_store``), are
        counted, made recent, told to the listeners (KV events) and let go, as ``complete_put``
        commits a Put's pages; ``present`` of its keys were stored already. The index's buckets
        then split for the keys the plane filed (``KeyIndex.fit``). Only the holds and the split
        take the cache's lock: the rest changes what the plane never reads (stamps, counters, the
        listeners' state; a Lookup the plane walks writes stamps too, by the same atomic
        ``kv_touch``), and nothing evicts the pages while they are held; so the plane's next call,
        which comes about now, seldom waits on it."""
        space = self._live(part.space)
        tenant = self.tenants.get(space.key.tenant)
        n, page_bytes = len(ids), part.key.page_bytes
        part.pages += n
        for c in (space.counters, tenant.counters):
            c.pages += n
            c.bytes += n * page_bytes
            c.dedup_pages += present
            c.dedup_bytes += present * page_bytes
        p = self.pages
        try:
            if n:
                p.touch(ids)
                keys = p.keys_of(ids)
                self._tell(True, space, keys, space.complete.added(keys))
        finally:
            with self.lock:
                if n:
                    p.hold(ids, -1)
                p.index.fit()

    def writing(self, part: Part, keys: Keys) -> bool:
        """True if a Put is still writing any of ``keys`` into the part."""
        ids = self.pages.find(part.gid, keys)
        return bool((self.pages.state[ids[ids >= 0]] == WRITING).any())

    @_locked
    def complete_put(self, plan: PutPlan, ok: bool | np.ndarray) -> None:
        """Commits the plan's new pages, or frees them if the copy failed; ``ok`` a mask over
        them: commits those it marks and frees the others."""
        ids, plan.page_ids = plan.page_ids, plan.page_ids[:0]
        if not len(ids):
            return
        if isinstance(ok, np.ndarray):
            good, bad = ids[ok], ids[~ok]
        else:
            good, bad = (ids, ids[:0]) if ok else (ids[:0], ids)
        if len(good):
            self.pages.commit(good)
            self.pages.touch(good)
            keys = self.pages.keys_of(good)
            self._tell(True, plan.part.space, keys, plan.part.space.complete.added(keys))
        if len(bad):
            self._drop(bad, evicted=False)

    @_locked
    def set_aside(self, ids: np.ndarray) -> None:
        """Pages being written whose copy may still land though it was given up (a cluster pull
        whose transfer Mooncake stopped waiting on): they leave their parts at once, counted as a
        failed Put's pages are, so their keys can be stored again in other pages meanwhile, and
        stay being written, in no part and never evicted, until ``free_stash`` frees them."""
        p = self.pages
        ids = ids[(p.state[ids] == WRITING) & (p.part[ids] >= 0)]
        if not len(ids):
            return
        self._leave_parts(ids, evicted=False)
        p.index.remove(ids)
        p.part[ids] = -1

    @_locked
    def discard(self, ids: np.ndarray) -> None:
        """Frees committed pages found bad (a check of their bytes failed): they are no longer
        found, and count as neither stored nor evicted. A page another read or a pin still holds
        stays until a later discard (its check fails that read too)."""
        p = self.pages
        ids = ids[(p.state[ids] == COMMITTED) & (p.readers[ids] == 0) & (p.pins[ids] == 0)]
        self._drop(ids, evicted=False)

    def _reclaim(self, cls: tuple[int, int | None] | None, keep: tuple[int, int] | None = None) -> list[int]:
        """The data plane's stashes of ``cls`` (a tenant's pages of a size, of any size with None
        for it, or every one: None) given back (``on_reclaim``); the slabs left empty released at
        once, but those of class ``keep`` (about to be used): the slabs of ``keep`` they were in
        are returned."""
        sids = self.on_reclaim(cls) if self.on_reclaim is not None else []
        if not sids:
            return []
        mine = [s for s in set(sids) if s in self.slabs.slabs and self.slabs.slabs[s].cls == keep]
        self.slabs.release_empty(set(sids) - set(mine))
        return mine

    def _allocate(self, tenant: Tenant, page_bytes: int, want: int, evict: bool = True,
                  reclaim: str = "first") -> np.ndarray:
        """Up to ``want`` free pages of ``page_bytes`` in the tenant's slabs. It grows the class by
        whole slabs while the tenant's quota and the arena allow; short of that it takes back the
        data plane's stashes of the class (``reclaim`` "first"), then (``evict``) evicts the
        tenant's own least recently used pages of the class (then the stashes, "last"), then
        whole slabs (every stash given back first: a stash's pages keep their slabs; "never":
        none), least recently used first: the tenant's own when its quota binds, anyone's when
        the arena is full."""
        cls, quota = (tenant.tid, page_bytes), tenant.quota
        n = self.slabs.fitting(page_bytes, quota)
        if not n:
            return np.empty(0, np.int64)  # not one slab of these pages fits under its quota
        slab = self.slabs.shape(n, page_bytes)

        def grow() -> bool:
            """Grows the class toward ``want`` free pages; False if the quota stopped it."""
            while self.slabs.free_count(cls) < want:
                if quota and self.slabs.held(tenant.tid, quota, slab) > quota:
                    return False
                if not self.slabs.grow(cls, n):
                    return True
            return True

        under_quota = grow()
        kept: list[int] = []  # slabs emptied here, reused before being released
        short = want - self.slabs.free_count(cls)
        if short > 0 and reclaim == "first":
            kept += self._reclaim(cls, cls)
            short = want - self.slabs.free_count(cls)
        if short > 0 and not evict:
            return self.slabs.take(cls, want)
        if short > 0:  # the class's own least recently used pages, from its queue
            queue = self._queues.setdefault(cls, EvictionQueue())
            old = queue.pop(self.pages, lambda: self.slabs.pages_of(cls), tenant.tid, page_bytes, short)
            kept += self._drop(old, release_empty=False)
        if self.slabs.free_count(cls) < want and reclaim == "last":
            kept += self._reclaim(cls, cls)
        if self.slabs.free_count(cls) < want and reclaim != "never":
            # Every stash the slabs below may be taken from: anyone's while the arena is full,
            # the tenant's own when its quota binds (then no other tenant's memory is its).
            kept += self._reclaim(None if under_quota else (tenant.tid, None), cls)
            under_quota = grow()  # (the slabs they left empty were released)
        if self.slabs.free_count(cls) < want:
            # Other slabs, least recently used first, ranked once: evicting one slab changes no
            # other slab's pages, so the order holds for the whole Put (ranking again per slab made
            # a Put that evicts many slabs quadratic in the cache's pages).
            owner = {s: c[0] for c, sids in self.slabs.of_class.items() if c != cls
                     and (under_quota or c[0] == tenant.tid) for s in sids}
            ranked = lru_slabs(self.pages, list(owner))
            for sid in ranked.tolist():
                if not under_quota and owner[sid] != tenant.tid:
                    continue  # its quota binds now: another tenant's slab would give it nothing
                self._evict_slab(sid)
                under_quota = grow() and under_quota
                if self.slabs.free_count(cls) >= want:
                    break
        new = self.slabs.take(cls, want)
        self.slabs.release_empty(kept)
        return new

    # Get

    def prepare_get(self, part: Part, keys: Keys | Sequence[bytes], lease_id: str = "") -> GetPlan:
        """The longest stored prefix of ``keys``, marked as being read (see ``prepare_get_steps``)."""
        return run_steps(self.prepare_get_steps(part, keys, lease_id))

    @_locked_steps
    def prepare_get_steps(self, part: Part, keys: Keys | Sequence[bytes],
                          lease_id: str = "") -> Generator[None, None, GetPlan]:
        """``prepare_get`` in steps of at most ``STEP_KEYS`` keys; each step marks its pages as
        being read before the next runs, and a Get given up midway unmarks them."""
        keys = as_keys(keys)
        space = self._live(part.space)
        tenant = self.tenants.get(space.key.tenant)
        n, got = 0, []
        try:
            while n < len(keys):
                step = keys[n : n + STEP_KEYS]
                ids = self.pages.find(part.gid, step)
                m = leading((ids >= 0) & (self.pages.state[ids] == COMMITTED))
                self.pages.hold(ids[:m])
                got.append(ids[:m])
                n += m
                if m < len(step) or n == len(keys):
                    break
                yield
        except BaseException:
            for ids in got:
                self.pages.hold(ids, -1)
            raise
        ids = np.concatenate(got) if got else np.empty(0, np.int64)
        self._count(space, 0, len(keys) - n)
        lease = lease_id if lease_id and self.leases.holds(lease_id, tenant.name) else ""
        return GetPlan(part, n, self.pages.offset[ids], lease, ids)

    @_locked
    def prepare_get_packed(self, part: Part, packed: bytes, key_bytes: int) -> GetPlan | None:
        """``prepare_get`` of at most ``STEP_KEYS`` keys as a request packs them (``key_bytes``
        each, 1 to ``MAX_KEY_BYTES``, whole keys: the caller checks), without a lease: the walk,
        digests and holds in one compiled call (``PageTable.hold_hit``). None where the package
        has no compiled index (``prepare_get`` then)."""
        space = self._live(part.space)
        got = self.pages.hold_hit(part.gid, packed, key_bytes)
        if got is None:
            return None
        ids, offsets = got
        misses = len(packed) // key_bytes - len(ids)
        if misses:
            space.counters.misses += misses
            self.tenants.get(space.key.tenant).counters.misses += misses
        return GetPlan(part, len(ids), offsets, "", ids)

    @_locked
    def settle_get(self, ids: np.ndarray, part: Part | None, misses: int) -> None:
        """The end of a Get the data plane walked and held itself (kvserver/lane/csrc/cache.h):
        ``complete_get`` of its pages ``ids``, and its ``misses`` counted in ``part``'s space, as
        ``prepare_get_packed`` counts a Get's (none where its part is unknown)."""
        self.pages.hold(ids, -1)
        self.pages.touch(ids)
        if part is not None and misses:
            self._count(part.space, 0, misses)

    def settle_lookup(self, walked: Sequence[tuple[int, np.ndarray]], space: Space | None, found: int,
                      misses: int) -> None:
        """The end of a Lookup the data plane walked itself, in each part ``gid`` of ``walked``
        (one, or each of a whole space's) in turn: its pages ``ids`` there made recent (the first
        the most recent) and its hits and misses counted in ``space``, as ``lookup_packed`` does
        (none where it is unknown). A Lookup holds nothing: a page evicted since its walk is not
        touched (nor one that took its id meanwhile). Without the cache's lock: it changes only
        the pages' and slabs' stamps and the counters, which the plane's walk never reads (the
        loop, the only other reader, runs this itself; an engine's Lookup the plane walks writes
        the stamps too, by the same atomic ``kv_touch``), so the plane's next call, which comes
        about now, does not wait on it."""
        p = self.pages
        for gid, ids in walked:
            if len(ids):
                ids = ids[(p.state[ids] == COMMITTED) & (p.part[ids] == gid)]
            p.touch(ids)
        if space is not None and (found or misses):
            self._count(space, found, misses)

    def count_present(self, part: Part, n: int) -> None:
        """A Put of ``n`` keys that the data plane found all stored (nothing taken or copied):
        counted present, as ``prepare_put_present`` counts them (counters only: without the lock,
        as ``settle_lookup``). (Its space, as a settled call's,
        ``_count``: not registered again if it was dropped while empty.)"""
        self._count_present(part.space, n, part.key.page_bytes)

    def _count(self, space: Space, hits: int, misses: int) -> None:
        """A call's hits and misses in its space and tenant. The plane's calls, settled after
        the answer, count in their part's space as it is: one dropped while empty is not
        registered again for them (that would pass the tenant's limit of spaces, which the loop's
        own path would have refused), its counters count on, unseen until it is used."""
        for c in (space.counters, self.tenants.get(space.key.tenant).counters):
            c.hits += hits
            c.misses += misses

    @_locked
    def count_found_below(self, space: Space, n: int) -> None:
        """``n`` pages of a Lookup in ``space`` that a tier below host memory and the disk (the
        cluster) found, after ``lookup_steps`` counted them missed: hits, not misses."""
        self._count(space, n, -n)

    def _count_present(self, space: Space, n: int, page_bytes: int) -> None:
        """A Put's ``n`` keys found stored already (pages of ``page_bytes``), in its space and tenant."""
        for c in (space.counters, self.tenants.get(space.key.tenant).counters):
            c.dedup_pages += n
            c.dedup_bytes += n * page_bytes

    @_locked
    def complete_get(self, plan: GetPlan, ok: bool) -> None:
        ids, plan.page_ids = plan.page_ids, plan.page_ids[:0]
        self.pages.hold(ids, -1)
        self.pages.touch(ids)
        if plan.lease_id:  # this part's pins only: the other ranks' Gets may still come
            self.leases.end_part(plan.lease_id, plan.part.space.key.tenant, plan.part.gid)
            plan.lease_id = ""

    @_locked
    def hold(self, ids: np.ndarray, n: int = 1) -> None:
        """``PageTable.hold`` under the cache's lock: marks pages as being read (``n`` -1 undoes)."""
        self.pages.hold(ids, n)

    # Leases

    @_locked
    def release(self, tenant: str, lease_ids: Sequence[str]) -> int:
        return self.leases.release(tenant, lease_ids)

    @_locked_steps
    def release_steps(self, tenant: str, lease_ids: Sequence[str]) -> Generator[None, None, int]:
        """``release`` in steps (``LeaseTable.release_steps``)."""
        return (yield from self.leases.release_steps(tenant, lease_ids))

    def _still_held(self, lease_id: str, tenant: str) -> None:
        """NotFound if the lease a Lookup is pinning under ended between its steps (the
        registration that asked was released: ``release_owned``)."""
        if not self.leases.holds(lease_id, tenant):
            raise NotFound("the Lookup's lease ended while it ran: the registration that asked was "
                           "released")

    @_locked
    def release_owned(self, owner: str) -> int:
        """Ends the leases registration ``owner`` took (its release: a dead engine's pins go with
        it, not at their expiry)."""
        return self.leases.end_owned(owner)

    @_locked_steps
    def release_owned_steps(self, owner: str) -> Generator[None, None, int]:
        """``release_owned`` in steps (``LeaseTable.end_owned_steps``)."""
        return (yield from self.leases.end_owned_steps(owner))

    @_locked_steps
    def make_way_steps(self, tenant: str) -> Generator[None, None, None]:
        """Where ``tenant`` holds the most leases, ends every expired one, in steps
        (``LeaseTable.make_way_steps``): what a pinning Lookup's caller runs before its walk, whose
        lease check would otherwise end them in one go."""
        yield from self.leases.make_way_steps(tenant)

    @_locked
    def expire_leases(self) -> int:
        return self.leases.expire()

    @_locked_steps
    def expire_leases_steps(self) -> Generator[None, None, int]:
        """``expire_leases`` in steps (``LeaseTable.expire_steps``)."""
        return (yield from self.leases.expire_steps())

    # Eviction

    @_locked
    def make_room(self, nbytes: int) -> bool:
        """Makes the arena a free range of ``nbytes`` by evicting whole slabs (none holding a
        pinned, read or written page), least recently used first, but only those of one window of
        the arena: free ranges and such slabs side by side that hold ``nbytes``, the window whose
        most recent slab is the least recent of any window's (evicting least recently used slabs
        until one range held it would have evicted up to that slab), the fewest cached bytes among
        those. True if the arena then has the range; where no window holds it, nothing is evicted.
        Where the budget's charged bookkeeping still keeps the range, least recently used slabs
        go on being evicted, each giving its pages' bookkeeping back."""
        window = self._room_window(nbytes)
        if isinstance(window, bool):
            return window
        for sid in window[0]:
            self._evict_slab(sid)
        self._evict_lru(self.slabs.slabs, lambda: self.arena.largest_free() >= nbytes)
        return self.arena.largest_free() >= nbytes

    @_locked_steps
    def make_room_steps(self, nbytes: int, room: Room) -> Generator[None, None, bool]:
        """``make_room`` in steps of at most ``EVICT_STEP_PAGES`` pages, for a caller that lets
        others use the cache between two (a Register, on the loop). What it makes is held in
        ``room``: the window's free ranges at once (claiming the budget the window's slabs will not
        give back), each evicted slab's range as it goes, so that nothing else takes them
        meanwhile; the caller discards the slabs' memory and gives the room back (``Room``) where
        it reserves its region. The window's slabs are set aside from the
        start: no Put stores into them or evicts from them. Where the budget's charged bookkeeping
        would still keep the range once the room is given back, least recently used slabs go on
        being evicted into the room. False where no window holds ``nbytes``, or a page of the
        window was pinned or read meanwhile: it stops there, the slabs it did not evict kept."""
        window = self._room_window(nbytes)
        if isinstance(window, bool):
            return window
        sids, start, end = window
        # The budget the region needs besides what the window's slabs give back: what its free
        # ranges claim, so that others' use of the rest goes on meanwhile.
        besides = align_up(nbytes, REGION_ALIGN) - sum(align_up(self.slabs.slabs[s].nbytes, REGION_ALIGN)
                                                       for s in sids)
        for at, size in zip(*self.arena.free_ranges(), strict=True):
            if start <= at and at + size <= end:
                room.hold_free(at, size, besides - room.claimed)
        aside = [(slab, [self.slabs.set_aside(slab)]) for slab in map(self.slabs.slabs.__getitem__, sids)]
        try:
            for slab, cleared in aside:
                if not (yield from self._evict_slab_steps(slab, room, cleared)):
                    return False

            def enough() -> bool:  # once the room is given back (its ranges unreserved, claims back)
                back = room.released + room.claimed
                return (self.arena.available + back) // REGION_ALIGN * REGION_ALIGN >= nbytes

            for sid in lru_slabs(self.pages, self.slabs.slabs).tolist() if not enough() else ():
                slab = self.slabs.slabs.get(sid)
                if enough():
                    break
                if slab is None or self.pages.slab_holds[sid] > 0 or self.pages.slab_leaving[sid]:
                    continue  # gone, used or set aside since
                aside.append((slab, [self.slabs.set_aside(slab)]))
                yield from self._evict_slab_steps(slab, room, aside[-1][1])
            return enough()
        finally:
            for slab, cleared in aside:
                if self.slabs.slabs.get(slab.sid) is slab:  # (not evicted: kept)
                    self.slabs.put_back(slab, np.concatenate(cleared))

    def _evict_slab_steps(self, slab: Slab, room: Room,
                          cleared: list[np.ndarray]) -> Generator[None, None, bool]:
        """Evicts ``slab`` (set aside) into ``room``, ``EVICT_STEP_PAGES`` of its pages a step, the
        pages it clears added to ``cleared``. False if a page of it was pinned or read between
        two steps; True once it is gone (evicted here, or released meanwhile with its range)."""
        while self.slabs.slabs.get(slab.sid) is slab:
            if self.pages.slab_holds[slab.sid] > 0:
                return False
            held = slab.pages[self.pages.state[slab.pages] == COMMITTED]
            chunk = held[:EVICT_STEP_PAGES]
            self._drop(chunk, give=False)
            cleared.append(chunk)
            last = len(chunk) == len(held)
            if last:  # in the same step: never left whole free, for anyone else to release (its
                self.slabs.release([slab.sid], room)  # memory given back on the loop)
            yield
            if last:
                break
        return True

    @_locked
    def evict_all(self) -> int:
        """Evicts every slab none of whose pages is pinned, read or written (what a disk tier
        holds stays there); returns how many."""
        self._reclaim(None)
        sids = lru_slabs(self.pages, self.slabs.slabs).tolist()
        for sid in sids:
            self._evict_slab(sid)
        return len(sids)

    def _room_window(self, nbytes: int) -> tuple[list[int], int, int] | bool:
        """What ``make_room`` evicts for ``nbytes``: True where the arena has the range (the data
        plane's stashes given back first if need be), False where no window holds it, else the
        window (``_eviction_window``)."""
        if self.arena.largest_free() >= nbytes:
            return True
        self._reclaim(None)  # (their slabs released where left empty)
        if self.arena.largest_free() >= nbytes:
            return True
        return self._eviction_window(nbytes) or False

    def _eviction_window(self, nbytes: int) -> tuple[list[int], int, int] | None:
        """The evictable slabs of ``make_room``'s window, least recent first, and the window's
        first and end offsets; None if none holds ``nbytes``. Free ranges and evictable slabs are
        laid out by address; anything else (a client's region, a busy slab) ends a run of them.
        Vectorised: a pass over slabs and ranges for each step of a binary search over how recent
        a slab may be."""
        sids = lru_slabs(self.pages, self.slabs.slabs)  # least recent first
        slabs = self.slabs.slabs
        starts, sizes = self.arena.free_ranges()
        at = np.array(starts + [slabs[s].offset for s in sids.tolist()], dtype=np.int64)
        size = np.array(sizes + [slabs[s].nbytes for s in sids.tolist()], dtype=np.int64)
        rank = np.concatenate([np.full(len(starts), -1, np.int64), np.arange(len(sids), dtype=np.int64)])
        order = np.argsort(at, kind="stable")
        at, size, rank = at[order], size[order], rank[order]

        def cheapest(limit: int) -> np.ndarray | None:
            """Ranks of the slabs of the cheapest window of free ranges and slabs of rank below
            ``limit``, None if no such window holds ``nbytes``."""
            keep = rank < limit
            a, n, r = at[keep], size[keep], rank[keep]
            if not len(a):
                return None
            run = np.concatenate([[0], np.cumsum(a[1:] != a[:-1] + n[:-1])])  # runs of neighbours
            end = np.cumsum(n)  # bytes of items 0..i
            spent = np.cumsum(np.where(r >= 0, n, 0))
            j = np.searchsorted(end, end - n + nbytes, side="left")  # the window from i ends at j
            ok = (j < len(a)) & (run[np.minimum(j, len(a) - 1)] == run)
            if not ok.any():
                return None
            first = np.flatnonzero(ok)
            last = j[ok]
            best = int(np.argmin(spent[last] - spent[first - 1].clip(0) * (first > 0)))
            i, j = int(first[best]), int(last[best])
            picked = r[i: j + 1]
            return np.sort(picked[picked >= 0]), int(a[i]), int(a[j] + n[j])

        best = cheapest(len(sids))
        if best is None:
            return None
        lo, hi = 0, len(sids)  # the least limit with a window: in [lo, hi], ``best`` hi's
        while lo < hi:
            mid = (lo + hi) // 2
            found = cheapest(mid)
            if found is None:
                lo = mid + 1
            else:
                hi, best = mid, found
        ranks, start, end = best
        return sids[ranks].tolist(), start, end

    def _book_pins(self, name: str, nbytes: int, spare: np.ndarray) -> bool:
        """Books ``nbytes`` of the bookkeeping of tenant ``name``'s new pins: charged to the arena
        and to the tenant, as its pages' bookkeeping is (``SlabPool.held``). Short of room it
        evicts whole slabs, least recently used first, none holding a page of ``spare``, as a
        Put's pages would: the tenant's own while its quota binds, then anyone's while the arena
        is full. False, nothing booked, where that is not enough."""
        tenant = self.tenants.get(name)
        quota = tenant.quota

        def over_quota() -> bool:
            return bool(quota) and self.slabs.held(tenant.tid, quota, (0, nbytes)) > quota

        if over_quota() or not self.arena.can_book(nbytes):
            self.pages.hold(spare)  # busy: their slabs are not evicted
            try:
                if over_quota():  # its own memory only: none of another tenant's is its
                    self._reclaim((tenant.tid, None))
                    self._evict_lru(self._tenant_slabs(tenant.tid), lambda: not over_quota())
                if not over_quota() and not self.arena.can_book(nbytes):
                    self._reclaim(None)
                    self._evict_lru(self.slabs.slabs, lambda: self.arena.can_book(nbytes))
            finally:
                self.pages.hold(spare, -1)
        if over_quota() or not self.arena.book(nbytes):
            return False
        self.slabs.charge(tenant.tid, nbytes)
        return True

    def _unbook_pins(self, name: str, nbytes: int) -> None:
        self.arena.unbook(nbytes)
        self.slabs.charge(self.tenants.get(name).tid, -nbytes)

    def _tenant_slabs(self, tid: int) -> list[int]:
        return [s for (t, _), sids in self.slabs.of_class.items() if t == tid for s in sids]

    def _evict_lru(self, sids: Collection[int], enough: Callable[[], bool]) -> None:
        """Evicts slabs of ``sids`` (those none of whose pages is pinned, read or written), least
        recently used first, until ``enough()``."""
        for sid in lru_slabs(self.pages, sids).tolist():
            if enough():
                return
            self._evict_slab(sid)

    def _evict_slab(self, sid: int) -> None:
        slab = self.slabs.slabs[sid]
        held = slab.pages[self.pages.state[slab.pages] == COMMITTED]
        self._drop(held, release_empty=False)
        self.slabs.release([sid])

    def _tell(self, stored: bool, space: Space, keys: Keys, changed: np.ndarray) -> None:
        if self.on_complete and changed.any():
            keys = keys if changed.all() else keys.take(np.flatnonzero(changed))
            for listener in self.on_complete:
                try:
                    listener(stored, space, keys)
                except Exception:  # a listener never leaves the index half changed
                    logger.exception("a listener of the %s failed", self.what)

    def _drop(self, ids: np.ndarray, evicted: bool = True, release_empty: bool = True,
              give: bool = True) -> list[int]:
        """Frees pages (committed, or being written for a failed Put): their keys leave their
        parts' indexes and their bytes their counters. Returns the slabs they belong to (with
        ``give`` False the pages are left out of their slabs' free lists: none)."""
        if not len(ids):
            return []
        self._leave_parts(ids, evicted)
        self.pages.clear(ids)
        if not give:
            return []
        return self.slabs.give(ids, release_empty=release_empty)

    def _leave_parts(self, ids: np.ndarray, evicted: bool) -> None:
        """Pages' keys told gone (KV events: the committed ones) and their bytes out of their
        parts', spaces' and tenants' counters."""
        gids = self.pages.part[ids]
        if (gids == gids[0]).all():  # one part (a Put's eviction, mostly): no grouping to do
            groups = [(int(gids[0]), ids)]
        else:
            order = np.argsort(gids, kind="stable")
            uniq, starts = np.unique(gids[order], return_index=True)
            groups = zip(uniq.tolist(), np.split(ids[order], starts[1:]), strict=True)
        for gid, chunk in groups:
            part = self._parts[gid]
            committed = chunk[self.pages.state[chunk] == COMMITTED]
            keys = self.pages.keys_of(committed)
            self._tell(False, part.space, keys, part.space.complete.removed(keys))
            part.pages -= len(chunk)
            tenant = self.tenants.get(part.space.key.tenant)
            for c in (part.space.counters, tenant.counters):
                c.pages -= len(chunk)
                c.bytes -= len(chunk) * part.key.page_bytes
                if evicted:
                    c.evictions += len(chunk)

    # Stats

    def stats(self, tenant: str | None = None) -> tuple[list[SpaceStat], list[TenantStat]]:
        spaces = [s for s in self._spaces.values() if tenant is None or s.key.tenant == tenant]
        names = list(self.tenants.by_name) if tenant is None else [tenant]
        space_stats = [
            SpaceStat(s.key, replace(s.counters), len(s.parts), s.key.num_parts, s.complete.value)
            for s in spaces
        ]
        tenant_stats = []
        for name in names:
            t = self.tenants.by_name.get(name)
            if t is None:
                tenant_stats.append(TenantStat(name, CacheCounters(), self.tenants.quota_of(name)))
            else:
                tenant_stats.append(TenantStat(name, replace(t.counters), t.quota))
        return space_stats, tenant_stats
