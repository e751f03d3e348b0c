"""The node-wide cache's operations as the daemon serves them: whose space a call is in, the whole
request checked before the cache changes, and the copy jobs of Put and Get. No gRPC.

The index (``kvserver.store``) decides which pages; the copier moves the bytes. A Put's new pages
stay invisible, and a Get's pages stay marked as being read, until the copy is really over (the
job's ``on_settled``), not when its call ends: a copy the daemon could not stop yet still owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

import numpy as np

from kvserver.cluster.tier import QUARANTINE_SECONDS
from kvserver.copies import transfer
from kvserver.core.client_state import ClientSpec, ClientState, check_model_shape
from kvserver.core.copier import INLINE_COPY_BYTES, ClientJob, LoadStep
from kvserver.core.kvcore import KVCore
from kvserver.core.share import LoopShare, in_steps
from kvserver.errors import (
    InvalidArgument,
    JobStopped,
    KVError,
    NoCapacity,
    NotFound,
    OutOfRange,
    Unavailable,
)
from kvserver.events import LoggedEvent
from kvserver.events.book import MAX_READ_KEYS
from kvserver.peers.tenants import TenantBook
from kvserver.protocol.layout import KVLayout, kv_dtype
from kvserver.store import (
    MAX_KEY_BYTES,
    MAX_PIN_MS,
    Found,
    GetPlan,
    Keys,
    KVCache,
    Part,
    PartKey,
    PutPlan,
    Space,
    SpaceKey,
)
from kvserver.store.cache import PACKED_STEP_PAIRS
from kvserver.store.keys import WORD_BYTES, leading
from kvserver.store.pages import COMMITTED, WRITING
from kvserver.store.steps import STEP_KEYS, run_steps
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger(__name__)

# Host memory that pages of failed cluster pulls may hold out of use, at most: past it, a Get's
# pull from the cluster is a miss until some of them are free again.
MAX_QUARANTINED_SHARE = 1 / 16
# Host memory that pages of cluster pulls under way and of failed ones (out of use) hold together,
# at most: a Get pulls no more than what that leaves, so that a stalled peer's pulls, which may
# all end out of use, take at most this much of the node's own cache.
MAX_PULLING_SHARE = 1 / 4
# A Lookup's question to the cluster ends this long (at most a tenth of its timeout_ms) before the
# Lookup's own timeout: the time to answer with what host memory and the disk found.
CLUSTER_ANSWER_MARGIN = 0.05
T = TypeVar("T")

MAX_SPACE_IDS = 1 << 16  # space handles the daemon keeps (one per tenant and space)
FORGET_STEP = 4096  # space handles looked at in one step, once they are MAX_SPACE_IDS
MAKE_WAY_PASSES = 4  # passes over the expired leases a pinning Lookup at its tenant's limit makes first
# Keys in one Lookup, Put or Get (2 Mi tokens in pages of 16): their bookkeeping runs on the event
# loop, so a request is bounded to what the loop can do in a small fraction of a second.
MAX_CACHE_KEYS = 1 << 17
MAX_GET_PARTS = 1024  # Gets in one GetRequest (GetRequest.parts)
# A Put's new pages committed in one step of the loop once their copy is over (``_settled``).
SETTLE_PAGES = 2048
_FEW = 8  # device pages a request may name for their checks to run in plain Python
# The kinds of the data plane's ends besides a Get's (take_gets): a Lookup, a Put of stored keys,
# a Lookup of host memory only (memory_only: no tier's copies made recent), a Put the plane stored.
_END_LOOKUP, _END_PUT, _END_LOOKUP_HOST, _END_STORE = 1, 2, 3, 4
# The free cache pages set aside for the Puts the data plane stores whole (``_refill``), per size
# class (a tenant's pages of one size: its TP ranks', its PP stages' of equal layers): at most
# STASH_BYTES bytes, a 32nd of host memory and a 16th of the tenant's quota, shared among the
# class's registrations that Put, each at most STASH_PAGES pages. A Put of more keys than a
# registration's share is the loop's, as before.
# KVSERVER_PLANE_PUTS=0 sets no page aside: every Put of new pages is the loop's (the plane still
# copies it), as before the plane stored them.
STASH_PAGES = 256 if os.environ.get("KVSERVER_PLANE_PUTS", "1") != "0" else 0
STASH_BYTES = 32 << 20
# The most (key, part) pairs a whole-space Lookup the data plane answers walks, all under one hold
# of the cache's lock (the loop's own step of one walks up to STEP_KEYS keys of every part): a space
# of up to 8 parts, a step's keys; more parts, fewer keys (a longer one is the loop's, in steps).
PLANE_SPACE_PAIRS = 2 * PACKED_STEP_PAIRS
_PLANE_REFUSED = "the data plane did not take the copy (the daemon is stopping, or out of memory): retry"


class PlaneCalls(NamedTuple):
    """Whose calls a gate given a token serves on the data plane (``_serve_on_plane``,
    ``serve_space_on_plane``): a registration's, in its part; or a scheduler's Lookups of a whole
    space on the space's lane (``space``: ``owner`` is the space id, ``parts`` every part, whose
    references keep the same Space object, with the same parts, for as long as the gate serves)."""

    owner: str
    parts: tuple[Part, ...]
    gate: Any
    space: bool = False


@dataclass(frozen=True, slots=True)
class PutOutcome:
    stored: int
    present: int
    dropped: int
    bytes: int


def space_key(tenant: str, spec: ClientSpec) -> SpaceKey:
    return SpaceKey(tenant, spec.model, spec.layout, spec.dtype, spec.page_size, spec.num_layers,
                    spec.tp_size, spec.pp_size, spec.weights)


def space_from_wire(tenant: str, msg: pb.KVSpace) -> SpaceKey:
    """The space a scheduler names, checked as a registration's fields are."""
    if not msg.model or len(msg.model) > 256:
        raise InvalidArgument("space.model must be set, at most 256 characters")
    if len(msg.weights) > 256:
        raise InvalidArgument(f"space.weights is {len(msg.weights)} characters; at most 256")
    if msg.page_size == 0 or msg.page_size > 4096:
        raise InvalidArgument(f"space.page_size must be in [1, 4096], got {msg.page_size}")
    if msg.num_layers == 0:
        raise InvalidArgument("space.num_layers must be at least 1")
    if msg.dtype == pb.DTYPE_UNSPECIFIED:
        raise InvalidArgument("space.dtype must be set")
    tp_size, pp_size = max(msg.tp_size, 1), max(msg.pp_size, 1)
    check_model_shape(tp_size, pp_size, msg.num_layers, "space ")
    return SpaceKey(tenant, msg.model, KVLayout.from_wire(msg.layout), kv_dtype(msg.dtype), msg.page_size,
                    msg.num_layers, tp_size, pp_size, msg.weights)


def cache_table(arena_address: int, spec: ClientSpec) -> transfer.BufferTable:
    """Where (layer, part) of a cached page of this client's part starts, relative to the page's
    arena offset: rows are byte offsets (row_stride 1), the page laid out as a region's page."""
    parts = spec.layout.num_parts
    chunk = spec.page_size * spec.token_bytes
    bases = np.array([[arena_address + (layer * parts + part) * chunk for part in range(parts)]
                      for layer in range(len(spec.layers))], dtype=np.uint64)
    return transfer.BufferTable(bases=bases, row_stride=1, row_bytes=spec.token_bytes)


