"""gRPC servicer: proto <-> core translation and status mapping, nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvserver.api import packed, wire
from kvserver.api.auth import is_admin
from kvserver.api.eager import bounded
from kvserver.api.metrics import BUCKETS, Metrics
from kvserver.api.status import grpc_status
from kvserver.core.cache_ops import CacheOps, PutOutcome, space_from_wire
from kvserver.core.client_state import ClientState, Counters, public_id
from kvserver.core.kvcore import OFF_LOOP_INDICES, KVCore
from kvserver.core.liveness import Reaper
from kvserver.core.tiers import tier_stats
from kvserver.errors import (
    DeadlineExceeded,
    GpuStalled,
    InvalidArgument,
    KVError,
    PermissionDenied,
    Unauthenticated,
    status_of,
)
from kvserver.lane import plane
from kvserver.lane.book import LaneBook
from kvserver.lane.plane import Answer, DataPlane
from kvserver.lane.server import Lane
from kvserver.peers.tenants import TENANT_KEY, TenantBook, tenant_of
from kvserver.protocol import lane_request, ring
from kvserver.protocol.layout import wire_dtype
from kvserver.store import CacheCounters, SpaceStat, TenantStat
from kvserver.store.keep import Recovery
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Trailing metadata of every Write and Load answer: the job is dead (or never started), so a
# client that sees a failure knows nothing of it will still be copied. A deadline or
# disconnection the client sees on its own side carries no such mark.
JOB_ENDED = (("kvserver-job", "ended"),)

ALLOC_INDICES_FIELD = pb.AllocResponse.DESCRIPTOR.fields_by_name["host_indices"].number


class MalformedRequest:
    """Stands in for request bytes that did not parse, so the handler can answer INVALID_ARGUMENT
    (grpc.aio would otherwise report the DecodeError as UNKNOWN)."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: DecodeError) -> None:
        self.type_name = type_name
        self.error = error


def _lenient(message_cls: Any, defer: bool = False) -> Callable[[bytes], Any]:
    """A request parser that never raises; ``defer``: a large request's bytes are kept for
    ``_parsed`` to read off the event loop (api/wire.py)."""

    def parse(data: bytes) -> Any:
        if defer and len(data) >= wire.LARGE_REQUEST_BYTES:
            return wire.Unparsed(message_cls, data)
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return MalformedRequest(message_cls.DESCRIPTOR.full_name, exc)

    return parse


def _check_parsed(request: Any) -> None:
    if isinstance(request, MalformedRequest):
        raise InvalidArgument(f"request is not a valid {request.type_name}: {request.error}")


async def _parsed(request: Any) -> Any:
    """``request``, read off the event loop if it came large (api/wire.py); raises InvalidArgument
    for one that is not a valid message, or what api/wire.py refuses."""
    if not isinstance(request, wire.Unparsed):
        _check_parsed(request)
        return request
    try:
        return await wire.parse_off_loop(request)
    except DecodeError as exc:
        raise InvalidArgument(
            f"request is not a valid {request.message_cls.DESCRIPTOR.full_name}: {exc}") from None


