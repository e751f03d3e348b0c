"""The daemon's core: clients, the host arena, pages, and checking transfer requests. No gRPC.

State changes (register, alloc, free, unregister) run on the event loop thread, so they need no
locks. Checked requests become ``ClientJob``s that ``copier.Copier`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from kvserver.cluster import ClusterTier, MooncakeClient
from kvserver.config import DEFAULT_MAX_REQUEST_INDICES, format_size
from kvserver.copies import transfer
from kvserver.copies.order import JobOrder, dense_marks, dense_pays
from kvserver.core import epochs
from kvserver.core.client_state import ClientSpec, ClientState, Counters, public_id
from kvserver.core.copier import ClientJob, Copier, plane_turn, wait_until
from kvserver.core.rooms import Rooms
from kvserver.core.share import LoopShare, in_steps
from kvserver.disk import DiskTier
from kvserver.errors import InvalidArgument, NoCapacity, UnknownClient, shown
from kvserver.events import CPU, LOCAL, REMOTE, STORAGE, EventBook
from kvserver.events.book import Publisher
from kvserver.host.arena import HostArena, aligned_capacity, populate
from kvserver.host.kept import KeptDir, KeptDirError
from kvserver.host.pages import PageAllocator
from kvserver.host.regions import REGION_ALIGN, align_down, align_up
from kvserver.media import ShmAccess, SlabPinner, open_pool, pool_descriptors
from kvserver.peers.tenants import tenant_of
from kvserver.peers.tickets import TicketBook, fd_budget
from kvserver.protocol.raw_memory import rows_at
from kvserver.store import KVCache
from kvserver.store.keep import Recovery, kept_shape
from kvserver.store.pages import MIN_PAGE_BYTES
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger(__name__)

# MIN_PAGE_BYTES (from the cache, which sizes its tables by it) is the least bytes of one host page
# (every layer and part of the client's range): each page costs the daemon up to 9 bytes of
# bookkeeping in a region (free list, allocated bitmap, busy count), at most 14% of it.
LIMIT_FLAG = "--max-pages-per-client, KVSERVER_MAX_PAGES_PER_CLIENT"
# A Free of more host indices is checked in a worker thread (numpy releases the GIL), so the event
# loop keeps serving other engines meanwhile; 4 Mi indices take ~0.1 s to check.
OFF_LOOP_INDICES = 1 << 16
PLANE_POLL_SECONDS = 0.0005  # how often a Free waiting on the data plane's copies looks again
MAX_SUCCESSORS = 4096  # registrations replaced whose successor is remembered (the oldest go first)
_CLIENT_ID = re.compile(r"[0-9a-f]{32}")  # what ``secrets.token_hex(16)`` makes


class KVCore:
    def __init__(
        self,
        host_memory: int,
        copy_threads: int = 1,
        progress_interval: float = 0.0,
        max_clients: int = 1024,
        max_clients_per_tenant: int = 256,
        max_request_indices: int = DEFAULT_MAX_REQUEST_INDICES,
        max_pages_per_client: int = 1 << 24,
        allow_named_shm: bool = False,
        tenant_quota: int = 0,
        tenant_quotas: dict[str, int] | None = None,
        tenant_region_quota: int = 0,
        host_memory_dir: str | None = None,
        disk_cache: str | None = None,
        disk_size: int = 0,
        disk_threads: int = 8,
        disk_size_share: bool = False,
        cluster: MooncakeClient | None = None,
        cluster_timeout: float = 1.0,
        event_publisher: Publisher | None = None,
    ) -> None:
        self.recovery: Recovery | None = None  # what a kept cache's start found (None: not kept)
        self._kept: KeptDir | None = None
        quotas = tenant_quotas or {}
        if host_memory_dir is None:
            self._build(host_memory, tenant_quota, quotas)
        else:
            self._build_kept(host_memory_dir, host_memory, tenant_quota, quotas)
        self.disk: DiskTier | None = None  # the disk tier (--disk-cache), under the host cache
        self.left_running = False  # close() left a cluster call running: the process must end (os._exit)
        if disk_cache:
            self.disk = self._build_disk(disk_cache, disk_size, disk_threads, tenant_quota, quotas,
                                         disk_size_share)
        # The cluster tier (--cluster-master): other nodes' pages on a local miss, joined in the background.
        self.cluster: ClusterTier | None = None
        if cluster is not None:
            self.cluster = ClusterTier(cluster, self.cache, lambda: self.arena.address, self.arena.capacity,
                                       timeout=cluster_timeout)
            logger.info("%s", self.cluster.describe())
        # KV events: what each space gains and loses in each tier, for engines' connectors to
        # read (Events) and for the daemon's own publisher (--kv-events-endpoint).
        self.events = EventBook(event_publisher)
        self.cache.on_complete.append(self.events.listener(CPU, LOCAL))
        if self.disk is not None:
            self.disk.cache.on_complete.append(self.events.listener(STORAGE, LOCAL))
        if self.cluster is not None:
            # Only a space of one part: the cluster's copies are not counted across parts, and a
            # key one TP rank stored is no hit for the whole engine.
            def published(part, keys) -> None:
                if part.space.key.num_parts == 1:
                    self.events.record(part.space.key, True, CPU, REMOTE, keys)

            self.cluster.on_published = published
        self.max_clients = max_clients
        self.max_clients_per_tenant = max_clients_per_tenant
        self._registering_by_tenant: Counter[str] = Counter()  # registrations under way, by tenant
        # Host memory one tenant's regions take together (0: the whole budget), and what they take.
        self.tenant_region_quota = tenant_region_quota
        self._region_bytes_by_tenant: Counter[str] = Counter()  # booked under way, too
        self._quarantined_bytes_by_tenant: Counter[str] = Counter()  # of those, quarantined CUDA pools'
        self.max_request_indices = max_request_indices
        self.max_pages_per_client = max_pages_per_client
        self.clients: dict[str, ClientState] = {}
        self._registering = 0  # registrations under way (they may await worker threads)
        self._replacing = 0  # of those, the ones replacing a client still registered
        self._in_threads = 0  # registrations and CUDA pool closes in worker threads
        self._thread_done = asyncio.Event()  # set whenever one of those ends
        self._background: set[asyncio.Task] = set()  # work that outlives its call (``in_background``)
        self.reclaimed = 0  # clients reclaimed by liveness
        self.totals = Counters()  # transfers of clients already gone
        self.copier = Copier(copy_threads, progress_interval)
        self.share = LoopShare()  # the loop between long cache steps and short calls (share.py)
        self.rooms = Rooms(self.arena, self.cache, self.share, self._in_thread)  # Registers' room (rooms.py)
        self.allow_named_shm = allow_named_shm
        # Descriptors the pools' mappings hold, by uid (each mapped memfd keeps one open, a named
        # object two): at most a quarter of the process's limit for one uid's pools, so that no
        # peer can take the descriptors every other engine's calls need.
        self.max_pool_fds_per_uid = fd_budget()
        self._pool_fds: Counter[int | str] = Counter()
        # And the address space their mappings take, by uid: at most the node's memory for one
        # uid's pools (a sealed sparse memfd of 64 TiB costs its maker nothing; eight filled the
        # daemon's). One uid's shared-memory pools are opened one at a time, each seeing what the
        # last one took.
        self.max_mapped_bytes_per_uid = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self._mapped: Counter[int | str] = Counter()
        self._map_locks: dict[int | str, list] = {}  # uid -> [its lock, registrations using it]
        # A registration replaced -> the one that replaced it; Registers replacing one: [lock, users].
        self._successors: dict[str, str] = {}
        self._replace_locks: dict[str, list] = {}
        self._closing = False  # ``close`` has begun
        # Released clients whose GPU work may still run, with the IPC allocations it may touch:
        # an Unregister of one, or of any client sharing one of those allocations, says so.
        self._quarantined: dict[str, frozenset[bytes]] = {}
        self._releasing: dict[str, ClientState] = {}  # out of the table, their release not yet ended
        self.tickets: TicketBook | None = None  # the fd socket's (server.py); None without a Unix socket
        # The compiled data plane (kvserver.lane.plane.DataPlane), set by the servicer where it
        # runs; its transfers reach the metrics through on_plane_transfers(written, loaded).
        self.plane: Any = None
        self.on_plane_transfers: Callable[[int, int, int, int], None] | None = None  # bytes, ops, bytes, ops
        # Told of a client whose gate closed (its release): the cache pages set aside for its
        # Puts go back (CacheOps._gate_closed).
        self.on_gate_closed: Callable[[ClientState], None] | None = None
        # Told, at a harvest, of the hits and misses of a client's Lookups that the plane answered
        # and settled itself (Gate.take_lookups): counted in its part's space and tenant
        # (CacheOps.plane_lookups_counted).
        self.on_plane_lookups: Callable[[ClientState, int, int], None] | None = None

    def _build(self, host_memory: int, tenant_quota: int, quotas: dict[str, int],
               kept: KeptDir | None = None) -> None:
        # CUDA copies reach cache pages by host address: their slabs are pinned once CUDA is in
        # use. A pinner of its own per build: a build given up leaves no slab address behind.
        self.slab_pinner = SlabPinner()
        self.arena = HostArena(host_memory, kept)
        # The node-wide cache: its pages share the arena (and so the budget) with clients' regions.
        self.cache = KVCache(self.arena, default_quota=tenant_quota, quotas=quotas)
        base = self.arena.address
        self.cache.on_slab_added.append(lambda off, n: self.slab_pinner.added(base + off, n))
        self.cache.on_slab_removed.append(lambda off, n: self.slab_pinner.removed(base + off, n))
        self.recovery = self.cache.adopt()

    def _build_kept(self, path: str, host_memory: int, tenant_quota: int, quotas: dict[str, int]) -> None:
        """The cache kept in files under ``path`` (--host-memory-dir), adopted from them as far as
        they pass every check. Files that cannot be adopted are started over; a directory that
        cannot be used leaves the cache in the daemon's own memory. Either way the daemon serves."""
        try:
            kept = KeptDir(path, kept_shape(aligned_capacity(host_memory)), unchecked=True)
        except (KeptDirError, OSError) as exc:
            logger.error("the host cache cannot be kept in %s: %s; it lives in the daemon's own memory "
                         "and ends with it", path, exc)
            self._build(host_memory, tenant_quota, quotas)
            return
        try:
            self._build(host_memory, tenant_quota, quotas, kept)
        except Exception as exc:  # a kept file no check foresaw: started over, never the daemon's end
            logger.warning("the host cache kept in %s cannot be adopted (%s: %s): starting it over",
                           path, type(exc).__name__, exc)
            try:
                kept.start_over(f"adopting it failed ({type(exc).__name__}: {exc})")
                self._build(host_memory, tenant_quota, quotas, kept)
            except (KeptDirError, OSError) as again:
                kept.close()
                logger.error("the host cache cannot be kept in %s: %s; it lives in the daemon's own "
                             "memory and ends with it", path, again)
                self._build(host_memory, tenant_quota, quotas)
                return
        self._kept = kept
        rec = self.recovery
        if rec is not None:
            if rec.reason and kept.found:
                logger.warning("%s", rec.line())
            else:
                logger.info("%s", rec.line())

    def _build_disk(self, path: str, size: int, threads: int, tenant_quota: int,
                    quotas: dict[str, int], resizable: bool = False) -> DiskTier | None:
        """The disk tier in ``path``; None, the daemon serving from host memory alone, if the
        directory cannot be used. A tenant's disk quota is its share of host memory, of the disk."""
        host = self.arena.capacity

        def scaled(q: int) -> int:
            return 0 if q <= 0 or q >= host else max(1, q * size // host)

        try:
            disk = DiskTier(path, size, self.cache, lambda: self.arena.address,
                            default_quota=scaled(tenant_quota),
                            quotas={name: scaled(q) for name, q in quotas.items()}, threads=threads,
                            resizable=resizable)
        except Exception as exc:  # (KeptDirError, OSError, ValueError; whatever else its files hold)
            logger.error("no disk cache: %s cannot be used (%s: %s); the cache ends at host memory", path,
                         type(exc).__name__, exc)
            return None
        logger.info("%s", disk.describe())
        st = os.statvfs(disk.path)
        if disk.arena.capacity - disk.cache.bytes > st.f_bavail * st.f_frsize:
            logger.warning("the disk cache may fill its file system: %s of %s free there (--disk-size); "
                           "a full file system costs the cache pages, and whatever else writes there",
                           format_size(st.f_bavail * st.f_frsize), format_size(disk.arena.capacity))
        return disk

    # ---- registration -------------------------------------------------------------------

    async def register(self, req: pb.RegisterRequest, tenant: str | None = None) -> ClientState:
        """``_register_call``; Registers naming one registration to replace run one at a time, and
        one that finds it replaced already replaces its successor instead (an engine's retry, or
        its probe's Register beside its client's), so one engine never holds two registrations."""
        named = req.replaces_client_id
        if not named:
            return await self._register_call(req, tenant)
        while True:
            now = self._latest(named)
            async with _keyed_lock(self._replace_locks, now):  # one Register replacing it at a time
                if self._latest(named) != now:
                    continue  # replaced meanwhile: by the one that holds it now
                client = await self._register_call(req if now == named else _replacing(req, now), tenant)
                # Linked whether it was live or gone (a daemon restarted, a registration reclaimed:
                # a retry naming it replaces this one), but only an id of the daemon's own form
                # (not bytes a peer chose); the oldest links go first past MAX_SUCCESSORS.
                if _CLIENT_ID.fullmatch(now):
                    self._successors[now] = client.client_id
                    while len(self._successors) > MAX_SUCCESSORS:
                        del self._successors[next(iter(self._successors))]
                return client

    def _latest(self, client_id: str) -> str:
        """The registration that replaced ``client_id``, or the one that replaced that, ...: the
        newest of the line (``client_id`` itself if none replaced it)."""
        for _ in range(MAX_SUCCESSORS):  # (links only go to newer ids: no cycle)
            nxt = self._successors.get(client_id)
            if nxt is None:
                break
            client_id = nxt
        return client_id

    async def _register_call(self, req: pb.RegisterRequest, tenant: str | None = None) -> ClientState:
        """Opens the engine's pool and gives it a host region. ``tenant``: the tenant of the
        call's tenant token, if it sent one (else the peer ticket's uid decides). Opening and
        attaching a pool run in a worker thread: for a CUDA pool (CuPy's first import, a CUDA
        context, IPC mappings, pinning the region) they take seconds, and the loop keeps serving
        everyone else."""
        spec = ClientSpec.from_request(req)
        # host_tokens 0: an engine that uses only the node-wide cache, with no region of its own.
        least, most = self._grant_bounds(req, spec)
        # The ticket is spent by this call whatever its outcome from here on; its fds close once
        # the pool is open. Redeemed before anything changes: a bad ticket changes nothing.
        has_socket = self.tickets is not None
        ticket = self.tickets.redeem(req.peer_ticket, pidfd=True) if req.peer_ticket and has_socket else None
        access = ShmAccess(tuple(ticket.fds) if ticket else (), ticket.peer if ticket else None,
                           self.allow_named_shm, has_socket)
        who = tenant_of(tenant, access.peer)
        self._registering += 1
        self._registering_by_tenant[who] += 1
        replaced = None
        fds_of, booked = access.peer.uid if access.peer is not None else who, 0
        try:
            replaced = self.clients.get(req.replaces_client_id) if req.replaces_client_id else None
            # A registration replacing a live one takes no new place: its old client is counted.
            self._replacing += replaced is not None
            # A walk of every buffer (0.17 s for 65536 layers, once allowed): off the loop.
            fds, fd_indices = await self._in_thread(pool_descriptors, req.device_pool)
            held_fds = self._pool_fds[fds_of] - (replaced.pool_fds if replaced is not None
                                                 and replaced.pool_fds_of == fds_of else 0)
            if held_fds + fds > self.max_pool_fds_per_uid:
                raise NoCapacity(
                    f"the pools registered by uid {fds_of} hold {held_fds} of the daemon's descriptors; "
                    f"this one's {fds} would pass the most one uid's pools may hold "
                    f"({self.max_pool_fds_per_uid}): unregister one first, or share memfds between buffers"
                )
            self._pool_fds[fds_of] += fds
            booked = fds
            if len(self.clients) + self._registering - self._replacing > self.max_clients:
                raise NoCapacity(f"client limit reached: {self.max_clients} clients are registered")
            held = self._registering_by_tenant[who] + sum(c.tenant == who for c in self.clients.values())
            if held - (replaced is not None and replaced.tenant == who) > self.max_clients_per_tenant:
                raise NoCapacity(
                    f"tenant {who} holds {self.max_clients_per_tenant} registrations, its limit "
                    "(--max-clients-per-tenant): unregister one first"
                )
            # Its tenant's region quota, before its pool is opened (seconds for a CUDA pool) and
            # before a registration it replaces is let go (which stays when this one never fits).
            self._region_room(who, spec, least, least, replaced.quota_bytes if replaced is not None
                              and replaced.tenant == who else 0, replacing=replaced is not None)
            # Other registrations' rooms in flight it would fit beside are waited out first, holding
            # nothing (its uid's turn to map a pool, the registration it replaces).
            await self.rooms.wait(least * spec.page_bytes, replaced.region_bytes if replaced else 0)
            if replaced is None:  # else its region is not free yet: checked once it is released
                self._check_fits(spec, least, evict=False)  # before the pool is opened; again once it is
            elif least * spec.page_bytes > (self.arena.available + self.cache.bytes + replaced.region_bytes
                                            - (owed := max(0, -self.rooms.budget_back()))):
                # Not even with the old region, and every cached page (but those other registrations'
                # rooms still have to evict), given back: refused while the registration it would
                # replace still stands.
                raise NoCapacity(
                    f"not enough host memory: this registration accepts no fewer than "
                    f"{least * spec.page_size} host tokens ({least * spec.page_bytes} bytes), more than the "
                    f"{self.arena.available} "
                    f"bytes free, the {replaced.region_bytes} of the registration it replaces and the "
                    f"{self.cache.bytes} the cache holds together"
                    + (f", less the {owed} other registrations' rooms have still to evict" if owed else "")
                    + "; the registration it names stays"
                )
            if fds:  # a shared-memory pool: its mappings take the daemon's address space
                async with self._map_lock(fds_of):
                    # The registration it replaces is let go once this pool is open: its
                    # mappings are not this one's to pay for (as its descriptors above).
                    mapped = self._mapped[fds_of] - (replaced.mapped_bytes if replaced is not None
                                                     and replaced.pool_fds_of == fds_of else 0)
                    access = dataclasses.replace(access, map_budget=self.max_mapped_bytes_per_uid - mapped)
                    client = await self._register(req, spec, access, least, most, who)
                    client.mapped_bytes = client.device.mapped_bytes
                    self._mapped[fds_of] += client.mapped_bytes
            else:
                client = await self._register(req, spec, access, least, most, who)
            client.peer = access.peer
            client.tenant = who
            client.pool_fds, client.pool_fds_of = fds, fds_of
        except BaseException:
            self._give_pool_fds(fds_of, booked)
            if ticket is not None:  # off the loop: it may hold the last reference to a large memfd
                ticket.close_off_loop()
            raise
        else:
            if ticket is not None:
                pidfd = ticket.take_pidfd()
                client.pidfd = pidfd if pidfd >= 0 else -1
                ticket.close_mapped(fd_indices)
            return client
        finally:
            self._registering -= 1
            self._registering_by_tenant[who] -= 1
            if not self._registering_by_tenant[who]:
                del self._registering_by_tenant[who]
            self._replacing -= replaced is not None

    def _give_pool_fds(self, of: int | str, n: int) -> None:
        self._pool_fds[of] -= n
        if self._pool_fds[of] <= 0:
            del self._pool_fds[of]

    def _map_lock(self, of: int | str) -> contextlib.AbstractAsyncContextManager:
        """One shared-memory pool of uid ``of`` opened at a time (its address-space budget)."""
        return _keyed_lock(self._map_locks, of)

    async def _release_replaced(self, client_id: str) -> None:
        """An engine registering again names its previous registration: released first (its
        jobs stopped, its region returned), so one engine never holds two regions."""
        old = self.clients.get(client_id)
        if old is None:
            return
        if old.closing:
            await old.gone.wait()
        else:
            await self.unregister(client_id, reason="replaced by a new registration")

    def _grant_bounds(self, req: pb.RegisterRequest, spec: ClientSpec) -> tuple[int, int]:
        """The least and the most pages this registration may be granted; refuses what no budget
        could serve: pages too small to be worth their bookkeeping, and more pages than a client
        may hold or than host indices can name."""
        p, page_bytes = spec.page_size, spec.page_bytes
        if page_bytes < MIN_PAGE_BYTES:
            per_token = page_bytes // p
            raise InvalidArgument(
                f"a host page of {page_bytes} bytes ({p} tokens of {per_token} bytes over the client's "
                f"layers) is too small: pages must be at least {MIN_PAGE_BYTES} bytes, since each costs "
                f"the daemon bookkeeping; use a page_size of at least {-(-MIN_PAGE_BYTES // per_token)}"
            )
        least_tokens = req.min_host_tokens or req.host_tokens
        if least_tokens > req.host_tokens:
            raise InvalidArgument(
                f"min_host_tokens {req.min_host_tokens} is more than host_tokens {req.host_tokens}"
            )
        least = -(-least_tokens // p)
        if least > self.max_pages_per_client:
            raise NoCapacity(
                f"this registration accepts no fewer than {least} pages of {p} tokens, but a client "
                f"holds at most {self.max_pages_per_client} pages ({LIMIT_FLAG}): ask for fewer host "
                "tokens, accept fewer (min_host_tokens), or use larger pages"
            )
        if least * p > epochs.MAX_SLOTS:
            raise NoCapacity(
                f"this registration accepts no fewer than {least * p} host token slots, but a client "
                f"region holds at most {epochs.MAX_SLOTS} host token slots (host indices carry the "
                f"registration epoch above bit {epochs.EPOCH_SHIFT})"
            )
        want = -(-req.host_tokens // p)
        return least, min(want, self.max_pages_per_client, epochs.MAX_SLOTS // p)

    def _check_fits(self, spec: ClientSpec, least: int, evict: bool = True) -> int:
        """Pages of ``spec`` that fit in the largest free region; refuses fewer than ``least``,
        naming what is free in bytes and in tokens of this layout.

        Cached pages give way to the least the engine accepts, never to more, and only once its
        pool has opened and passed its checks (``evict``): before that, the check counts the
        cache's bytes as free, and a refused registration has evicted nothing. Nothing is evicted
        either when even an empty cache would leave too little."""
        page_bytes, p = spec.page_bytes, spec.page_size
        need = least * page_bytes
        if least and self.arena.largest_free() < need:
            reclaimable = self.cache.bytes
            # (what other Registers' rooms give back beyond their regions: free once they are done)
            if not evict and self.arena.largest_free() + reclaimable + self.rooms.space_back() >= need:
                return least
            if evict and self.arena.available + reclaimable >= need:
                self.cache.make_room(need)
        fit = self.arena.largest_free() // page_bytes
        free = self.arena.available
        if least == 0:
            return fit
        if fit == 0 and free < page_bytes and not self.arena.held and not self.cache.bytes:
            raise NoCapacity(
                f"no host memory left for one page of {page_bytes} bytes "
                f"({free} of {self.arena.capacity} free)"
            )
        if fit < least:
            held = self.arena.held
            raise NoCapacity(
                f"not enough host memory: this registration accepts no fewer than {least * p} host "
                f"tokens ({least * page_bytes} bytes at {page_bytes // p} bytes a token), but "
                f"{fit * p} tokens ({fit * page_bytes} bytes) fit in the largest free region, and "
                f"{free} bytes of {self.arena.capacity} are free"
                + (f" ({held} more held for registrations making room)" if held else "")
                + (f", and {self.cache.bytes} bytes of cached pages could not give way (pinned, being "
                   "read, or not beside a free range that would hold the region)" if self.cache.bytes else "")
                + "; ask for fewer, or set min_host_tokens to the least the engine accepts"
            )
        return fit

    def in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Runs ``work`` on the loop whatever becomes of the call that started it (a Put's pages
        committed in steps); ``close`` waits for it."""
        # In a context of its own: not the call's that started it (LoopShare counts a call in its
        # context; a task inheriting it would take that call's count away once more).
        task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_logged)
        return task

    async def _background_done(self) -> None:
        """Returns once no work ``in_background`` started is left (what ends meanwhile may start
        more: waited for too)."""
        while self._background:
            await asyncio.wait(set(self._background))

    async def _in_thread(self, fn, *args, undo=None):
        """``fn(*args)`` in a worker thread; ``close`` waits for it, since it may use the arena.
        If the caller is cancelled (its RPC ended), the thread still finishes first, and what it
        returned is handed to ``undo`` (also in a thread), so nothing it opened is left behind."""
        self._in_threads += 1
        try:
            work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            if not await settle(work):
                return work.result()
            if work.exception() is not None:  # nobody else will see it: the caller is gone
                logger.error("%s failed after its caller was cancelled: %r", fn.__name__, work.exception())
            elif undo is not None:
                undone = asyncio.ensure_future(asyncio.to_thread(undo, work.result()))
                await settle(undone)
                if undone.exception() is not None:
                    logger.error("undoing a cancelled %s failed: %r", fn.__name__, undone.exception())
            raise asyncio.CancelledError
        finally:
            self._in_threads -= 1
            self._thread_done.set()

    def _region_room(self, tenant: str, spec: ClientSpec, least: int, most: int, given_back: int = 0,
                     replacing: bool = False) -> int:
        """The most pages a region of ``tenant``'s may take under its region quota (at most
        ``most``), counting what its regions take (each rounded up to the arena's alignment, as
        the arena takes it) and what its registrations under way booked, less ``given_back`` (the
        share of a registration it replaces); refuses fewer than ``least``, naming them."""
        if not self.tenant_region_quota:
            return most
        held = self._region_bytes_by_tenant[tenant] - given_back
        room = align_down(max(0, self.tenant_region_quota - held), REGION_ALIGN) // spec.page_bytes
        if room < least:
            stuck = self._quarantined_bytes_by_tenant[tenant]
            raise NoCapacity(
                f"tenant {tenant}'s registrations hold {held} bytes of host memory"
                + (f" ({stuck} of them regions of CUDA pools quarantined until their GPU work drains)"
                   if stuck else "")
                + f", and its regions may take {self.tenant_region_quota} together (--tenant-region-quota; "
                f"each region takes a multiple of {REGION_ALIGN} bytes): this registration accepts no fewer "
                f"than {least * spec.page_size} host tokens ({least * spec.page_bytes} bytes); unregister "
                "one first, or accept fewer (min_host_tokens)"
                + ("; the registration it names stays" if replacing else "")
            )
        return min(most, room)

    def _book_region_quota(self, tenant: str, nbytes: int) -> int:
        """Books a region of ``nbytes`` in its tenant's share; returns what was booked."""
        booked = align_up(nbytes, REGION_ALIGN) if self.tenant_region_quota else 0
        if booked:
            self._region_bytes_by_tenant[tenant] += booked
        return booked

    def _give_region_quota(self, tenant: str, booked: int) -> None:
        _less(self._region_bytes_by_tenant, tenant, booked)

    async def _register(self, req: pb.RegisterRequest, spec: ClientSpec, access: ShmAccess, least: int,
                        most: int, tenant: str) -> ClientState:
        def open_device():
            return open_pool(req.device_pool, spec.layout, spec.dtype, len(spec.layers), spec.page_size,
                             req.event_slots, access, slabs=self.slab_pinner)

        device = await self._in_thread(open_device, undo=lambda d: d.close())
        try:
            if req.replaces_client_id:  # only now that the new pool has passed every check
                await self._release_replaced(req.replaces_client_id)
            page_bytes = spec.page_bytes
            # No room is made for more than its tenant may take; what it may take is booked while
            # the room is made, so that its tenant's other registrations under way make none for it.
            most = self._region_room(tenant, spec, least, most)
            booked = self._book_region_quota(tenant, most * page_bytes)
            try:
                await self.rooms.make(least * page_bytes, most * page_bytes)
            finally:
                self._give_region_quota(tenant, booked)
            most = self._region_room(tenant, spec, least, most)  # (no await from here)
            num_pages = min(most, self._check_fits(spec, least))  # (no await since: the room is there)
            offset = self.arena.reserve(num_pages * page_bytes, commit=False)
            quota_bytes = self._book_region_quota(tenant, num_pages * page_bytes)
        except BaseException:
            await self._in_thread(device.close)
            raise

        def attach() -> tuple[list[list[np.ndarray]], transfer.BufferTable]:
            # A kept arena takes the region's memory first (seconds for a large one): off the loop.
            self.arena.commit(offset, num_pages * page_bytes)
            device.attach_host(self.arena.address + offset, num_pages * page_bytes, len(spec.layers))
            # The region's views, one a (layer, part): off the loop too (some ms for 4096 layers).
            views = self._host_views(spec, device.dtype, offset, num_pages)
            return views, transfer.BufferTable.of(views)

        try:
            host_views, host_table = await self._in_thread(attach)
        except BaseException:
            try:
                await self._in_thread(device.close)
            finally:  # committed (and pinned) memory goes back to the kernel off the loop
                self._give_region_quota(tenant, quota_bytes)
                await self._release_region(offset, num_pages * page_bytes)
            raise
        client = ClientState(
            client_id=secrets.token_hex(16),
            epoch=self._new_epoch(),
            spec=spec,
            device=device,
            region_offset=offset,
            region_bytes=num_pages * page_bytes,
            quota_bytes=quota_bytes,
            tenant=tenant,
            pages=PageAllocator(num_pages),
            host_views=host_views,
            host_table=host_table,
            busy=np.zeros(num_pages, dtype=np.int32),
        )
        self.clients[client.client_id] = client
        logger.info(  # public_id: the id is a bearer capability
            "registered %s: granted %d of %d host tokens asked (least accepted %d), %d pages x %d B; "
            "model=%s tp=%d/%d pp=%d/%d layers=%s",
            public_id(client.client_id), client.capacity_tokens, req.host_tokens, least * spec.page_size,
            num_pages, page_bytes, spec.model, spec.tp_rank, spec.tp_size, spec.pp_rank, spec.pp_size,
            spec.layers,
        )
        return client

    def _new_epoch(self) -> int:
        live = {c.epoch for c in self.clients.values()}
        while True:
            epoch = 1 + secrets.randbelow(epochs.MAX_EPOCH)
            if epoch not in live:
                return epoch

    def _host_views(
        self, spec: ClientSpec, wide: np.dtype, offset: int, num_pages: int
    ) -> list[list[np.ndarray]]:
        w = wide.itemsize
        flat = self.arena.view(wide)
        chunk = spec.page_size * spec.token_bytes
        parts = spec.layout.num_parts
        return [
            [
                rows_at(flat, offset + (layer * parts + part) * chunk, num_pages, chunk // w, spec.page_bytes)
                for part in range(parts)
            ]
            for layer in range(len(spec.layers))
        ]

    async def unregister(self, client_id: str, reason: str = "unregistered") -> bool:
        """Releases everything the client holds, once its in-flight copies are done. Once begun,
        the release runs to its end even if the caller is cancelled (an RPC deadline, the
        reaper's shutdown): a client half released would be held for good. Returns whether
        copies of it may still run on the GPU (its pool was quarantined)."""
        if client_id in self._quarantined:  # released, but its GPU work may still run
            return True
        # (out of the table already, its pool closing: still being released)
        client = self.clients.get(client_id) or self._releasing.get(client_id)
        if client is not None and client.closing:
            # Being released already (another Unregister, a reclaim): answer once it is done, so
            # that an answer always means every job of the client is dead or quarantined.
            await asyncio.shield(client.gone.wait())
            return client.copies_pending
        client = self.client(client_id)
        client.closing = True
        gate_closed = None
        if client.gate is not None and self.plane is not None:
            gate_closed = self.plane.close_gate(client.gate)  # takes no new call of it from now on
            if self.on_gate_closed is not None:
                try:
                    self.on_gate_closed(client)
                except Exception:  # the release goes on: the pages are the cache's to find again
                    logger.exception("giving back the cache pages set aside for a client's Puts failed")
        release = asyncio.ensure_future(self._release(client, reason, gate_closed))
        if await settle(release):
            raise asyncio.CancelledError
        release.result()
        return client.copies_pending

    async def _release(self, client: ClientState, reason: str, gate_closed: Awaitable[None] | None) -> None:
        client_id = client.client_id
        for job in list(client.jobs):  # queued ones are dropped, running ones end at a layer boundary
            job.stop("released")
        if client.gate is not None and self.plane is not None:
            if gate_closed is not None:  # the plane's thread has taken the close (off the loop)
                with contextlib.suppress(Exception):  # logged there: its copies see the gate shut
                    await asyncio.shield(gate_closed)  # (a cancel here would unsend it)
            await self.plane.idle(client.gate)  # its copies there end at a layer boundary
            self.harvest(client)
            if client.gate.cuda:  # what the plane put on the GPU itself (scripts/gpu_check.py --plane-cuda)
                logger.info("data plane: %d CUDA Writes and Loads of %s put on its GPU stream, %d of "
                            "them by the copy kernel", client.gate.cuda_jobs, public_id(client_id),
                            client.gate.cuda_kernel_jobs)
                if client.gate.cuda_failed:
                    logger.info("data plane: gave up on the GPU work of %s: %s", public_id(client_id),
                                client.gate.cuda_failed)
        lane, client.lane = client.lane, None
        if lane is not None:  # its handlers are cancelled and awaited, then its ring unmapped
            await lane.close()
        await wait_until(client, lambda: client.inflight == 0)
        self._releasing[client_id] = client  # until gone: an Unregister meanwhile waits for the end
        del self.clients[client_id]
        self.totals.add(client.counters)
        # A call whose copy ended just now counts its bytes a loop turn or two later, into the
        # counters it finds then: the daemon's totals from here on, not a client that is gone.
        client.counters = self.totals
        # Its pinning Lookups' leases (no Get of its reads them), in steps: the loop serves others.
        try:
            if await in_steps(self.share, self.cache.release_owned_steps(client_id)):
                logger.debug("the leases of %s ended with it", public_id(client_id))
        except Exception:  # (they expire all the same; the release goes on)
            logger.exception("ending the leases of %s failed", public_id(client_id))
        client.host_views = []
        handles = client.device.ipc_allocations
        held = None  # a CUDA pool's quarantine: the GPU may still touch the host region
        try:
            held = await self._in_thread(client.device.close)
        except Exception:
            logger.exception("closing the device pool of %s failed; releasing its host memory anyway",
                             public_id(client_id))
        finally:
            self._give_pool_fds(client.pool_fds_of, client.pool_fds)
            client.pool_fds = 0
            self._mapped[client.pool_fds_of] -= client.mapped_bytes
            if self._mapped[client.pool_fds_of] <= 0:
                del self._mapped[client.pool_fds_of]
            client.mapped_bytes = 0
            if held is None:
                self._give_region_quota(client.tenant, client.quota_bytes)
                await self._release_region(client.region_offset, client.region_bytes)
                # Its own copies are dead, but a quarantined client's may still write the same
                # device memory: the engine must not let it be reused yet.
                client.copies_pending = any(handles & h for h in self._quarantined.values())
            else:  # stays reserved until the quarantine has released the pool's GPU resources
                client.copies_pending = True
                self._quarantined[client_id] = handles
                self._quarantined_bytes_by_tenant[client.tenant] += client.quota_bytes
                loop, region = asyncio.get_running_loop(), (client.region_offset, client.region_bytes)

                def drained() -> None:  # its memory back to the kernel off the loop, then the range
                    self._quarantined.pop(client_id, None)
                    self._give_region_quota(client.tenant, client.quota_bytes)
                    _less(self._quarantined_bytes_by_tenant, client.tenant, client.quota_bytes)
                    if self._closing:  # (the arena is about to go: no thread may use it after)
                        self.arena.release(*region)
                    else:
                        self.in_background(self._release_region(*region))

                def on_held_released(_) -> None:
                    with contextlib.suppress(RuntimeError):  # a daemon stopped meanwhile: its loop is closed
                        loop.call_soon_threadsafe(drained)

                held.add_done_callback(on_held_released)
            self._releasing.pop(client_id, None)
            if client.pidfd >= 0:
                os.close(client.pidfd)
                client.pidfd = -1
            client.gone.set()
        logger.info("%s %s (%d host bytes released)", reason, public_id(client_id), client.region_bytes)

    async def _release_region(self, offset: int, nbytes: int) -> None:
        """Returns a client's region to the arena. Its pages go back to the kernel in a worker
        thread first (a populated region takes ~0.09 s a GiB, bench_release.py): the range is reused only
        after, and if that failed, ``release`` does it here before the range is free again."""
        discarded = []

        def discard() -> None:
            self.arena.discard(offset, nbytes)
            discarded.append(True)

        try:
            await self._in_thread(discard)
        except Exception:
            logger.exception("giving back %d bytes of host memory in a worker failed", nbytes)
        finally:
            self.arena.release(offset, nbytes, discarded=bool(discarded))

    def client(self, client_id: str) -> ClientState:
        """The live client of this id; every call through here renews the client's lease."""
        client = self.clients.get(client_id)
        if client is None or client.closing:
            raise UnknownClient(
                f"unknown client id {shown(client_id)}: register first (it may have been "
                "unregistered, reclaimed after its session ended, or lost in a daemon restart)"
            )
        client.last_seen = time.monotonic()
        return client

    def _host_pages(self, client: ClientState, host_indices) -> np.ndarray:
        self.check_size(len(host_indices))
        host = transfer.as_indices(host_indices, "host")
        slots = epochs.strip(host, client.epoch, client.pages.num_pages, client.spec.page_size)
        pages = transfer.host_pages_of(slots, client.spec.page_size)
        client.pages.check_owned(pages)
        return pages

    def check_size(self, n: int) -> None:
        if n > self.max_request_indices:
            raise NoCapacity(
                f"{n} indices in one request; the limit is {self.max_request_indices}: split it"
            )

    # ---- host pages -----------------------------------------------------------------------

    async def alloc(self, client_id: str, num_tokens: int) -> np.ndarray:
        """Host indices of ``num_tokens`` tokens in whole free pages of the client's region. The
        pages are taken on the loop; a large answer's list is built in a worker thread (4 Mi
        indices: 40-160 ms of numpy on the loop before), its pages no one else's meanwhile."""
        client = self.client(client_id)
        if num_tokens <= 0:
            raise InvalidArgument("num_tokens must be positive")
        p = client.spec.page_size
        num_pages = -(-num_tokens // p)
        if num_pages <= client.pages.num_free:  # else take() names the full region
            self.check_size(num_pages * p)
        taken = client.pages.take(num_pages)

        def indices() -> np.ndarray:
            taken.mark()
            return epochs.tag(_page_tokens(taken.pages(), p), client.epoch)

        if num_pages * p <= OFF_LOOP_INDICES:
            return indices()
        work = asyncio.ensure_future(self._in_thread(indices))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:  # the caller is gone and will never name these pages
            work.add_done_callback(lambda w: self._free_later(client_id, w))
            raise

    def _free_later(self, client_id: str, work: asyncio.Future) -> None:
        """Frees what an Alloc whose caller went away had taken (unless the client is gone too)."""
        if work.cancelled() or work.exception() is not None:
            return
        freed = asyncio.ensure_future(self.free(client_id, work.result()))
        freed.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def free(self, client_id: str, host_indices) -> int:
        client = self.client(client_id)
        if len(host_indices) <= OFF_LOOP_INDICES:
            pages = self._host_pages(client, host_indices)
        else:
            self.check_size(len(host_indices))
            seen = client.pages.version
            pages = await asyncio.to_thread(self._host_pages, client, host_indices)
            client = self.client(client_id)
            if client.pages.version != seen:  # pages changed meanwhile: check them again, here
                client.pages.check_owned(pages)
        if client.inflight and client.busy[pages].any():
            # A copy still reads or writes these pages: free them once it is done (and still ours).
            await wait_until(client, lambda: not client.busy[pages].any())
            client = self.client(client_id)
            client.pages.check_owned(pages)
        gate = client.gate
        if gate is not None:
            # The data plane checks ownership and marks pages busy under the gate's lock: the pages
            # leave its view under that lock, once neither its copies nor the loop's use them. Its
            # new requests of the client go to the loop meanwhile, so that a stream of them cannot
            # keep the pages busy for good.
            gate.py_enter()
            try:
                while client.busy[pages].any() or not gate.release_if_idle(pages):
                    if client.busy[pages].any():
                        await wait_until(client, lambda c=client: not c.busy[pages].any())
                    else:
                        await asyncio.sleep(PLANE_POLL_SECONDS)
                    client = self.client(client_id)
                    client.pages.check_owned(pages)
            finally:
                gate.py_exit()
        client.pages.free(pages, checked=True)
        return pages.size * client.spec.page_size

    def harvest(self, client: ClientState) -> None:
        """Adds what the data plane did for ``client`` since the last harvest to its counters (and
        its last call to its lease), and its Lookups' hits and misses to its space's."""
        if client.gate is None:
            return
        if self.plane is not None:  # the Gets it served whole, ended but not yet settled
            self.plane.settle_gets()
        written, writes, loaded, loads, served, last_ns = client.gate.take_counters()
        hits, misses = client.gate.take_lookups()
        if (hits or misses) and self.on_plane_lookups is not None:
            self.on_plane_lookups(client, hits, misses)
        c = client.counters
        c.bytes_written += written
        c.write_ops += writes
        c.bytes_loaded += loaded
        c.load_ops += loads
        if last_ns:
            client.last_seen = max(client.last_seen, last_ns / 1e9)
        if self.on_plane_transfers is not None and (writes or loads):
            self.on_plane_transfers(written, writes, loaded, loads)

    def harvest_all(self) -> None:
        for client in list(self.clients.values()):
            self.harvest(client)

    # ---- transfers ------------------------------------------------------------------------

    async def prepare_job(self, client_id: str, host_indices, device_indices, layers,
                          ready_event: bytes = b"", event_slot: int = 0, timeout_ms: int = 0) -> ClientJob:
        """``prepare``, in a worker thread for a large request (its checks take a good part of a
        second for millions of indices), re-checked here if the client's pages changed meanwhile.
        For a client the data plane serves, first its turn (``copier.plane_turn``): the checks see
        the pages as the copy will."""
        deadline = self.deadline(timeout_ms)  # counted from the request's arrival, checks included
        client = self.client(client_id)
        if client.gate is None:
            return await self._prepare_job(client_id, host_indices, device_indices, layers, ready_event,
                                           event_slot, deadline)
        async with plane_turn(client) as turn:
            job = await self._prepare_job(client_id, host_indices, device_indices, layers, ready_event,
                                          event_slot, deadline)
            job.turn = turn.take()
            return job

    async def _prepare_job(self, client_id: str, host_indices, device_indices, layers, ready_event: bytes,
                           event_slot: int, deadline: float) -> ClientJob:
        args = (client_id, host_indices, device_indices, layers, ready_event, event_slot, deadline)
        if len(host_indices) <= OFF_LOOP_INDICES:
            return self.prepare(*args)
        self.check_size(len(host_indices))
        client = self.client(client_id)
        seen = client.pages.version
        sizes = (client.busy.size, client.device.num_tokens, client.spec.page_size)
        if client.order is None:
            client.order = JobOrder(*sizes)
        arrays = (client.busy, *client.order.arrays())

        def prepare() -> ClientJob:
            job = self.prepare(*args)
            if dense_pays(job, *sizes):  # its marks on the loop: whole-array adds, on arrays whose
                job.dense = dense_marks(job, *sizes)  # pages are in (no fault on the loop)
                for array in arrays:
                    populate(array)
            return job

        job = await asyncio.to_thread(prepare)
        client = self.client(client_id)  # still registered
        if client.pages.version != seen:
            client.pages.check_owned(job.pages)
        return job

    def prepare(self, client_id: str, host_indices, device_indices, layers, ready_event: bytes = b"",
                event_slot: int = 0, deadline: float = 0.0) -> ClientJob:
        """Validates a whole transfer request and plans it; touches no memory."""
        client = self.client(client_id)
        spec = client.spec
        client.device.check_request(ready_event, event_slot)
        local_layers = spec.layers.select(layers)
        if len(host_indices) != len(device_indices):
            raise InvalidArgument(
                f"{len(host_indices)} host indices but {len(device_indices)} device indices; "
                "they must pair up"
            )
        pages = self._host_pages(client, host_indices)
        dev = transfer.as_indices(device_indices, "device")
        transfer.check_device_tokens(dev, client.device.num_tokens)
        client.device.check_sizes()  # named objects only: narrows, does not close, a SIGBUS window
        num_dev_pages = client.device.num_pages if client.device.paged else None
        plan = transfer.make_plan(pages, dev, spec.page_size, num_dev_pages)
        return ClientJob(client, plan, local_layers, pages, bytes(ready_event), event_slot, deadline)

    def deadline(self, timeout_ms: int) -> float:
        """A job's deadline on the loop's clock, counted from the request's arrival (0: none)."""
        return asyncio.get_running_loop().time() + timeout_ms / 1000 if timeout_ms else 0.0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Starts what runs beside the calls (the disk tier's writer). On the daemon's loop."""
        if self.disk is not None:
            self.disk.start()
        if self.cluster is not None:
            self.cluster.start()

    async def close(self, grace: float | None = None) -> None:
        """Lets every client go and closes the tiers and the arena. ``grace`` (the daemon's
        stop): seconds the disk tier may go on writing what it has queued (none where host
        memory is kept: the next daemon writes what it finds there without a disk copy), and the
        cluster tier may wait for its transfers and its leaving; None: no writing, and as long
        as the cluster's take."""
        self._closing = True
        await self._background_done()
        while self._in_threads:  # a registration or a pool close in a worker thread uses the arena
            self._thread_done.clear()
            await self._thread_done.wait()
        clients = list(self.clients.values())
        for client in clients:
            if client.closing:  # being released by an earlier unregister or reclaim
                await client.gone.wait()
            else:
                await self.unregister(client.client_id)
        if clients:  # a Put whose copy ended as its client went commits its pages (its copy's end,
            await asyncio.sleep(0)  # posted to the loop, runs first)
            await self._background_done()
        self.copier.shutdown()
        self.cache.log_drops()  # what the last minute's Puts dropped, not logged yet
        if self.disk is not None:  # its reads and writes use the arena
            await self.disk.close((grace or 0.0) if self._kept is None else 0.0)
            self.disk.cache.log_drops()  # its own Puts' drops (its drain's among them), not logged yet
        if self.cluster is not None:  # so do its transfers
            if not await self.cluster.close(grace):
                # A transfer may still write host memory, or a Mooncake call still wait on its
                # master: host memory stays mapped, and the process ends without waiting on them.
                self.left_running = True
                return
        await self._background_done()  # (a region given back meanwhile, in a worker thread)
        self.slab_pinner.close()  # after every copy, before the memory it pinned goes
        self.arena.close()
        if self._kept is not None:  # the cache stays in its files for the next start
            self._kept.close()


@contextlib.asynccontextmanager
async def _keyed_lock(locks: dict, key: Any):
    """The lock of ``key`` among ``locks`` ({key: [lock, holders and waiters]}), held; the entry
    made on first use and dropped once nobody holds or waits for it."""
    entry = locks.setdefault(key, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        async with entry[0]:
            yield
    finally:
        entry[1] -= 1
        if not entry[1]:
            del locks[key]


def _less(counts: Counter, key: Any, n: int) -> None:
    """``counts[key]`` less ``n``, the key dropped once nothing is left."""
    if n:
        counts[key] -= n
        if counts[key] <= 0:
            del counts[key]


def _replacing(req: pb.RegisterRequest, client_id: str) -> pb.RegisterRequest:
    """``req`` naming ``client_id`` as the registration it replaces."""
    out = pb.RegisterRequest()
    out.CopyFrom(req)
    out.replaces_client_id = client_id
    return out


def _logged(task: asyncio.Task) -> None:
    """A background task's failure, which no caller may be left to see."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("background work failed", exc_info=task.exception())


async def settle(fut: asyncio.Future) -> bool:
    """Waits until ``fut`` is done, through any cancellation of the caller; says whether the
    caller was cancelled meanwhile (threads cannot be stopped, so their work is waited out)."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def _page_tokens(pages: np.ndarray, page_size: int) -> np.ndarray:
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