class CacheOps:
    def __init__(self, kv: KVCore, tenants: TenantBook | None = None) -> None:
        self.cache: KVCache = kv.cache
        self.kv = kv
        self.tenants = tenants or TenantBook()
        self._max_keys = min(MAX_CACHE_KEYS, kv.max_request_indices)
        self._space_ids: dict[str, SpaceKey] = {}
        self._ids_of: dict[SpaceKey, str] = {}
        self._put_settled: asyncio.Future[None] | None = None  # done when a Put's copy settles next
        self.disk = kv.disk  # the tier under the host cache, or None
        self.cluster = kv.cluster  # the tier shared with other nodes, or None
        self._quarantined_bytes = 0  # host pages of failed pulls kept out of use (QUARANTINE_SECONDS)
        self._pulling_bytes = 0  # host pages taken for pulls from the cluster under way
        self.lower = self.disk.holds if self.disk is not None else None
        self.lookups_now = 0  # lane Lookups the loop served without a task (lookup_now; not the plane's)
        # Lane calls served whole on the data plane's thread (``_serve_on_plane``,
        # ``serve_space_on_plane``): each gate's token -> whose they are, for their ends
        # (``plane_get_ended``); the bytes of each Get done, for the transfer metrics.
        self._plane_gets: dict[int, PlaneCalls] = {}
        self._plane_kept = 0  # tokens kept by the last prune (``_prune_plane_calls``)
        self._plane_tokens = itertools.count(1)
        self.on_plane_get: Callable[[int], None] | None = None
        self.on_plane_put: Callable[[int, int], None] | None = None  # bytes, Puts
        # The registrations that Put on the plane (token -> size class): a class's stash is
        # shared among them (``_stash_pages``).
        self._stashers: dict[int, tuple[int, int]] = {}
        kv.on_gate_closed = self._gate_closed
        kv.on_plane_lookups = self.plane_lookups_counted
        self.cache.on_reclaim = self._reclaim

    # ---- who is asking ----------------------------------------------------------------------

    def _part(self, client: ClientState) -> Part:
        if client.part_keys is None:  # a registration's tenant and spec never change
            spec = client.spec
            shard = 0 if spec.layout.is_mla else spec.tp_rank
            part = PartKey(shard, spec.pp_rank, spec.layers.start, spec.layers.end, spec.page_bytes)
            client.part_keys = (space_key(client.tenant, spec), part)
        space, part = client.part_keys
        return self.cache.part(self.cache.space(space), part)

    async def open_space(self, space: SpaceKey) -> str:
        made = self.cache.find_space(space) is None
        self.cache.space(space)  # the tenant's space limit applies here too (its empty ones dropped)
        sid = self._ids_of.get(space)
        if sid is None:
            if len(self._space_ids) >= MAX_SPACE_IDS:
                await in_steps(self.kv.share, self._forget_empty_ids_steps())
                sid = self._ids_of.get(space)  # (another OpenSpace of it, meanwhile)
            if sid is None:
                if len(self._space_ids) >= MAX_SPACE_IDS:
                    if made:  # refused: the space it registered goes again (while still empty)
                        self.cache.drop_if_empty(space)
                    raise NoCapacity(f"the daemon holds {MAX_SPACE_IDS} space handles; none is free")
                sid = secrets.token_hex(16)
                self._space_ids[sid] = space
                self._ids_of[space] = sid
        return sid

    def _forget_empty_ids_steps(self) -> Generator[None, None, None]:
        """Forgets the ids of spaces dropped while empty, ``FORGET_STEP`` ids a step: looking at
        all 64 Ki in one go held the event loop 84 ms."""
        ids = list(self._space_ids)
        for at in range(0, len(ids), FORGET_STEP):
            if at:
                yield
            forgotten = set()
            for sid in ids[at : at + FORGET_STEP]:
                key = self._space_ids.get(sid)
                if key is not None and self.cache.find_space(key) is None:
                    del self._space_ids[sid], self._ids_of[key]
                    forgotten.add(sid)
            # In the same step (a call given up between two leaves no id forgotten with its lane
            # still answered on the plane), the gates of its lanes as they are now:
            plane = self.kv.copier.plane
            if forgotten and plane is not None:
                for calls in self._plane_gets.values():
                    if calls.space and calls.owner in forgotten:
                        plane.close_gate(calls.gate)  # its lane's Lookups are the loop's: NotFound, as gRPC's

    def space_tenant(self, space_id: str) -> str:
        """The tenant of an open space's id; NotFound for an id this daemon does not know."""
        return self._space(space_id).tenant

    def _space(self, space_id: str) -> SpaceKey:
        key = self._space_ids.get(space_id)
        if key is None:
            raise NotFound("unknown space_id: open the space again (the daemon may have restarted)")
        return key

    def _target(self, client_id: str, space_id: str) -> tuple[str, ClientState | None, SpaceKey | None]:
        if bool(client_id) == bool(space_id):
            raise InvalidArgument("give exactly one of client_id (an engine) and space_id (a scheduler)")
        if client_id:
            client = self.kv.client(client_id)
            return client.tenant, client, None
        key = self._space(space_id)
        return key.tenant, None, key

    # ---- Lookup and Release -----------------------------------------------------------------

    async def lookup(self, req: pb.LookupRequest) -> Found:
        # The cluster's question ends a little before the Lookup's own timeout (which the servicer
        # bounds), so that the pages found here are answered, not DEADLINE_EXCEEDED.
        margin = min(CLUSTER_ANSWER_MARGIN, req.timeout_ms / 10_000)
        until = self.kv.deadline(req.timeout_ms) - margin if req.timeout_ms else 0.0
        tenant, client, key = self._target(req.client_id, req.space_id)
        if req.pin_ms > MAX_PIN_MS:
            raise InvalidArgument(f"pin_ms is {req.pin_ms}; at most {MAX_PIN_MS}")
        target = self._packed_target(req, client, key)  # compiled walks, where they can be
        keys: Keys | None = None
        if target is not None:
            if self._one_packed_step(req, target):
                found = self.cache.lookup_packed(target, req.keys, req.key_bytes)
            else:
                found = await in_steps(self.kv.share, self.cache.lookup_packed_steps(target, req.keys,
                                                                                     req.key_bytes))
        else:
            keys = await in_steps(self.kv.share, Keys.unpack_steps(req.keys, req.key_bytes, self._max_keys))
            leases, passes = self.cache.leases, MAKE_WAY_PASSES
            while passes and req.pin_ms and len(keys) and leases.at_limit(tenant) and leases.any_expired():
                # A tenant at its lease limit: expired leases end first, in steps (again, for those
                # that expired while the others ended; a few times at most, as others' keep coming).
                await in_steps(self.kv.share, self.cache.make_way_steps(tenant))
                passes -= 1
            if client is not None:  # still registered after the steps: else its lease would outlive it
                self.kv.client(client.client_id)
            target = self._lookup_target(client, key, req)
            lower = None if req.memory_only else self.lower
            owner = client.client_id if client is not None else ""
            found = await in_steps(self.kv.share,
                                   self.cache.lookup_steps(target, keys, req.pin_ms, lower, owner))
            if self.disk is not None:
                self.disk.counters.hits += found.lower
        asked = len(keys) if keys is not None else len(req.keys) // req.key_bytes
        if self.cluster is not None and not req.memory_only and found.pages < asked:
            if keys is None:
                keys = Keys.unpack(req.keys, req.key_bytes, self._max_keys)
            # The rest of the prefix, from the cluster: one batched question, within its deadline.
            parts = self.cache.parts_of(target)[1]
            try:
                more = await self.cluster.count(parts, keys[found.pages:], until)
            except BaseException:  # given up (its deadline, a cancelled call): its lease ends too
                if found.lease_id:
                    self.cache.release(tenant, [found.lease_id])
                raise
            if more:
                self.cache.count_found_below(self.cache.parts_of(target)[0], more)
                found = found._replace(pages=found.pages + more, cluster=more)
        return found

    def _lookup_target(self, client: ClientState | None, key: SpaceKey | None,
                       req: pb.LookupRequest) -> Part | Space:
        target: Part | Space
        if client is not None:
            part = self._part(client)
            target = part.space if req.whole_space else part
        else:
            target = self.cache.space(key)
        if isinstance(target, Space) and self.disk is not None and not req.memory_only:
            for part_key in self.disk.part_keys(target.key):  # parts host memory has no page of
                try:
                    self.cache.part(target, part_key)
                except KVError:  # another shape under the same rank: its pages are not this space's
                    pass
        return target

    def _packed_target(self, req: pb.LookupRequest, client: ClientState | None,
                       key: SpaceKey | None) -> Part | Space | None:
        """The target of a Lookup that compiled walks from its packed keys can answer (no lease,
        no tier below: ``KVCache.lookup_packed_steps``, the same hits, counters and touch as
        ``lookup_steps``), its keys checked; None where it is not one, or where the keys' checks
        refuse it (``lookup_steps``' path gives the error)."""
        key_bytes, packed = req.key_bytes, req.keys
        if (req.pin_ms or (self.lower is not None and not req.memory_only)
                or not 1 <= key_bytes <= MAX_KEY_BYTES or len(packed) % key_bytes
                or len(packed) // key_bytes > self._max_keys or not self.cache.pages.compiled):
            return None
        return self._lookup_target(client, key, req)  # (no tier below here: it changes nothing)

    def _one_packed_step(self, req: pb.LookupRequest, target: Part | Space) -> bool:
        """Whether a Lookup's compiled walk is one step (``KVCache.packed_step_keys``, never fewer
        than ``STEP_KEYS`` keys: asked first, as nearly every Lookup is that short)."""
        n = len(req.keys) // req.key_bytes
        return n <= STEP_KEYS or n <= self.cache.packed_step_keys(target)

    def lookup_now(self, req: pb.LookupRequest) -> Found | None:
        """``lookup`` all of it now, for a lane Lookup served without a task: the same checks and
        steps, run at once where they are one step (``KVCache.packed_step_keys`` keys of a compiled
        walk, else ``STEP_KEYS``). None where it is not one that runs whole at once, or where the
        checks refuse it (``lookup`` serves it, and gives the error): more keys than a step holds,
        a cluster to ask."""
        try:
            tenant, client, key = self._target(req.client_id, req.space_id)
            if req.pin_ms > MAX_PIN_MS:
                return None  # (lookup words it)
            if (client is not None and not req.whole_space and not req.pin_ms and self._plane_pending(client)
                    and self._keys_fit(req.keys, req.key_bytes)):
                self._serve_on_plane(client)  # (the plane takes its next ones)
            if self.cluster is not None:
                return None  # ``lookup`` asks it for what host memory and the disk miss
            if req.pin_ms and self.cache.leases.at_limit(tenant):
                return None  # ``lookup`` ends the tenant's expired leases first, in steps
            target = self._packed_target(req, client, key)  # it checks the keys first
            found = None
            if target is not None:
                if not self._one_packed_step(req, target):
                    return None  # more than a step: ``lookup`` walks it in steps
                found = self.cache.lookup_packed(target, req.keys, req.key_bytes)
            if found is None:  # the keys checked before the target is taken: a refused one changes nothing
                if len(req.keys) > STEP_KEYS * max(1, req.key_bytes):
                    return None
                keys = Keys.unpack(req.keys, req.key_bytes, self._max_keys)
                target = self._lookup_target(client, key, req)
                lower = None if req.memory_only else self.lower
                owner = client.client_id if client is not None else ""
                found = run_steps(self.cache.lookup_steps(target, keys, req.pin_ms, lower, owner))
        except KVError:  # refused: ``lookup`` serves it, and gives the error
            return None
        if self.disk is not None:
            self.disk.counters.hits += found.lower
        self.lookups_now += 1
        return found

    def events(self, req: pb.EventsRequest) -> tuple[str, list[LoggedEvent], int, bool]:
        """The events of the caller's space after ``req.after_seq`` (``EventBook.read``)."""
        _, client, key = self._target(req.client_id, req.space_id)
        if client is not None:
            key = space_key(client.tenant, client.spec)
        assert key is not None
        return self.kv.events.read(key, req.log_id, req.after_seq, req.max_keys or MAX_READ_KEYS)

    async def release(self, req: pb.ReleaseRequest) -> int:
        tenant, _, _ = self._target(req.client_id, req.space_id)
        if len(req.lease_ids) > 4096:
            raise InvalidArgument(f"{len(req.lease_ids)} leases in one Release; at most 4096")
        return await in_steps(self.kv.share, self.cache.release_steps(tenant, list(req.lease_ids)))

    # ---- Put and Get --------------------------------------------------------------------------

    async def _checked(self, client: ClientState, packed: bytes, key_bytes: int, device_pages,
                       ready_event: bytes, event_slot: int) -> tuple[Keys, np.ndarray]:
        keys = await in_steps(self.kv.share, Keys.unpack_steps(packed, key_bytes, self._max_keys))
        self.kv.client(client.client_id)  # still registered after the steps (its pool still open)
        return keys, self._checked_pages(client, len(keys), device_pages, ready_event, event_slot)

    def _checked_pages(self, client: ClientState, n: int, device_pages, ready_event: bytes,
                       event_slot: int) -> np.ndarray:
        """The device pages of ``n`` keys (a request's repeated field, or an array), checked against
        the client's pool."""
        few: list[int] | None = None
        if n <= _FEW and len(device_pages) == n:
            # A few pages: plain Python is several times cheaper than numpy's calls (reading a
            # protobuf field into an array among them).
            few = [int(page) for page in device_pages]
            pages = np.array(few, np.int64)
        else:
            pages = transfer.as_indices(device_pages, "device page")
        if pages.size != n:
            raise InvalidArgument(f"{n} keys but {pages.size} device pages; they must pair up")
        device = client.device
        device.check_request(ready_event, event_slot)
        device.check_cache_rows()
        if n:
            if few is not None:
                lo, hi, repeats = min(few), max(few), len(set(few)) < n
            else:
                lo, hi, repeats = int(pages.min()), int(pages.max()), None
            if lo < 0 or hi >= device.num_pages:
                raise OutOfRange(f"device page {lo if lo < 0 else hi} is outside the device pool of "
                                 f"{device.num_pages} pages ({device.num_tokens} tokens)")
            if repeats if repeats is not None else transfer.has_repeats(pages):
                raise InvalidArgument("device pages name the same page more than once")
        device.check_sizes()
        return pages

    def _job(self, client: ClientState, offsets: np.ndarray, device_pages: np.ndarray,
             local_layers: list[int],
             ready_event: bytes, event_slot: int, deadline: float) -> ClientJob:
        paged = client.device.paged
        plan = transfer.CopyPlan(offsets, device_pages, paged, client.spec.page_size, of_pages=not paged)
        return ClientJob(client, plan, local_layers, np.empty(0, dtype=np.int64), bytes(ready_event),
                         event_slot, deadline, host_table=self._cache_table(client))

    def _cache_table(self, client: ClientState) -> transfer.BufferTable:
        if client.cache_table is None:
            client.cache_table = cache_table(self.kv.arena.address, client.spec)
        return client.cache_table

    async def put(self, req: pb.PutRequest) -> PutOutcome:
        client = self.kv.client(req.client_id)
        deadline = self.kv.deadline(req.timeout_ms)
        keys, pages = await self._checked(client, req.keys, req.key_bytes, req.device_pages,
                                          req.ready_event, 0)
        return await self._store(client, self._part(client), keys, pages, req.ready_event, deadline, True)

    async def _store(self, client: ClientState, part: Part, keys: Keys, pages: np.ndarray,
                     ready_event: bytes, deadline: float, again: bool) -> PutOutcome:
        """Stores the pages of ``keys`` not yet stored. Keys another Put is still writing count
        once that copy is over: present if it stored them; if it failed, stored here (``again``)
        or else reported not stored. A Put reports stored only what is."""
        plan = await in_steps(self.kv.share, self.cache.prepare_put_steps(part, keys))
        n = plan.positions.size
        waiting = plan.waiting
        if n == 0:
            self.cache.complete_put(plan, True)
            own = PutOutcome(0, plan.present, plan.dropped, 0)
        else:
            try:
                self.kv.client(client.client_id)  # released during the steps: its pool may be closed
                job = self._job(client, plan.offsets, pages[plan.positions], client.spec.layers.select([]),
                                ready_event, 0, deadline)
            except BaseException:
                self.cache.complete_put(plan, False)
                raise
            settling: list[asyncio.Task | None] = []
            job.on_settled = lambda ok: settling.append(self._settled(plan, ok))
            try:
                nbytes = await self.kv.copier.write(job)
            finally:
                if not job.submitted:  # it never reached the medium, so nothing will settle it
                    self._settled(plan, False)
            for task in settling:  # its pages committed in steps: answered once they all are
                if task is not None:
                    with contextlib.suppress(Exception):  # (settled all the same: logged there)
                        await asyncio.shield(task)
            own = PutOutcome(n, plan.present, plan.dropped, nbytes)
        if not len(waiting):
            return own
        sub = keys.take(waiting)
        await self._until_written(part, sub, deadline)
        if not again:  # what is still not stored (written again by yet another Put) is not counted
            ids = self.cache.pages.find(part.gid, sub)
            present = int(np.count_nonzero(self.cache.pages.state[ids[ids >= 0]] == COMMITTED))
            out = PutOutcome(own.stored, own.present + present, own.dropped + len(waiting) - present,
                             own.bytes)
        else:
            try:
                more = await self._store(client, part, sub, pages[waiting], ready_event, deadline, False)
            except JobStopped as exc:  # (its deadline, say) its own pages stand: these are not stored
                logger.debug("a Put's copy of %d keys another Put failed to store stopped: %s", len(sub), exc)
                more = PutOutcome(0, 0, len(sub), 0)
            out = PutOutcome(own.stored + more.stored, own.present + more.present,
                             own.dropped + more.dropped, own.bytes + more.bytes)
        return out if out.dropped == own.dropped else self._as_prefix(part, keys, out)

    def _as_prefix(self, part: Part, keys: Keys, out: PutOutcome) -> PutOutcome:
        """``out`` of a Put some of whose keys another Put was writing, one of which is not stored
        after all: the keys from where the part's stored prefix ends on count dropped, so that
        dropped keys are the last ones (the leading ones less them are what the part holds)."""
        ids = self.cache.pages.find(part.gid, keys)
        held = leading((ids >= 0) & (self.cache.pages.state[ids] == COMMITTED))
        dropped = max(out.dropped, len(keys) - held)
        stored = min(out.stored, len(keys) - dropped)
        return PutOutcome(stored, len(keys) - dropped - stored, dropped, out.bytes)

    def _settled(self, plan: PutPlan, ok: bool) -> asyncio.Task | None:
        """A Put's copy is over (``ok``: whole): its new pages are committed, or freed, with the
        tiers' hooks. Those of a Put of more than ``SETTLE_PAGES`` pages in steps, the loop serving
        others between two (0.3-0.5 us a page in a space of several parts, whose keys are counted
        across its parts): the task doing that is returned (the Put answers once it is done;
        the daemon's close waits for it)."""
        if len(plan.page_ids) <= SETTLE_PAGES:
            try:
                self._settle(plan, ok)
            finally:
                self._written()
            return None
        return self.kv.in_background(in_steps(self.kv.share, self._settle_steps(plan, ok)))

    def _settle_steps(self, plan: PutPlan, ok: bool) -> Generator[None, None, None]:
        ids, plan.page_ids = plan.page_ids, plan.page_ids[:0]
        at = 0
        try:
            while at < len(ids):
                piece, at = ids[at:at + SETTLE_PAGES], at + SETTLE_PAGES  # (a piece that raised is
                self._settle(replace(plan, page_ids=piece), ok)  # not settled twice: its commit came first)
                if at < len(ids):
                    yield
        finally:  # (closed midway, at the daemon's stop: the rest at once, none left being written)
            try:
                if at < len(ids):
                    self._settle(replace(plan, page_ids=ids[at:]), ok)
            finally:  # those waiting on its keys look again once, not at every step
                self._written()

    def _settle(self, plan: PutPlan, ok: bool) -> None:
        ids = plan.page_ids
        self.cache.complete_put(plan, ok)
        if ok and self.disk is not None:  # written behind to disk, where it outlives its eviction
            self.disk.demote(plan.part, ids)
        if ok and self.cluster is not None:  # written through to the cluster, for other nodes
            self.cluster.publish(plan.part, ids)

    def _written(self) -> None:
        """Pages being written were committed or freed: whoever waits on them looks again."""
        wake, self._put_settled = self._put_settled, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _until_written(self, part: Part, keys: Keys, deadline: float) -> None:
        """Returns once no Put (nor read back from disk) is writing any of ``keys`` (or at the
        deadline)."""
        loop = asyncio.get_running_loop()
        while self.cache.writing(part, keys):
            if self._put_settled is None:
                self._put_settled = loop.create_future()
            left = deadline - loop.time() if deadline else None
            if left is not None and left <= 0:
                return
            try:
                await asyncio.wait_for(asyncio.shield(self._put_settled), left)
            except TimeoutError:
                return

    async def _checked_parts(self, client: ClientState,
                             req: pb.GetRequest) -> tuple[Keys, np.ndarray, list[tuple[int, int, str]]]:
        """A Get's keys and device pages, and its parts: (first, end, lease) over them (one part
        for a Get without ``parts``). The whole request is checked before anything is read."""
        if not req.parts:
            keys, pages = await self._checked(client, req.keys, req.key_bytes, req.device_pages,
                                              req.ready_event, req.event_slot)
            return keys, pages, [(0, len(keys), req.lease_id)]
        if req.keys or req.device_pages or req.lease_id:
            raise InvalidArgument("a Get with parts carries its keys, device pages and leases in its parts")
        if len(req.parts) > MAX_GET_PARTS:
            raise InvalidArgument(f"{len(req.parts)} parts in one Get; at most {MAX_GET_PARTS}")
        width = req.key_bytes
        if not 1 <= width <= MAX_KEY_BYTES:
            raise InvalidArgument(f"key_bytes must be between 1 and {MAX_KEY_BYTES}, got {width}")
        bounds, at = [], 0
        for i, part in enumerate(req.parts):
            n = len(part.keys) // width if width else 0
            if len(part.keys) != n * width or len(part.device_pages) != n:
                raise InvalidArgument(f"part {i}: {len(part.keys)} bytes of {width}-byte keys and "
                                      f"{len(part.device_pages)} device pages; they must pair up")
            bounds.append((at, at + n, part.lease_id))
            at += n
        if at > self._max_keys:
            raise NoCapacity(f"{at} keys in one request; at most {self._max_keys} are allowed")
        device = np.concatenate([transfer.as_indices(p.device_pages, "device page") for p in req.parts])
        keys, pages = await self._checked(client, b"".join(p.keys for p in req.parts), width, device,
                                          req.ready_event, req.event_slot)
        return keys, pages, bounds

    def _prepare_parts(self, part: Part, keys: Keys,
                       bounds: list[tuple[int, int, str]]) -> Generator[None, None, list[GetPlan]]:
        """``prepare_get_steps`` of each part in turn, as one cache operation's steps: the event
        loop gets a turn between two parts as between two steps of one, and a Get given up midway
        undoes the parts it had prepared."""
        plans: list[GetPlan] = []
        try:
            for i, (first, end, lease) in enumerate(bounds):
                if i:
                    yield
                plans.append((yield from self.cache.prepare_get_steps(part, keys[first:end], lease)))
        except BaseException:
            for plan in plans:
                self.cache.complete_get(plan, False)
            raise
        return plans

    async def get(self, req: pb.GetRequest) -> AsyncIterator[tuple[list[int], LoadStep | None]]:
        """Yields (pages, step): first how many leading keys of each part this Get loads, with no
        step; then, unless that is none, one item per progress step of the copy (all parts as one
        job)."""
        client = self.kv.client(req.client_id)
        deadline = self.kv.deadline(req.timeout_ms)
        keys, pages, bounds = await self._checked_parts(client, req)
        local_layers = client.spec.layers.select(req.layers)
        part = self._part(client)
        held: list[np.ndarray] = []
        try:
            if self.disk is not None or self.cluster is not None:
                # Pages on disk only, or in the cluster only, are read into host memory first.
                for first, end, _ in bounds:
                    held.append(await self._promote(part, keys[first:end], deadline))
            plans = await in_steps(self.kv.share, self._prepare_parts(part, keys, bounds))
        finally:
            for ids in held:  # the Get's own marks hold them now
                self.cache.hold(ids, -1)

        def complete(ok: bool) -> None:
            for plan in plans:
                self.cache.complete_get(plan, ok)

        found = [plan.pages for plan in plans]
        if not any(found):
            complete(True)
            yield found, None
            return
        try:
            self.kv.client(client.client_id)  # released during the steps: its pool may be closed
            offsets = np.concatenate([plan.offsets for plan in plans])
            device = np.concatenate([pages[first:first + plan.pages]
                                     for (first, _, _), plan in zip(bounds, plans, strict=True)])
            job = self._job(client, offsets, device, local_layers, req.ready_event, req.event_slot, deadline)
        except BaseException:
            complete(False)
            raise
        job.on_settled = complete
        try:
            yield found, None  # the prefixes are known now: the engine need not wait for a copy
            async for step in self.kv.copier.load(job):
                yield found, step
        finally:
            if not job.submitted:  # it never reached the medium, so nothing will settle it
                complete(False)

    def get_on_plane(self, req: pb.GetRequest, answer: Callable[[int], Any],
                     ended: Callable[[bool, int], None]) -> int | None:
        """``get`` for a lane Get the data plane can copy and answer by itself, all of it now, on
        the loop: the same checks and plan, then the copy, with ``answer(found)`` (the ``Answer``
        of its slot: the plane's code says ``found`` there at once), made right here with no job
        where it is small and the plane runs no copy of the client (``Copier.copy_now``), else
        handed to the plane's thread; ``ended(ok, bytes)`` is called on the loop once it is over
        and its pages are let go.
        Returns the pages found (0: nothing to copy, nothing running), or None where this is not
        such a Get, decided before anything is changed (``get`` serves it): a client not
        ``Copier.alone``, tiers to read back from, events, leases or parts, more keys than a step
        holds, a load the copy workers would split, or anything the checks refuse (``get`` gives
        the error). Past that point it is this path's: a KVError raised then is its answer
        (``Unavailable`` if the plane does not take the copy after all)."""
        if (req.parts or req.lease_id or req.ready_event or req.event_slot
                or len(req.keys) > STEP_KEYS * max(1, req.key_bytes)):
            return None
        copier = self.kv.copier
        client = self.kv.clients.get(req.client_id)
        if client is None or client.closing or not copier.alone(client, answers=True):
            return None
        tiered = self.disk is not None or self.cluster is not None
        if (tiered and not self._plane_pending(client)) or not self._keys_fit(req.keys, req.key_bytes):
            return None  # (``get`` serves it, and words a refusal)
        key_bytes, packed = req.key_bytes, req.keys
        n = len(packed) // key_bytes
        try:
            pages = self._checked_pages(client, n, req.device_pages, b"", 0)
            local_layers = client.spec.layers.select(req.layers)
        except KVError:
            return None
        spec = client.spec
        if copier.splits(n * spec.page_size * spec.token_bytes * spec.layout.num_parts
                         * len(local_layers), True) or not copier.takes_rows(self._cache_table(client),
                                                                               spec.page_size):
            return None  # (the split: were every key found)
        try:
            part = self._part(client)
        except KVError:
            return None
        self._serve_on_plane(client, part)  # (before anything is held: nothing to undo if it raises)
        if tiered:
            return None  # a miss may be read back: ``get``'s (the plane takes the whole hits)
        self.kv.client(client.client_id)  # its lease, renewed as every call renews it
        plan = self.cache.prepare_get_packed(part, packed, key_bytes)
        if plan is None:  # no compiled index
            plan = self.cache.prepare_get(part, Keys.unpack(packed, key_bytes, self._max_keys))
        if not plan.pages:
            self.cache.complete_get(plan, True)
            return 0
        nbytes = plan.pages * spec.page_size * spec.token_bytes * spec.layout.num_parts * len(local_layers)

        def finish(ok: bool) -> None:  # the copy is over: its pages go, then its ending
            try:
                self.cache.complete_get(plan, ok)  # whatever else fails, the pages go
                if ok:
                    client.counters.bytes_loaded += nbytes
                    client.counters.load_ops += 1
            finally:
                ended(ok, nbytes if ok else 0)

        try:
            code = -1
            if nbytes <= INLINE_COPY_BYTES:  # copied and answered now, with no job (``Copier.copy_now``)
                code = copier.copy_now(client, plan.offsets, pages[:plan.pages], local_layers,
                                       self._cache_table(client), answer(plan.pages))
            if code < 0:
                job = self._job(client, plan.offsets, pages[:plan.pages], local_layers, b"", 0, 0.0)
                fut = copier.run_alone(job, True, answer(plan.pages))
        except BaseException:
            self.cache.complete_get(plan, False)
            raise
        if code >= 0:  # answered: nothing may raise from here (the loop would serve it again)
            try:
                finish(code == 0)
            except Exception:
                logger.exception("settling a Get copied at once failed")
            return plan.pages
        if fut is None:  # the plane refused it after all (stopping, out of memory)
            self.cache.complete_get(plan, False)
            raise Unavailable(_PLANE_REFUSED)

        def settle(f: Future) -> None:  # on the loop, where the plane's ends are taken
            try:
                copier.ended_alone(job)
            finally:
                finish(f.exception() is None)

        fut.add_done_callback(settle)
        return plan.pages

    def _plane_pending(self, client: ClientState) -> bool:
        """Whether the data plane serves cache calls (``DataPlane.serve_gets``) and ``client``'s
        gate is yet to be given its part (``_serve_on_plane``)."""
        plane, gate = self.kv.copier.plane, client.gate
        return (plane is not None and plane.cache is not None and gate is not None and gate.cache_gid < 0
                and not client.off_plane and self.cache.pages.compiled)

    def _keys_fit(self, packed: bytes, key_bytes: int) -> bool:
        """Whether ``packed`` is whole keys of a width the cache takes, no more than a request may
        carry (a path that serves only such calls hands the others over: their checks word why)."""
        return (1 <= key_bytes <= MAX_KEY_BYTES and not len(packed) % key_bytes
                and len(packed) // key_bytes <= self._max_keys)

    def _serve_on_plane(self, client: ClientState, part: Part | None = None) -> None:
        """From now on ``client``'s lane Gets that ``get_on_plane`` would serve, and its Lookups of
        its ``part`` (``_part``) that ``lookup_now`` would, are served whole on the data plane's
        thread, which reads the same request, runs the same checks (those of the registration,
        which never change, run here first), walks the same index and copies the same pages
        (docs/design.md, "A Get on the data plane"); whatever it does not take it hands over, as
        ever. With a disk or cluster tier, only the calls whose every key host memory holds
        (``DataPlane.serve_gets``' whole): a miss is the loop's, which reads it back or asks the
        cluster. Once a client, where the plane serves Gets and copies its cache table's rows."""
        if not self._plane_pending(client):
            return
        copier, gate = self.kv.copier, client.gate
        plane = copier.plane
        if gate.cuda:  # a CUDA pool's cache copies are the loop's (the copy kernel, from pinned slabs)
            client.off_plane = True
            return
        if part is None:
            part = self._part(client)
        rows = plane.host_rows(self._cache_table(client), client.spec.page_size, copier.arena_span)
        if rows is None or rows[0] != self.kv.arena.address:
            client.off_plane = True  # (its rows never change: not asked again)
            return
        device = client.device
        try:  # the registration's own checks of a Get (``_checked_pages``), which never change
            device.check_request(b"", 0)
            device.check_cache_rows()
            device.check_sizes()
        except KVError:
            client.off_plane = True
            return
        self._prune_plane_calls()
        token = next(self._plane_tokens)
        self._plane_gets[token] = PlaneCalls(client.client_id, (part,), gate)
        gate.set_cache(part.gid, token, client.client_id.encode(), rows[1], min(self._max_keys, STEP_KEYS),
                       copier.split_load_bytes())
        client.plane_token = token

    def _class_of(self, part: Part) -> tuple[int, int]:
        return self.cache.tenants.get(part.space.key.tenant).tid, part.key.page_bytes

    def _stash_pages(self, part: Part) -> int:
        """How many free pages the stash of a registration of ``part`` holds when full: its share
        of its size class's (``STASH_BYTES``, a 32nd of host memory, a 16th of its tenant's quota,
        among the class's registrations that Put: ``_stashers``)."""
        page_bytes = part.key.page_bytes
        quota = self.cache.tenants.get(part.space.key.tenant).quota
        nbytes = min(STASH_BYTES, self.kv.arena.capacity // 32, quota // 16 if quota else STASH_BYTES)
        cls = self._class_of(part)
        share = max(1, sum(got == cls for got in self._stashers.values()))  # (a node's few engines)
        return min(STASH_PAGES, nbytes // page_bytes // share)

    def _stasher(self, client: ClientState) -> PlaneCalls | None:
        """The plane's entry of a registration that Puts on its lane, counted among its class's
        stashers from its first Put (a registration that never Puts, a decode engine's, gets no
        stash); None where the plane does not serve its cache calls."""
        calls = self._plane_gets.get(client.plane_token)
        if calls is None or calls.space or calls.gate.closed:
            return None
        if client.plane_token not in self._stashers:
            cls = self._class_of(calls.parts[0])
            self._stashers[client.plane_token] = cls
            for token, got in self._stashers.items():  # the others' shares are smaller now
                other = self._plane_gets.get(token)
                if got == cls and other is not None and token != client.plane_token:
                    self._trim(other)
        return calls

    def _trim(self, calls: PlaneCalls) -> None:
        """A registration's stash down to its share of its class's (``_stash_pages``), the rest
        freed."""
        plane, gate = self.kv.copier.plane, calls.gate
        full = self._stash_pages(calls.parts[0])
        if gate.stashed <= full or gate.closed:
            return
        with self.cache.lock:
            ids = plane.unstash(gate)
            try:
                plane.stash(gate, ids[:full], full)
            except BaseException:
                self.cache.free_stash(ids)
                raise
            self.cache.free_stash(ids[full:])

    def _refill(self, calls: PlaneCalls, evict: bool, used: int = 0) -> None:
        """Fills the stash of a registration's gate (``DataPlane.stash``): the free pages the plane
        takes for the keys a Put stores (docs/design.md, "A Put on the data plane"), once it holds
        less than half (or than twice the ``used`` pages the Puts just settled took: the next may
        come before the loop settles these). Not at every Put: each fill takes the cache's lock for
        the time of its evictions, and a Put that finds the lock taken goes to the loop. From free
        memory (slabs grown within the tenant's quota); evicting as a Put would (``evict``: to
        replace the pages the plane's Puts took; or once a Put that the full stash would have held
        found it short) only while the plane's Puts use it, so that a cache whose Puts are the
        loop's keeps every page it would keep without one. None for a closed gate."""
        plane, gate = self.kv.copier.plane, calls.gate
        if calls.space or plane is None or plane.cache is None or gate.closed:
            return
        full = self._stash_pages(calls.parts[0])
        self._trim(calls)
        if gate.stashed >= max(-(-full // 2), min(full, 2 * used)) and not gate.stash_short:
            return
        with self.cache.lock:
            want = full - gate.stashed
            ids = (self.cache.take_stash(calls.parts[0], want, evict or gate.stash_short) if want > 0
                   else np.empty(0, np.int64))
            try:  # (none taken: the plane is told its size all the same, for stash_short)
                plane.stash(gate, ids, full)
            except BaseException:
                self.cache.free_stash(ids)
                raise

    def _reclaim(self, cls: tuple[int, int | None] | None) -> list[int]:
        """The stashes of the registrations whose pages are of size class ``cls`` (tenant id,
        page bytes; a tenant's of every size: page bytes None; every one: None) given back, with
        the cache's lock held (``KVCache.on_reclaim``: before the loop evicts for itself); returns
        the slabs their pages were in (kept, even empty: the caller releases or uses them). Their
        plane fills them again as it uses them (``_refill``)."""
        plane = self.kv.copier.plane
        if plane is None or plane.cache is None:
            return []
        sids: list[int] = []
        for token, got in self._stashers.items():
            calls = self._plane_gets.get(token)
            if (calls is None or not calls.gate.stashed or
                    (cls is not None and (got[0] != cls[0] or cls[1] not in (None, got[1])))):
                continue
            sids += self.cache.free_stash(plane.unstash(calls.gate), release_empty=False)
        return sids

    def plane_lookups_counted(self, client: ClientState, hits: int, misses: int) -> None:
        """``hits`` and ``misses`` of ``client``'s Lookups of its part that the plane answered and
        settled itself (their pages made recent in its walk: ``_kvlane``'s try_answer), counted in
        the part's space and tenant as ``lookup_now`` counts them."""
        entry = self._plane_gets.get(client.plane_token)
        part = entry.parts[0] if entry is not None else self.cache.part_of(client.gate.cache_gid)
        if part is not None:
            self.cache.settle_lookup((), part.space, hits, misses)

    def _gate_closed(self, client: ClientState) -> None:
        """A client's gate closed (its release): the pages set aside for its Puts go back. (Those
        its Puts still copy come back with their ends: ``_stored``.)"""
        plane = self.kv.copier.plane
        self._stashers.pop(client.plane_token, None)
        if plane is None or plane.cache is None or client.gate is None or client.gate.space:
            return
        with self.cache.lock:
            self.cache.free_stash(plane.unstash(client.gate))

    def serve_space_on_plane(self, space_id: str, gate: Any) -> None:
        """From now on the Lookups on ``space_id``'s lane (a scheduler's, of the whole space;
        ``gate``: the lane's on the data plane, ``DataPlane.space_gate``) that ``lookup_now`` would
        serve whole are answered on the plane's thread, which reads the same request, runs the same
        checks and walks each part of the space in turn over the keys the parts before it hold, as
        ``KVCache.lookup_packed`` does; its end makes the pages recent and counts the hits and
        misses here (``plane_get_ended``). Only once the space has every part: its parts then never
        change (a space's parts are only ever added; the reference kept here keeps the same Space
        object, with the same parts, while the gate serves). At most one step of the loop's
        whole-space Lookup (``packed_step_keys``) and ``PLANE_SPACE_PAIRS`` (key, part) pairs, all
        walked under one hold of the cache's lock. With a disk or cluster tier, only the Lookups
        whose every key host memory holds, as for an engine's."""
        plane = self.kv.copier.plane
        if (gate is None or plane is None or plane.cache is None or gate.cache_gid >= 0 or gate.closed
                or not self.cache.pages.compiled):
            return
        key = self._space_ids.get(space_id)
        space = self.cache.find_space(key) if key is not None else None
        if space is None:
            return
        parts = self.cache.parts_of(space)[1]
        if not parts:  # not every part yet: none holds a whole page
            return
        max_keys = min(self._max_keys, self.cache.packed_step_keys(space), PLANE_SPACE_PAIRS // len(parts))
        if max_keys < 1:  # (a space of more parts than that: its Lookups stay the loop's)
            return
        self._prune_plane_calls()
        token = next(self._plane_tokens)
        self._plane_gets[token] = PlaneCalls(space_id, tuple(parts), gate, space=True)
        gids = np.array([p.gid for p in parts], np.int32).tobytes()
        gate.set_space(token, space_id.encode(), gids, max_keys)

    def _prune_plane_calls(self) -> None:
        """Forgets the tokens of gates that serve no more (a client gone, a space's lane closed)
        with no call in flight on them: their ends have all been posted, and are settled here
        before they go. Amortized: once the table has doubled since the last prune."""
        if len(self._plane_gets) < max(64, 2 * self._plane_kept):
            return
        clients = self.kv.clients
        done = [t for t, c in self._plane_gets.items()
                if (c.gate.closed or (not c.space and c.owner not in clients)) and not c.gate.inflight]
        plane = self.kv.copier.plane
        plane.settle_gets()
        for t in done:
            calls = self._plane_gets.pop(t)
            if not calls.space:  # what its last Lookups counted after its client's last harvest
                hits, misses = calls.gate.take_lookups()
                if hits or misses:
                    self.cache.settle_lookup((), calls.parts[0].space, hits, misses)
            self._stashers.pop(t, None)
            if calls.gate.stashed:  # (its release's give-back failed: logged there)
                with self.cache.lock:
                    self.cache.free_stash(plane.unstash(calls.gate))
        self._plane_kept = len(self._plane_gets)

    def plane_calls_ended(self, ends: list[tuple]) -> None:
        """The calls the plane served whole that ended since the last look (``_kvlane``'s
        take_gets), each settled by ``plane_get_ended``; but the Puts it stored, a registration's
        all at once (``_stored``): a client storing page after page leaves the loop a batch of
        them to settle at each wake-up, for the cost of one."""
        stores: dict[int, list] = {}
        for end in ends:
            try:
                if end[8] == _END_STORE:
                    token, _, ids, found, misses, status, _, nbytes, _ = end
                    got = stores.setdefault(token, [end[1], [], [], 0, 0, 0])
                    pages = np.frombuffer(ids, np.int64)
                    got[1].append(pages[:found])
                    got[2].append(pages[found:])
                    got[3] += misses  # (its keys found stored: none for a Put the loop serves anew)
                    if status == 0 and found:  # a copy stored pages (as the loop counts one)
                        got[4] += nbytes
                        got[5] += 1
                    continue
                self.plane_get_ended(*end)
            except Exception:  # the others are settled all the same
                logger.exception("settling a call the data plane served failed")
        for token, (gid, filed, rest, present, nbytes, puts) in stores.items():
            entry = self._plane_gets.get(token)
            part = entry.parts[0] if entry is not None and entry.parts[0].gid == gid else None
            try:
                self._stored(entry, part, np.concatenate(filed), np.concatenate(rest), present, nbytes, puts)
            except Exception:
                logger.exception("settling the Puts the data plane stored failed")

    def plane_get_ended(self, token: int, gid: int, ids: bytes, found: int, misses: int, status: int,
                        layers: int, nbytes: int, kind: int = 0) -> None:
        """A Get the plane served whole has ended (``_kvlane``'s take_gets): its pages are let go and
        made recent, its misses counted, and, done, its client's counters and the metrics kept,
        as ``get_on_plane`` settles the Gets it plans. ``kind`` 1: a Lookup's, whose pages are made
        recent and whose hits and misses are counted, as ``lookup_now`` does (3: one of host memory
        only, ``memory_only``); 2: a Put's whose keys were all stored, counted present, as
        ``put_on_plane`` counts one (4, a Put the plane stored, is ``plane_calls_ended``'s). With a
        disk tier, a Get's and a Lookup's (not one of host memory only) also make the disk's copies
        recent (``_touch_below``)."""
        entry = self._plane_gets.get(token)
        if entry is not None and entry.space:
            self._space_lookup_ended(entry, ids, found, misses, kind)
            return
        part = entry.parts[0] if entry is not None and entry.parts[0].gid == gid else None
        if kind == _END_PUT:
            if part is not None:
                self.cache.count_present(part, found)
            return
        pages = np.frombuffer(ids, np.int64)
        if kind != _END_LOOKUP_HOST and status == 0 and self.disk is not None:
            # (Not a Get's the plane handed over after all: the loop's walk touches them itself.)
            # First, outside the cache's lock (a Get's pages are still held): the plane's next call,
            # which comes about now, finds the lock free more often.
            try:
                self._touch_below(part, pages)
            except Exception:  # only the disk's order is at stake: the holds go all the same
                logger.exception("making the disk's copies of a hit recent failed")
        if kind in (_END_LOOKUP, _END_LOOKUP_HOST):
            self.cache.settle_lookup([(gid, pages)], part.space if part is not None else None, found, misses)
            return
        self.cache.settle_get(pages, part, misses)
        if status == 0 and found and entry is not None:
            client = self.kv.clients.get(entry[0])
            if client is not None:
                client.counters.bytes_loaded += nbytes
                client.counters.load_ops += 1
            if self.on_plane_get is not None:
                self.on_plane_get(nbytes)

    def _stored(self, entry: PlaneCalls | None, part: Part | None, filed: np.ndarray, rest: np.ndarray,
                present: int, nbytes: int, puts: int) -> None:
        """Puts the plane stored for one registration have ended (``END_STORE``): their pages
        ``filed``, filed under its part and held, are settled as ``put_on_plane`` settles a Put's
        (``settle_stored``, then the tiers' hooks, its client's counters and the metrics), with
        ``present`` keys found stored already and ``puts`` Puts done of ``nbytes``; the pages of its
        gate's stash they did not file (``rest``: keys stored meanwhile, or a Put stopped or handed
        to the loop) go back to the stash, or are freed once the gate is closed; and the stash is
        filled again."""
        plane = self.kv.copier.plane
        try:
            if part is None:  # (never: an entry goes only once its gate has nothing in flight)
                if len(filed):  # their holds go, so that eviction can take them
                    logger.error("Puts the data plane stored ended for a part the daemon does not know")
                    with self.cache.lock:
                        self.cache.pages.hold(filed, -1)
                return
            if len(filed) or present:
                self.cache.settle_stored(part, filed, present)
            if len(filed):
                if self.disk is not None:  # written behind to disk, where it outlives its eviction
                    self.disk.demote(part, filed)
                if self.cluster is not None:  # written through to the cluster, for other nodes
                    self.cluster.publish(part, filed)
            client = self.kv.clients.get(entry.owner) if entry is not None and puts else None
            if client is not None:
                client.counters.bytes_written += nbytes
                client.counters.write_ops += puts
            if puts and self.on_plane_put is not None:
                self.on_plane_put(nbytes, puts)
        finally:
            if len(rest):
                with self.cache.lock:
                    if entry is None or entry.gate.closed or plane is None:
                        self.cache.free_stash(rest)
                    else:  # back to the stash, up to its size (a fill may have come meanwhile)
                        full = self._stash_pages(entry.parts[0])
                        back = rest[: max(0, full - entry.gate.stashed)]
                        self.cache.free_stash(rest[len(back):])
                        try:
                            if len(back):
                                plane.stash(entry.gate, back, full)
                        except BaseException:
                            self.cache.free_stash(back)
                            raise
        if entry is not None:
            self._refill(entry, len(filed) > 0, len(filed) // max(1, puts))

    def _space_lookup_ended(self, calls: PlaneCalls, ids: bytes, found: int, misses: int, kind: int) -> None:
        """A scheduler's Lookup of a whole space the plane answered: ``ids`` each part's pages of
        the ``found`` leading keys, part after part; made recent in each part in turn and counted
        once in the space, as ``KVCache.lookup_packed`` ends one, and (not one of host memory only)
        the disk's copies made recent too, as the loop's walk with a disk tier does."""
        parts = calls.parts
        pages = np.frombuffer(ids, np.int64).reshape(len(parts), found)
        if kind != _END_LOOKUP_HOST and self.disk is not None:
            try:
                for part, got in zip(parts, pages, strict=True):
                    self._touch_below(part, got)
            except Exception:
                logger.exception("making the disk's copies of a hit recent failed")
        self.cache.settle_lookup([(part.gid, got) for part, got in zip(parts, pages, strict=True)],
                                 parts[0].space, found, misses)

    def _touch_below(self, part: Part | None, ids: np.ndarray) -> None:
        """A Get's or Lookup's whole hit the plane served in a daemon with a disk tier: the disk's
        copies of its pages made its most recent, as the loop's walk of the same keys makes them
        (``DiskTier.holds``), so that pages kept hot in host memory keep their disk copies too.
        Pages gone from the part since the walk (a Lookup holds none) are skipped."""
        if self.disk is None or part is None or not len(ids):
            return
        p = self.cache.pages
        ids = ids[(p.state[ids] == COMMITTED) & (p.part[ids] == part.gid)]
        if len(ids):
            self.disk.holds(part, p.keys_of(ids))

    def put_on_plane(self, req: pb.PutRequest,
                     ended: Callable[[PutOutcome | None, BaseException | None], None],
                     ) -> PutOutcome | bool | None:
        """``put`` for a lane Put the data plane can copy while the loop does nothing else for it:
        the same checks and plan (``prepare_put``), its copy handed to the plane, and its pages
        committed (or freed) when the copy ends, with the tiers' hooks (``_settled``). Returns the
        outcome at once when nothing is to be copied; True when the copy runs, and
        ``ended(outcome, None)``, or ``ended(None, error)`` for a copy stopped, follows on the
        loop once it is committed; None where this is not such a Put, decided before anything is
        changed (``put`` serves it): a client not ``Copier.alone``, a ready event, keys another
        Put is writing (``put`` waits for those), more keys than a step holds, or anything the
        checks refuse. Past that point it is this path's: a KVError raised then is its answer."""
        if req.ready_event or len(req.keys) > STEP_KEYS * max(1, req.key_bytes):
            return None
        copier = self.kv.copier
        client = self.kv.clients.get(req.client_id)
        if client is None or client.closing or not copier.alone(client):
            return None
        key_bytes, packed = req.key_bytes, req.keys
        if not self._keys_fit(packed, key_bytes):
            return None  # (put words it)
        try:
            pages = self._checked_pages(client, len(packed) // key_bytes, req.device_pages, b"", 0)
        except KVError:
            return None
        if not copier.takes_rows(self._cache_table(client), client.spec.page_size):
            return None
        try:
            part = self._part(client)
        except KVError:
            return None
        self._serve_on_plane(client, part)  # (the plane answers its next such Puts itself)
        # Keys of over 32 bytes: the plane never stores them (the loop keeps their bytes, for KV
        # events): their registration gets no stash.
        narrow = key_bytes <= WORD_BYTES
        stored = self.cache.prepare_put_present(part, packed, key_bytes)
        if stored is not None:  # every key stored already: nothing taken, nothing to copy
            self.kv.client(client.client_id)  # its lease, renewed as every call renews it
            if narrow:
                self._refilled(client)
            return PutOutcome(0, stored.present, 0, 0)
        keys = Keys.unpack(packed, key_bytes, self._max_keys)
        if self.cache.writing(part, keys):
            return None
        self.kv.client(client.client_id)
        # A Put whose new pages the plane would have stored (handed over for a passing reason)
        # leaves the stash alone: it evicts as the stash's next fill would.
        plan = self.cache.prepare_put(part, keys, self._stash_pages(part) if narrow else -1)
        n = plan.positions.size
        if n == 0:
            self.cache.complete_put(plan, True)
            if narrow:
                self._refilled(client)
            return PutOutcome(0, plan.present, plan.dropped, 0)
        try:
            job = self._job(client, plan.offsets, pages[plan.positions], client.spec.layers.select([]),
                            b"", 0, self.kv.deadline(req.timeout_ms))
            fut = copier.run_alone(job, False)
        except BaseException:
            self.cache.complete_put(plan, False)
            raise
        if fut is None:  # the plane refused it after all (stopping, out of memory)
            self.cache.complete_put(plan, False)
            raise Unavailable(_PLANE_REFUSED)
        loop = asyncio.get_running_loop()
        timer = loop.call_at(job.deadline, job.stop, "deadline") if job.deadline > 0 else None
        nbytes = job.bytes_per_layer * len(job.local_layers)

        def settle(f: Future) -> None:  # on the loop, where the plane's ends are taken
            if timer is not None:
                timer.cancel()
            error = f.exception()
            try:
                copier.ended_alone(job)
            finally:
                try:
                    self._settled(plan, error is None)  # whatever else fails, the pages are settled
                    if error is None:
                        client.counters.bytes_written += nbytes
                        client.counters.write_ops += 1
                finally:
                    ended(PutOutcome(n, plan.present, plan.dropped, nbytes) if error is None else None, error)
                    if narrow:
                        self._refilled(client)

        fut.add_done_callback(settle)
        return True

    def _refilled(self, client: ClientState) -> None:
        """After a lane Put the loop served (the first of a registration, whose gate had no part
        yet, among them): its registration's stash filled again (``_refill``), made at its first
        Put; from free memory, evicting as a Put would only once a Put the full stash would have
        held found it short (``Gate.stash_short``)."""
        calls = self._stasher(client)
        if calls is None:
            return
        try:
            self._refill(calls, False)
        except Exception:  # the stash stays short: the plane hands the next Puts over, as now
            logger.exception("filling the pages set aside for the data plane's Puts failed")

    async def _promote(self, part: Part, keys: Keys, deadline: float) -> np.ndarray:
        """Reads into host pages the pages of the leading keys stored that only the disk holds,
        then (once those are all in) the pages after them that only the cluster holds; waits for
        pages being read back meanwhile (another Get of the same pages: an MLA model's ranks). A
        page that cannot be read whole and checked, or in time, ends the hit there: the Get loads
        fewer. Returns the host pages of the hit, held (the caller lets them go once its Get
        holds them), so that another part's read back does not evict them."""
        pages = self.cache.pages
        in_host, writing, on_disk = await in_steps(self.kv.share, self._tiers_of(part, keys))
        m = leading(in_host | on_disk)  # (a page a Put is writing, and not on disk, ends the hit)
        need = np.flatnonzero(~(in_host | writing)[:m])
        if len(need):
            # The pages in memory of the hit are not evicted to make room for those read back.
            # Found again: those found a step ago may have gone since, and their ids with them.
            held = self._held_hit(part, keys[:m])
            try:
                await self._read_back(part, keys.take(need), deadline)
            finally:
                self.cache.hold(held, -1)
        until = deadline
        if (m < len(keys) and self.cluster is not None and self.cluster.ready
                and (not len(need) or bool((pages.find(part.gid, keys[:m]) >= 0).all()))):
            held = self._held_hit(part, keys[:m])  # not evicted to make room for the cluster's
            try:
                more, until = await self._pull(part, keys[m:], deadline)
                m += more
            except Exception:  # the cluster is best effort: whatever fails there is a miss
                logger.exception("pulling pages from the cluster failed")
            finally:
                self.cache.hold(held, -1)
        if self.cache.writing(part, keys[:m]):
            await self._until_written(part, keys[:m], until)
        return self._held_hit(part, keys[:m])

    def _held_hit(self, part: Part, keys: Keys) -> np.ndarray:
        """The part's host pages of ``keys`` that are stored now, held once more."""
        with self.cache.lock:
            ids = self.cache.pages.find(part.gid, keys)
            ids = ids[(ids >= 0) & (self.cache.pages.state[ids] == COMMITTED)]
            self.cache.pages.hold(ids)
        return ids

    def _tiers_of(self, part: Part, keys: Keys) -> Generator[None, None, tuple[np.ndarray, ...]]:
        """Per key, up to the first one neither tier holds, a step of keys at a time: (in host
        memory, being written there, on disk)."""
        disk, pages = self.disk, self.cache.pages
        out: list[tuple[np.ndarray, ...]] = []
        for start in range(0, len(keys), STEP_KEYS):
            if start:
                yield
            step = keys[start : start + STEP_KEYS]
            ids = pages.find(part.gid, step)
            state = pages.state[ids]
            in_host, writing = (ids >= 0) & (state == COMMITTED), (ids >= 0) & (state == WRITING)
            on_disk = disk.holds(part, step) if disk is not None else np.zeros(len(step), bool)
            out.append((in_host, writing, on_disk))
            if leading(in_host | on_disk) < len(step):
                break
        if not out:
            return tuple(np.zeros(0, bool) for _ in range(3))
        return tuple(np.concatenate(cols) for cols in zip(*out, strict=True))

    async def _pull(self, part: Part, keys: Keys, deadline: float) -> tuple[int, float]:
        """Reads the leading pages of ``keys`` that the cluster holds into new host pages of
        ``part``, the whole of it within one cluster deadline (the tier's timeout, or the Get's
        ``deadline`` if sooner). Returns (n, that deadline): the leading keys the Get may count on,
        those stored, pulled, or being written by another Get meanwhile (waited for until then);
        if this pull is not over in time, only those before its first page. Pages whose transfer
        is not over stay being written until it is; those whose transfer failed stay out of use
        for ``QUARANTINE_SECONDS`` more (Mooncake stops waiting, not the transfer)."""
        cluster = self.cluster
        assert cluster is not None
        loop = asyncio.get_running_loop()
        until = cluster.deadline(deadline)
        if self._quarantined_bytes > self.cache.arena.capacity * MAX_QUARANTINED_SHARE:
            return 0, until  # failed pulls hold host memory enough: the cluster is a miss a while
        page = part.key.page_bytes
        if self._pull_room(page) <= 0:
            return 0, until
        n = await cluster.count([part], keys, until, hits=False)
        n = min(n, self._pull_room(page))  # (other pulls may have begun meanwhile)
        if n <= 0 or loop.time() >= until:
            return 0, until
        self._pulling_bytes += n * page  # this pull's room, held while its pages are taken
        try:
            hplan = await in_steps(self.kv.share, self.cache.prepare_put_steps(part, keys[:n], counted=False))
        finally:
            self._pulling_bytes -= n * page
        n -= hplan.dropped
        if not len(hplan.page_ids):
            self.cache.complete_put(hplan, True)
            return n, until
        positions = hplan.positions
        first_own = int(positions[0])
        done: asyncio.Future[int] = loop.create_future()
        pulling = len(hplan.page_ids) * page
        self._pulling_bytes += pulling

        def settled(ok: np.ndarray, unsafe: np.ndarray) -> None:  # once the transfer is over
            self._pulling_bytes -= pulling
            # The Get counts on the leading keys up to the first page that did not come.
            arrived = n if ok.all() else int(positions[int(np.argmin(ok))])
            if unsafe.any():
                # Out of use until the transfer can no longer land, and out of their part now:
                # a Put or Get of those keys goes on without them meanwhile.
                aside = hplan.page_ids[unsafe]
                hplan.page_ids, ok = hplan.page_ids[~unsafe], ok[~unsafe]
                self.cache.set_aside(aside)
                nbytes = len(aside) * page
                self._quarantined_bytes += nbytes
                loop.call_later(QUARANTINE_SECONDS, self._unquarantine, aside, nbytes)
            self.cache.complete_put(hplan, ok)
            self._written()
            if not done.done():
                done.set_result(arrived)

        await cluster.pull(part, keys[:n].take(positions), hplan.offsets, until, settled)
        if not done.done():
            logger.warning("pulling %d pages from the cluster is past its deadline", len(positions))
            return first_own, until
        return done.result(), until

    def _pull_room(self, page_bytes: int) -> int:
        """Pages of ``page_bytes`` a pull from the cluster may take now (``MAX_PULLING_SHARE``)."""
        share = self.cache.arena.capacity * MAX_PULLING_SHARE
        return int((share - self._pulling_bytes - self._quarantined_bytes) // page_bytes)

    def _unquarantine(self, ids: np.ndarray, nbytes: int) -> None:
        """Frees the pages of a failed pull (set aside) once its transfer can no longer land."""
        self._quarantined_bytes -= nbytes
        self.cache.free_stash(ids)

    async def _read_back(self, part: Part, keys: Keys, deadline: float) -> None:
        """Reads the disk's pages of ``keys`` (all on disk) into new host pages of ``part``, within
        the deadline: pages whose read is not over by then stay being written until it is (this
        Get's hit ends before them)."""
        disk = self.disk
        assert disk is not None
        dplan = await in_steps(self.kv.share, disk.take_steps(part, keys))
        if dplan is None:
            return
        try:
            hplan = await in_steps(self.kv.share,
                                   self.cache.prepare_put_steps(part, keys[: dplan.pages], counted=False))
        except BaseException:
            disk.finish(dplan)
            self._written()  # its pages were seen being written between its steps
            raise
        if not len(hplan.page_ids):
            disk.finish(dplan)
            self.cache.complete_put(hplan, True)
            return

        def settled(ok: np.ndarray) -> None:
            self.cache.complete_put(hplan, ok)
            self._written()

        # Settled by the read, whatever becomes of this call: a thread may still write the pages.
        try:
            done = disk.read(dplan, keys, hplan.positions, hplan.offsets, settled)
        except BaseException:  # nothing was handed to a thread (the daemon is closing)
            disk.finish(dplan)
            settled(np.zeros(len(hplan.page_ids), bool))
            raise
        loop = asyncio.get_running_loop()
        left = max(0.0, deadline - loop.time()) if deadline else None
        try:
            await asyncio.wait_for(asyncio.shield(done), left)
        except TimeoutError:
            logger.warning("reading %d pages back from the disk cache is past the Get's deadline",
                           len(hplan.positions))


async def expire_leases(cache: KVCache, stop: asyncio.Event, period: float = 1.0,
                        share: LoopShare | None = None) -> None:
    """Ends expired leases every ``period`` seconds until ``stop`` is set (in steps, letting others
    use the loop between two)."""
    share = share or LoopShare()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period)
        except TimeoutError:
            pass
        ended = await in_steps(share, cache.expire_leases_steps())
        if ended:
            logger.debug("%d cache leases expired", ended)