def _abort_on_error(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            request = await _parsed(request)
            with self.core.share.call():  # short calls run between a long one's steps (core/share.py)
                return await fn(self, request, context)
        except KVError as exc:
            _unmark_stalled(exc, context)
            await context.abort(*grpc_status(exc))
        except Exception as exc:
            logger.exception("%s failed", fn.__name__)
            await context.abort(*grpc_status(exc))
        finally:
            self.metrics.observe(fn.__name__, started)

    return wrapper


def _unmark_stalled(exc: BaseException, context) -> None:
    """A job given up on the GPU (``GpuStalled``) may still run there later: its answer must not
    say the job is dead."""
    if isinstance(exc, GpuStalled):
        context.set_trailing_metadata(())


def _known_on_unix(context, named: str | None, ticket: str) -> None:
    """A caller on the Unix socket is a process of the node with a uid: it names itself with a
    peer ticket (whose uid the fd socket read with SO_PEERCRED; kvclient sends one) or a tenant
    token, and is never the anonymous tenant (that is for TCP callers without a tenant token)."""
    if named is None and not ticket and context.peer().startswith("unix:"):
        raise Unauthenticated(
            "a caller on the Unix socket needs a peer ticket (kvclient sends one on every Register "
            f"and OpenSpace) or a tenant token ({TENANT_KEY} metadata): it is never anonymous"
        )


def _progress(step, total: int, pages: int = 0) -> pb.LoadProgress:
    """A copier LoadStep as the LoadProgress message a Load or Get streams (or the lane's words)."""
    return pb.LoadProgress(last_layer=step.last_layer, layers_done=step.layers_done,
                           done=step.layers_done == total, bytes=step.bytes,
                           events_recorded=step.events_recorded, pages=pages)


def _counters(c: Counters) -> pb.TransferCounters:
    return pb.TransferCounters(
        bytes_written=c.bytes_written,
        bytes_loaded=c.bytes_loaded,
        write_ops=c.write_ops,
        load_ops=c.load_ops,
    )


def _client_stats(c: ClientState, redact: bool = False) -> pb.ClientStats:
    """``redact``: the daemon-wide view shows only a prefix of each id, since an id is what
    lets a caller act as that client."""
    s = c.spec
    per_token = s.page_bytes // s.page_size
    return pb.ClientStats(
        client_id=public_id(c.client_id) if redact else c.client_id,
        model=s.model,
        tp_rank=s.tp_rank,
        pp_rank=s.pp_rank,
        start_layer=s.layers.start,
        end_layer=s.layers.end,
        capacity_tokens=c.capacity_tokens,
        used_tokens=c.used_tokens,
        capacity_bytes=c.capacity_tokens * per_token,
        used_bytes=c.used_tokens * per_token,
        transfers=_counters(c.counters),
        epoch=c.epoch,
        sessions=c.sessions,
    )


def _cache_counters(c: CacheCounters) -> pb.CacheCounters:
    return pb.CacheCounters(pages=c.pages, bytes=c.bytes, hits=c.hits, misses=c.misses, evictions=c.evictions,
                            dedup_pages=c.dedup_pages, dedup_bytes=c.dedup_bytes, dropped=c.dropped)


def _space_stats(st: SpaceStat) -> pb.SpaceStats:
    k = st.space
    space = pb.KVSpace(model=k.model, layout=k.layout.to_wire(), dtype=wire_dtype(k.dtype),
                       page_size=k.page_size, num_layers=k.num_layers, tp_size=k.tp_size, pp_size=k.pp_size,
                       weights=k.weights)
    return pb.SpaceStats(tenant=k.tenant, space=space, counters=_cache_counters(st.counters),
                         parts_seen=st.parts_seen, parts=st.parts, complete_pages=st.complete_pages)


def _tenant_stats(st: TenantStat) -> pb.TenantStats:
    return pb.TenantStats(tenant=st.tenant, counters=_cache_counters(st.counters), quota_bytes=st.quota_bytes)


class KVServicer(pb_grpc.KVServerServicer):
    def __init__(self, core: KVCore, reaper: Reaper, admin_token: str | None = None,
                 tenants: TenantBook | None = None, metrics: Metrics | None = None,
                 plane_spin: float = 0.0) -> None:
        self.core = core
        self.metrics = metrics or Metrics(core)  # histograms and transfer counters, observed here
        self.cache = CacheOps(core, tenants)
        self.reaper = reaper
        self.admin_token = admin_token
        self.stopping = asyncio.Event()  # set at shutdown: sessions end so the server can drain
        # The plane publishes every layer's progress words; the interval paces only the doorbell
        # that wakes a sleeping waiter (docs/lane.md, "Ringing only a sleeper").
        self.plane = (DataPlane(core.copier.progress_interval, BUCKETS, plane_spin) if plane.available()
                      else None)
        core.plane = self.plane
        if self.plane is not None:  # the cache's copies of its registrations run there too
            core.copier.plane = self.plane
            core.copier.arena_span = (core.arena.address, core.arena.capacity)
            if plane.GETS:  # and its lane Gets, whole; with a tier, only those host memory holds
                tiered = self.cache.disk is not None or self.cache.cluster is not None
                self.plane.serve_gets(core.cache, core.arena.address, core.arena.capacity,
                                      self.cache.plane_calls_ended, whole=tiered)
                self.cache.on_plane_get = self._plane_get
                self.cache.on_plane_put = self._plane_put
        core.on_plane_transfers = self._plane_transfers
        self.lanes = LaneBook(core, self.run_lane, self.plane, self.run_space_lane, self.fast_lane,
                              self.fast_space_lane)

    def _plane_get(self, nbytes: int) -> None:
        self.metrics.transfers.add("get", nbytes, "ring")

    def _plane_put(self, nbytes: int, puts: int) -> None:
        self.metrics.transfers.add("put", nbytes, "ring", puts)

    def _plane_transfers(self, written: int, writes: int, loaded: int, loads: int) -> None:
        if writes:
            self.metrics.transfers.add("write", written, "ring", writes)
        if loads:
            self.metrics.transfers.add("load", loaded, "ring", loads)

    @_abort_on_error
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        named = self.cache.tenants.named(context.invocation_metadata())
        _known_on_unix(context, named, request.peer_ticket)
        client = await self.core.register(request, named)
        spec = client.spec
        return pb.RegisterResponse(
            client_id=client.client_id,
            host_tokens=client.capacity_tokens,
            page_size=spec.page_size,
            host_bytes_per_token=spec.page_bytes // spec.page_size,
            epoch=client.epoch,
            lease_seconds=self.reaper.lease,
            reclaim_grace_seconds=self.reaper.grace,
            layer_events=client.device.event_handles,
            weights=spec.weights,
        )

    @_abort_on_error
    async def Unregister(self, request: pb.UnregisterRequest, context) -> pb.UnregisterResponse:
        return pb.UnregisterResponse(copies_pending=await self.core.unregister(request.client_id))

    @_abort_on_error
    async def Alloc(self, request: pb.AllocRequest, context) -> pb.AllocResponse:
        indices = await self.core.alloc(request.client_id, request.num_tokens)
        # The AllocResponse's wire bytes, encoded with numpy (a message of 4 Mi indices costs ~1 s
        # of GIL to build and serialise); large ones in a worker thread, off the event loop.
        if indices.size > OFF_LOOP_INDICES:
            try:
                return await asyncio.to_thread(packed.packed_int64, ALLOC_INDICES_FIELD, indices)
            except asyncio.CancelledError:  # the caller is gone and will never name these pages
                free = asyncio.ensure_future(self.core.free(request.client_id, indices))
                free.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise
        return packed.packed_int64(ALLOC_INDICES_FIELD, indices)

    @_abort_on_error
    async def Free(self, request: pb.FreeRequest, context) -> pb.FreeResponse:
        freed = await self.core.free(request.client_id, request.host_indices)
        return pb.FreeResponse(freed_tokens=freed)

    @_abort_on_error
    async def Write(self, request: pb.WriteRequest, context) -> pb.WriteResponse:
        # Whatever this call answers, its job is dead by then (or never was): say so.
        context.set_trailing_metadata(JOB_ENDED)
        return await self._write(request, "grpc")

    async def _write(self, request: pb.WriteRequest, lane: str) -> pb.WriteResponse:
        job = await self.core.prepare_job(
            request.client_id, request.host_indices, request.device_indices, request.layers,
            request.ready_event, timeout_ms=request.timeout_ms,
        )
        nbytes = await self.core.copier.write(job)
        self.metrics.transfers.add("write", nbytes, lane)
        return pb.WriteResponse(bytes=nbytes)

    async def Load(self, request: pb.LoadRequest, context) -> AsyncIterator[pb.LoadProgress]:
        started = time.perf_counter()
        try:
            context.set_trailing_metadata(JOB_ENDED)
            request = await _parsed(request)
            with self.core.share.call():
                async for progress in self._load(request, "grpc", started):
                    yield progress
        except Exception as exc:
            if not isinstance(exc, KVError):
                logger.exception("Load failed")
            _unmark_stalled(exc, context)
            await context.abort(*grpc_status(exc))
        finally:
            self.metrics.observe("Load", started)

    async def _load(self, request: pb.LoadRequest, lane: str,
                    started: float) -> AsyncIterator[pb.LoadProgress]:
        first, moved = True, 0
        job = await self.core.prepare_job(
            request.client_id, request.host_indices, request.device_indices, request.layers,
            request.ready_event, request.event_slot, request.timeout_ms,
        )
        total = len(job.local_layers)
        async for step in self.core.copier.load(job):
            if first and step.layers_done:
                first = False
                self.metrics.first_layer_landed("Load", started)
            moved = step.bytes
            yield _progress(step, total)
        self.metrics.transfers.add("load", moved, lane)  # the job is over: counted as Stats counts it

    async def Session(self, request: pb.SessionRequest, context) -> AsyncIterator[pb.SessionEvent]:
        try:
            request = await _parsed(request)
            client = self.core.client(request.client_id)
        except Exception as exc:
            await context.abort(*grpc_status(exc))
        async with self.reaper.session(client):
            yield pb.SessionEvent(epoch=client.epoch)
            # Open until the client goes away (cancels this), is unregistered, or the daemon stops.
            ends = [asyncio.ensure_future(e.wait()) for e in (client.gone, self.stopping)]
            try:
                await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for e in ends:
                    e.cancel()

    @_abort_on_error
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        core = self.core
        metadata = context.invocation_metadata()
        admin = is_admin(metadata, self.admin_token)
        if request.client_id:  # the caller holds this client's id: its own client
            clients = [core.client(request.client_id)]
            tenant = clients[0].tenant
        elif admin:
            clients = list(core.clients.values())
            tenant = None
        else:  # other peers' models, ranks and epochs are theirs: totals only
            clients = []
            tenant = self.cache.tenants.named(metadata)
        if admin:
            tenant = None  # every tenant's spaces
        core.harvest_all()  # what the data plane did, in the clients' counters
        spaces, tenants = core.cache.stats(tenant) if admin or tenant is not None else ([], [])
        totals = Counters()
        totals.add(core.totals)
        for c in core.clients.values():
            totals.add(c.counters)
        return pb.StatsResponse(
            capacity_bytes=core.arena.capacity,
            reserved_bytes=core.arena.reserved + core.arena.claimed,
            used_bytes=sum(c.pages.num_used * c.spec.page_bytes for c in core.clients.values()),
            num_clients=len(core.clients),
            transfers=_counters(totals),
            clients=[_client_stats(c, redact=not request.client_id) for c in clients],
            reclaimed_clients=core.reclaimed,
            cache_bytes=core.cache.bytes,
            spaces=[_space_stats(st) for st in spaces],
            tenants=[_tenant_stats(st) for st in tenants],
            kept=_kept(core.recovery, admin),
            tiers=_tiers(core, admin),
            room_bytes=core.arena.held,
        )

    # ---- the node-wide cache ------------------------------------------------------------------

    @_abort_on_error
    async def OpenSpace(self, request: pb.OpenSpaceRequest, context) -> pb.OpenSpaceResponse:
        named = self.cache.tenants.named(context.invocation_metadata())
        _known_on_unix(context, named, request.peer_ticket)
        peer = None
        if request.peer_ticket and self.core.tickets is not None:
            ticket = self.core.tickets.redeem(request.peer_ticket)
            ticket.close_off_loop()  # a space needs no descriptors
            peer = ticket.peer
        tenant = tenant_of(named, peer)
        space = space_from_wire(tenant, request.space)
        return pb.OpenSpaceResponse(space_id=await self.cache.open_space(space), tenant=tenant)

    @_abort_on_error
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        return await self._lookup(request)

    async def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        if request.timeout_ms:  # a Lookup given up ends its lease (CacheOps.lookup)
            try:  # a timer only for a Lookup that waits (kvserver.api.eager)
                found = await bounded(self.cache.lookup(request), request.timeout_ms / 1000)
            except TimeoutError:
                raise DeadlineExceeded(f"the Lookup took longer than its timeout_ms "
                                       f"{request.timeout_ms}") from None
        else:
            found = await self.cache.lookup(request)
        return pb.LookupResponse(pages=found.pages, lease_id=found.lease_id, disk_pages=found.lower,
                                 cluster_pages=found.cluster)

    @_abort_on_error
    async def Events(self, request: pb.EventsRequest, context) -> pb.EventsResponse:
        log_id, events, next_seq, gap = self.cache.events(request)
        out = []
        for ev in events:
            named = ev.keys.as_bytes()
            keys = [k for k in named if k is not None]
            out.append(pb.KVEvent(seq=ev.seq, ts=ev.ts, removed=not ev.stored, medium=ev.medium,
                                  locality=ev.locality, keys=keys, unnamed=len(named) - len(keys)))
        return pb.EventsResponse(log_id=log_id, events=out, next_seq=next_seq, gap=gap)

    @_abort_on_error
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=await self.cache.release(request))

    @_abort_on_error
    async def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        context.set_trailing_metadata(JOB_ENDED)
        return await self._put(request, "grpc")

    async def _put(self, request: pb.PutRequest, lane: str) -> pb.PutResponse:
        got = await self.cache.put(request)
        if got.stored:  # a copy ran (as Stats counts: a Put of nothing new copies nothing)
            self.metrics.transfers.add("put", got.bytes, lane)
        return pb.PutResponse(stored=got.stored, present=got.present, dropped=got.dropped, bytes=got.bytes)

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.LoadProgress]:
        started = time.perf_counter()
        try:
            context.set_trailing_metadata(JOB_ENDED)
            request = await _parsed(request)
            with self.core.share.call():
                async for progress in self._get(request, "grpc", started):
                    yield progress
        except Exception as exc:
            if not isinstance(exc, KVError):
                logger.exception("Get failed")
            _unmark_stalled(exc, context)
            await context.abort(*grpc_status(exc))
        finally:
            self.metrics.observe("Get", started)

    async def _get(self, request: pb.GetRequest, lane: str, started: float) -> AsyncIterator[pb.LoadProgress]:
        first, moved = True, -1
        total = None
        parts = bool(request.parts)
        async for found, step in self.cache.get(request):
            pages = sum(found)
            part_pages = found if parts else ()
            if step is None:  # first: how many pages; nothing stored is one message, done
                yield pb.LoadProgress(done=pages == 0, pages=pages, part_pages=part_pages)
                if pages == 0:
                    return
                continue
            if total is None:
                total = len(request.layers) or len(self.core.client(request.client_id).spec.layers)
            if first and step.layers_done:
                first = False
                self.metrics.first_layer_landed("Get", started)
            moved = step.bytes
            progress = _progress(step, total, pages)
            progress.part_pages.extend(part_pages)
            yield progress
        if moved >= 0:  # a copy ran and is over (a Get that found nothing copies nothing)
            self.metrics.transfers.add("get", moved, lane)

    # ---- the data-plane fast lane (docs/lane.md) ------------------------------------------------

    @_abort_on_error
    async def OpenLane(self, request: pb.OpenLaneRequest, context) -> pb.OpenLaneResponse:
        named = self.cache.tenants.named(context.invocation_metadata())
        if request.space_id:
            if request.client_id:
                self.lanes.spend(request.peer_ticket)
                raise InvalidArgument("give exactly one of client_id (an engine's lane) and space_id "
                                      "(a scheduler's lane of a space)")
            lane = await self.lanes.open_space(request.space_id, request.peer_ticket, named,
                                               self.cache.space_tenant)
            return pb.OpenLaneResponse(slots=lane.slots, request_bytes=ring.REQUEST_BYTES,
                                       response_bytes=ring.RESPONSE_BYTES, rpc_mask=ring.SPACE_RPC_MASK,
                                       clock_ns=time.monotonic_ns())
        lane = await self.lanes.open(request.client_id, request.peer_ticket, named)
        return pb.OpenLaneResponse(slots=lane.slots, request_bytes=ring.REQUEST_BYTES,
                                   response_bytes=ring.RESPONSE_BYTES, request_format=lane_request.VERSION,
                                   rpc_mask=ring.RPC_MASK, clock_ns=time.monotonic_ns())

    async def run_space_lane(self, space_id: str, rpc: str, data: bytes,
                             progress: Callable[[Any], None]) -> bytes:
        """One request that came on ``space_id``'s lane: a Lookup of that space, run by the code
        the Lookup RPC runs."""
        started = time.perf_counter()
        try:
            if rpc != "Lookup":
                raise InvalidArgument(f"a space's lane carries only Lookups, not {rpc}")
            request = _lenient(pb.LookupRequest)(data)
            _check_parsed(request)
            if request.client_id:
                raise InvalidArgument("a Lookup on a space's lane is the space's: it names no client_id")
            if request.space_id != space_id:
                raise PermissionDenied("a space's lane carries only the Lookups of the space it was "
                                       "opened for")
            with self.core.share.call():
                return (await self._lookup(request)).SerializeToString()
        except Exception as exc:
            if not isinstance(exc, KVError):
                logger.exception("Lookup on a space's lane failed")
            raise
        finally:
            self.metrics.observe("Lookup", started)

    def fast_lane(self, client_id: str, lane: Lane, slot: int, rpc: int, data: bytes, counted: bool) -> bool:
        """A Get or Put handed over by the data plane, served without a task where the plane can
        copy it while nothing else of its client is in flight (``CacheOps.get_on_plane``,
        ``put_on_plane``: the checks and plan the RPC runs, then no task, no step, no progress
        message of the loop's); a Lookup that runs whole at once (``lookup_now``). False:
        ``run_lane`` serves it (nothing was changed): whatever that path would refuse, or serve
        otherwise, comes back to it."""
        started = time.perf_counter()
        if rpc == ring.RPC_LOOKUP:
            request = _lenient(pb.LookupRequest)(data)
            if (isinstance(request, MalformedRequest) or request.client_id != client_id
                    or request.space_id):
                return False
            return self._lookup_now(request, lane, slot, counted, started)
        if rpc == ring.RPC_PUT:
            request = _lenient(pb.PutRequest)(data)
            if isinstance(request, MalformedRequest) or request.client_id != client_id:
                return False
            return self._fast_put(request, lane, slot, counted, started)
        request = _lenient(pb.GetRequest)(data)
        if isinstance(request, MalformedRequest) or request.client_id != client_id:
            return False
        arrival = time.monotonic_ns()

        def answer(found: int) -> Answer:  # the plane says found at once, then copies
            return Answer(lane.plane_handle, slot, found, request.timeout_ms, arrival, counted)

        def ended(ok: bool, moved: int) -> None:  # the plane answered the slot and gave its count back
            lane.answered(False)
            if ok:
                self.metrics.transfers.add("get", moved, "ring")

        try:
            found = self.cache.get_on_plane(request, answer, ended)
        except KVError as exc:  # past its checks: this path's answer
            code, text = status_of(exc)
            lane.answer_now(slot, counted, b"", int(code), text)
            self._observe("Get", started)
            return True
        if found is None:
            return False
        if found == 0:  # nothing to copy: answered here, as the RPC's one message
            lane.answer_none_found(slot, counted)
            self._observe("Get", started)
        return True

    def fast_space_lane(self, space_id: str, lane: Lane, slot: int, rpc: int, data: bytes,
                        counted: bool) -> bool:
        """A Lookup on ``space_id``'s lane (a scheduler's) served without a task, as ``fast_lane``
        serves an engine's; False: ``run_space_lane`` serves it, and words what it refuses. Once
        the space has all its parts, the data plane answers the lane's next ones itself
        (``CacheOps.serve_space_on_plane``)."""
        started = time.perf_counter()
        request = _lenient(pb.LookupRequest)(data)
        if (rpc != ring.RPC_LOOKUP or isinstance(request, MalformedRequest) or request.client_id
                or request.space_id != space_id):
            return False
        self.cache.serve_space_on_plane(space_id, lane.gate)  # (it answers the next ones, once it can)
        return self._lookup_now(request, lane, slot, counted, started)

    def _lookup_now(self, request: pb.LookupRequest, lane: Lane, slot: int, counted: bool,
                    started: float) -> bool:
        found = self.cache.lookup_now(request)
        if found is None:
            return False
        response = pb.LookupResponse(pages=found.pages, lease_id=found.lease_id, disk_pages=found.lower,
                                     cluster_pages=found.cluster).SerializeToString()
        lane.answer_now(slot, counted, response)
        self._observe("Lookup", started)
        return True

    def _observe(self, op: str, started: float) -> None:
        """A request served without a task is answered: nothing after it may raise into ``Lane.take``
        (which would serve it again)."""
        try:
            self.metrics.observe(op, started)
        except Exception:
            logger.exception("observing a %s served without a task failed", op)

    def _fast_put(self, request: pb.PutRequest, lane: Lane, slot: int, counted: bool, started: float) -> bool:
        def answer(got: PutOutcome | None, error: BaseException | None) -> None:
            if got is not None:
                response = pb.PutResponse(stored=got.stored, present=got.present, dropped=got.dropped,
                                          bytes=got.bytes).SerializeToString()
                lane.answer_now(slot, counted, response)
                if got.stored:  # a copy ran (as Stats counts: a Put of nothing new copies nothing)
                    self.metrics.transfers.add("put", got.bytes, "ring")
            else:
                code, text = status_of(error)
                lane.answer_now(slot, counted, b"", int(code), text)
            self._observe("Put", started)

        try:
            got = self.cache.put_on_plane(request, answer)
        except KVError as exc:  # past its checks: this path's answer
            answer(None, exc)
            return True
        if got is None:
            return False
        if got is not True:  # nothing to copy: answered now
            answer(got, None)
        return True

    async def _binary_request(self, client_id: str, rpc: str, kind: int, data: bytes) -> Any:
        """A request in the lane's binary format, its indices bounded by its header before they
        are made (a slot's bytes can name 16 M) and made off the loop when there are many."""
        try:
            page_size = self.core.client(client_id).spec.page_size
            size = lane_request.expanded_size(data, kind, page_size)
            self.core.check_size(size)
            if size <= OFF_LOOP_INDICES:
                return lane_request.parse(data, kind, client_id, page_size)
            return await wire.off_loop(lane_request.parse, data, kind, client_id, page_size)
        except ValueError as exc:
            raise InvalidArgument(f"malformed {rpc} request on the lane: {exc}") from None

    async def run_lane(self, client_id: str, rpc: str, data: bytes, progress: Callable[[Any], None]) -> bytes:
        """One request that came on ``client_id``'s lane: parsed and run by the code its RPC runs."""
        started = time.perf_counter()
        try:
            if rpc in _BINARY:  # the lane's own format: it names no client, its lane's is meant
                rpc, kind = _BINARY[rpc]
                request = await self._binary_request(client_id, rpc, kind, data)
            else:
                request = await _parsed(_lenient(_LANE_REQUESTS[rpc], defer=True)(data))
            if rpc == "Lookup" and request.space_id:
                raise InvalidArgument("a Lookup on a lane is its engine's: it names no space_id")
            if request.client_id != client_id:
                if request.client_id not in self.core.clients:  # unknown: answered as the RPC would
                    self.core.client(request.client_id)
                # Known: refused without a look at it (that would renew its lease).
                raise PermissionDenied("a lane carries only the calls of the registration that opened it")
            if rpc == "Get" and request.parts:
                raise InvalidArgument("a Get with parts is not carried by the lane (its progress words have "
                                      "no room for part_pages): send it on gRPC")
            with self.core.share.call():
                if rpc == "Write":
                    return (await self._write(request, "ring")).SerializeToString()
                if rpc == "Put":
                    return (await self._put(request, "ring")).SerializeToString()
                if rpc == "Lookup":
                    return (await self._lookup(request)).SerializeToString()
                steps = self._load if rpc == "Load" else self._get
                async with contextlib.aclosing(steps(request, "ring", started)) as stream:
                    async for message in stream:
                        progress(message)  # if it raises, the job still ends here, not at a GC
                return b""
        except Exception as exc:
            if not isinstance(exc, KVError):
                logger.exception("%s on a lane failed", rpc)
            raise
        finally:
            self.metrics.observe(rpc, started)


_BINARY = {"WriteB": ("Write", lane_request.KIND_WRITE), "LoadB": ("Load", lane_request.KIND_LOAD)}
_LANE_REQUESTS = {"Write": pb.WriteRequest, "Load": pb.LoadRequest, "Put": pb.PutRequest,
                  "Get": pb.GetRequest, "Lookup": pb.LookupRequest}


def _serialize(response: Any) -> bytes:
    """A response message's bytes; a handler may return them ready-made (see Alloc)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(servicer: KVServicer, server: Any) -> None:
    """The generated add_KVServerServicer_to_server, with request parsing that cannot raise."""
    service = pb.DESCRIPTOR.services_by_name["KVServer"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request_cls, defer=True),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63: faster dispatch
        server.add_registered_method_handlers(service.full_name, handlers)


def _tiers(core: KVCore, admin: bool) -> list[pb.TierStats]:
    out = []
    for t in tier_stats(core):
        msg = pb.TierStats(
            name=t.name, capacity_bytes=t.capacity_bytes, slab_bytes=t.slab_bytes, pages=t.pages,
            bytes=t.bytes, hits=t.hits, evicted_pages=t.evicted_pages, written_pages=t.written_pages,
            written_bytes=t.written_bytes, promoted_pages=t.promoted_pages, promoted_bytes=t.promoted_bytes,
            skipped_pages=t.skipped_pages, write_errors=t.write_errors, read_errors=t.read_errors,
            bad_checks=t.bad_checks, direct_io=t.direct_io, present_pages=t.present_pages,
            joined=t.joined, available=t.available, breaker_trips=t.breaker_trips, timeouts=t.timeouts,
            busy=t.busy, quarantined_pages=t.quarantined_pages)
        if t.recovery is not None:
            msg.kept.CopyFrom(_kept(t.recovery, admin))
        out.append(msg)
    return out


def _kept(rec: Recovery | None, admin: bool) -> pb.KeptCache | None:
    if rec is None:
        return None
    return pb.KeptCache(dir=rec.path if admin else "", adopted_pages=rec.adopted_pages,
                        adopted_bytes=rec.adopted_bytes, adopt_seconds=rec.seconds, torn_pages=rec.torn,
                        dropped_pages=rec.dropped, evicted_pages=rec.evicted,
                        reason=rec.reason if admin else ("" if not rec.reason else "started empty"))
