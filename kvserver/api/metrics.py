"""Prometheus metrics of one daemon (``--metrics-listen``), from the same state Stats reads.

Each daemon has a ``CollectorRegistry`` of its own (never the process-wide default), so two
daemons in one process do not clash. Histograms and the transfer counters are observed on the
event loop where the work happens; everything else is read at scrape time by ``StateCollector``,
which runs a snapshot coroutine *on the daemon's loop* from the HTTP server's thread: a scrape
never touches core state from another thread. See docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from kvserver.config import parse_metrics_listen
from kvserver.core.tiers import TierStat, tier_stats

if TYPE_CHECKING:
    from kvserver.core.kvcore import KVCore
    from kvserver.store.keep import Recovery
    from kvserver.store.spaces import SpaceKey

logger = logging.getLogger(__name__)

# 50 us .. 10 s: a small inline copy, up to a large load queued behind others.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)
# kvserver_event_loop_lag_seconds: how late a timer due every LAG_INTERVAL ran on the daemon's loop.
LAG_INTERVAL = 0.05
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# RPCs timed by kvserver_operation_duration_seconds (Session is a long-lived stream: not timed).
OPERATIONS = ("Register", "Unregister", "Alloc", "Free", "Write", "Load", "Stats", "OpenSpace",
              "Lookup", "Release", "Put", "Get", "Events")
DIRECTIONS = ("write", "load", "put", "get")  # device->host, host->device, device->cache, cache->device
LANES = ("grpc", "ring")  # how the request reached the daemon: gRPC, or the lane's ring (docs/lane.md)
SCRAPE_TIMEOUT = 5.0  # seconds a scrape waits for the daemon's loop
SPACE_LABELS = ("tenant", "model", "layout", "dtype", "page_size", "num_layers", "tp_size", "pp_size",
                "weights")

@dataclass(slots=True)
class Transfers:
    """Daemon-wide transfer counters by (direction, lane): they only ever go up (a client's own
    counters leave with it)."""

    bytes: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(d, lane): 0 for d in DIRECTIONS for lane in LANES})
    ops: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(d, lane): 0 for d in DIRECTIONS for lane in LANES})

    def add(self, direction: str, nbytes: int, lane: str = "grpc", ops: int = 1) -> None:
        self.bytes[direction, lane] += nbytes
        self.ops[direction, lane] += ops


def _layout_label(key: SpaceKey) -> str:
    lay = key.layout
    if lay.is_mla:
        return f"mla:{lay.head_dim - lay.rope_dim}+{lay.rope_dim}"
    return f"mha:{lay.num_heads}x{lay.head_dim}"


def _space_labels(key: SpaceKey) -> list[str]:
    return [key.tenant, key.model, _layout_label(key), key.dtype.name,
            str(key.page_size), str(key.num_layers), str(key.tp_size), str(key.pp_size), key.weights]


@dataclass(slots=True)
class Snapshot:
    """What a scrape reports of the daemon's state, copied on its loop."""

    capacity: int
    reserved: int
    room_bytes: int  # held for registrations making room (in ``reserved`` too)
    used: int
    cache_bytes: int
    clients: int
    queue_depth: int
    waiting: tuple[int, int]  # jobs with pieces no worker has taken yet: (loads, writes)
    plane_copies: int  # copies the compiled data plane has taken and not finished
    reclaims: int
    transfer_bytes: dict[tuple[str, str], int]
    transfer_ops: dict[tuple[str, str], int]
    client_memory: dict[tuple[str, str], list[int]]  # (tenant, model) -> [capacity, used] bytes
    spaces: list  # SpaceStat
    tenants: list  # TenantStat
    recovery: Recovery | None  # what the start found of a kept cache (None: not kept)
    tiers: list[TierStat]
    kv_events_dropped_keys: int | None = None  # keys the KV event publisher dropped (None: none runs)


def snapshot(core: KVCore, transfers: Transfers) -> Snapshot:
    """Reads the core as the Stats RPC does (the same sources: the numbers agree). Loop only."""
    core.harvest_all()  # what the data plane did, in the clients' counters and the transfers
    client_memory: dict[tuple[str, str], list[int]] = {}
    for c in core.clients.values():
        row = client_memory.setdefault((c.tenant, c.spec.model), [0, 0])
        row[0] += c.region_bytes
        row[1] += c.pages.num_used * c.spec.page_bytes
    spaces, tenants = core.cache.stats(None)
    return Snapshot(
        capacity=core.arena.capacity,
        reserved=core.arena.reserved + core.arena.claimed,
        room_bytes=core.arena.held,
        used=sum(c.pages.num_used * c.spec.page_bytes for c in core.clients.values()),
        cache_bytes=core.cache.bytes,
        clients=len(core.clients),
        queue_depth=core.copier.queued,
        waiting=core.copier.waiting(),
        plane_copies=core.copier.alone_inflight + sum(c.gate.inflight for c in core.clients.values()
                                                       if c.gate is not None),
        reclaims=core.reclaimed,
        transfer_bytes=dict(transfers.bytes),
        transfer_ops=dict(transfers.ops),
        client_memory=client_memory,
        spaces=spaces,
        tenants=tenants,
        recovery=core.recovery,
        tiers=tier_stats(core),
        kv_events_dropped_keys=getattr(core.events.publisher, "dropped_keys", None),
    )


class StateCollector:
    """Gauges and counters read from the daemon's state at scrape time, on the daemon's loop.
    One snapshot runs at a time: a scrape shares the last one if the loop began it after the
    scrape asked, else the one under way, and waits for it at most until that one's deadline
    (``SCRAPE_TIMEOUT`` after it was asked for), so no scrape waits longer, however many come
    while the loop is held; a snapshot the loop did not take in time is cancelled: no pile of
    scrapes can queue work on the loop."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self._last: tuple[float, Snapshot] | None = None  # (when the loop began it, it)
        self._pending: tuple[Future, float] | None = None  # the snapshot under way, its deadline

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are this module's own

    async def _timed(self) -> tuple[float, Snapshot]:
        return time.monotonic(), await self.metrics.snapshot()

    def _snapshot(self) -> Snapshot | None:
        asked = time.monotonic()
        with self._lock:
            if self._last is not None and self._last[0] >= asked:
                return self._last[1]
            if self._pending is None or self._pending[0].done():
                loop = self.metrics.loop
                if loop is None or loop.is_closed() or not loop.is_running():
                    return None
                fut = asyncio.run_coroutine_threadsafe(self._timed(), loop)
                self._pending = (fut, asked + SCRAPE_TIMEOUT)
            fut, deadline = self._pending
        try:
            began, snap = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, CancelledError) as exc:
            if fut.done() and not fut.cancelled():  # a reader's own TimeoutError: its failure
                logger.error("metrics scrape could not read the daemon's state", exc_info=exc)
                return None
            # The loop is stuck or stopping (or another scrape of this snapshot cancelled it at its
            # deadline): said once, by the scrape that cancels it.
            with self._lock:
                first = not fut.cancelled() and fut.cancel()
            if first:
                logger.warning("metrics scrape could not read the daemon's state: its loop did not answer "
                               "within %g s", SCRAPE_TIMEOUT)
            return None
        except Exception:  # reading it failed: a fault of the daemon's, said with where it lies
            logger.exception("metrics scrape could not read the daemon's state")
            return None
        with self._lock:
            if self._last is None or self._last[0] < began:
                self._last = (began, snap)
        return snap

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield _gauge("kvserver_state_collected",
                     "1 if this scrape read the daemon's state, 0 if it could not (its loop did not "
                     "answer in time, or reading it failed: the daemon's log says which).",
                     1 if snap is not None else 0)
        if snap is not None:
            yield from _families(snap, self.metrics.per_space)


class _PlaneHarvest:
    """Collects nothing: before each scrape's histograms, adds the data plane's latencies."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        self.metrics.harvest_plane()
        return iter(())


def _add_counts(child: Any, counts: list[int], total: float) -> None:
    """Adds observations counted elsewhere, per bucket (the last: +Inf), to a histogram child:
    what ``observe`` would have made of them one by one."""
    if not any(counts):
        return
    child._sum.inc(total)
    for bucket, n in zip(child._buckets, counts, strict=True):
        if n:
            bucket.inc(n)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


_TIER_GAUGES = (
    ("kvserver_tier_capacity_bytes",
     "The tier's capacity (host memory, --disk-size, the cluster segment this node contributes).",
     "capacity_bytes"),
    ("kvserver_tier_pages", "Pages the tier stores.", "pages"),
    ("kvserver_tier_bytes", "Bytes of the pages the tier stores.", "bytes"),
)
_TIER_COUNTERS = (
    ("kvserver_tier_hits", "Looked-up pages found in the tier and not in the one above.", "hits"),
    ("kvserver_tier_evicted_pages", "Pages the tier evicted.", "evicted_pages"),
)
_DISK_COUNTERS = (
    ("kvserver_disk_written_pages", "Pages written to disk behind the host cache.", "written_pages"),
    ("kvserver_disk_written_bytes", "Bytes written to disk behind the host cache.", "written_bytes"),
    ("kvserver_disk_promoted_pages", "Pages read back from disk into host memory.", "promoted_pages"),
    ("kvserver_disk_promoted_bytes", "Bytes read back from disk into host memory.", "promoted_bytes"),
    ("kvserver_disk_skipped_pages",
     "Pages that got no disk copy: evicted while waiting, or refused (disk or quota full).", "skipped_pages"),
    ("kvserver_disk_write_errors", "Pages whose write to disk failed.", "write_errors"),
    ("kvserver_disk_read_errors", "Pages whose read from disk failed.", "read_errors"),
    ("kvserver_disk_bad_checks", "Pages read from disk whose check failed: dropped, never served.",
     "bad_checks"),
)

_CLUSTER_COUNTERS = (
    ("kvserver_cluster_published_pages", "Pages this node stored in the cluster.", "written_pages"),
    ("kvserver_cluster_published_bytes", "Bytes this node stored in the cluster.", "written_bytes"),
    ("kvserver_cluster_present_pages", "Pages not stored: the cluster held them already.", "present_pages"),
    ("kvserver_cluster_pulled_pages", "Pages pulled from the cluster into host memory.", "promoted_pages"),
    ("kvserver_cluster_pulled_bytes", "Bytes pulled from the cluster into host memory.", "promoted_bytes"),
    ("kvserver_cluster_skipped_pages",
     "Pages not stored in the cluster: queue full, not joined, or the store not answering.", "skipped_pages"),
    ("kvserver_cluster_put_errors", "Pages whose put to the cluster failed.", "write_errors"),
    ("kvserver_cluster_get_errors", "Pages whose pull from the cluster failed: misses.", "read_errors"),
    ("kvserver_cluster_breaker_trips", "Times the cluster store stopped answering (breaker opened).",
     "breaker_trips"),
    ("kvserver_cluster_timeouts", "Cluster calls past their deadline: misses.", "timeouts"),
    ("kvserver_cluster_busy", "Cluster calls refused with every worker thread busy: misses.", "busy"),
    ("kvserver_cluster_quarantined_pages",
     "Pages of failed pulls kept out of use a while (the transfer may still land).", "quarantined_pages"),
)


def _tier_families(tiers: list[TierStat]) -> Iterator[Metric]:
    for kind, table in ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS)):
        for name, doc, attr in table:
            family = kind(name, doc, labels=("tier",))
            for t in tiers:
                family.add_metric((t.name,), getattr(t, attr))
            yield family
    cluster = next((t for t in tiers if t.name == "cluster"), None)
    if cluster is not None:
        for name, doc, attr in _CLUSTER_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(cluster, attr))
        yield _gauge("kvserver_cluster_available",
                     "1 if this node has joined the cluster and its store answers, else 0.",
                     1 if cluster.available else 0)
    disk = next((t for t in tiers if t.name == "disk"), None)
    if disk is None:
        return
    for name, doc, attr in _DISK_COUNTERS:
        yield CounterMetricFamily(name, doc, value=getattr(disk, attr))
    rec = disk.recovery
    if rec is not None:
        yield _gauge("kvserver_disk_adopted_pages", "Pages this daemon's start found on disk.",
                     rec.adopted_pages)
        yield _gauge("kvserver_disk_adopt_seconds", "Seconds the start took to read the disk's index.",
                     rec.seconds)
        yield _gauge("kvserver_disk_adopt_torn_pages",
                     "Disk pages being written when the last daemon stopped: dropped at start.", rec.torn)


def _families(s: Snapshot, per_space: bool) -> Iterator[Metric]:
    yield _gauge("kvserver_host_memory_bytes", "Host KV memory budget (--host-memory).", s.capacity)
    yield _gauge("kvserver_host_memory_reserved_bytes",
                 "Host memory reserved: clients' regions, the node-wide cache's slabs and room being made "
                 "for registrations.", s.reserved)
    yield _gauge("kvserver_host_memory_room_bytes",
                 "Host memory held for registrations making room in the cache, until their regions "
                 "take it (counted in kvserver_host_memory_reserved_bytes too).", s.room_bytes)
    yield _gauge("kvserver_host_memory_used_bytes",
                 "Bytes of allocated pages in clients' regions (Stats used_bytes).", s.used)
    yield _gauge("kvserver_cache_slab_bytes", "Host memory held by the node-wide cache's slabs.",
                 s.cache_bytes)
    yield _gauge("kvserver_clients", "Registered clients.", s.clients)
    yield _gauge("kvserver_copy_queue_depth", "Copies the event loop planned and handed to the copy "
                 "workers (which may pass them to the data plane's thread) and not done yet.",
                 s.queue_depth)
    yield _gauge("kvserver_plane_copies_in_flight", "Copies the compiled data plane runs and has not "
                 "finished: those it took from engines' lanes, and those the loop planned for a call "
                 "it was handed and had the plane run at once.", s.plane_copies)
    waiting = GaugeMetricFamily("kvserver_copies_waiting",
                                "Copies with pieces no copy worker (the event loop's path) has taken "
                                "yet, by direction.", labels=("direction",))
    waiting.add_metric(("load",), s.waiting[0])
    waiting.add_metric(("write",), s.waiting[1])
    yield waiting
    yield CounterMetricFamily("kvserver_reclaims", "Registrations reclaimed from dead or silent engines.",
                              value=s.reclaims)
    rec = s.recovery
    yield _gauge("kvserver_cache_kept", "1 if the host cache is kept in files (--host-memory-dir).",
                 rec is not None)
    if rec is not None:
        yield _gauge("kvserver_cache_adopted_pages", "Pages this daemon's start adopted from the kept cache.",
                     rec.adopted_pages)
        yield _gauge("kvserver_cache_adopted_bytes", "Bytes of the pages adopted at start.",
                     rec.adopted_bytes)
        yield _gauge("kvserver_cache_adopt_seconds", "Seconds the start took to adopt the kept cache.",
                     rec.seconds)
        yield _gauge("kvserver_cache_adopt_torn_pages",
                     "Pages being written when the last daemon stopped: dropped at start.", rec.torn)
        yield _gauge("kvserver_cache_adopt_dropped_pages",
                     "Kept pages dropped at start because a check failed.", rec.dropped)
    yield from _tier_families(s.tiers)
    if s.kv_events_dropped_keys is not None:
        yield CounterMetricFamily("kvserver_kv_events_dropped_keys",
                                  "Keys whose KV event the daemon's publisher (--kv-events-endpoint) "
                                  "dropped, its queue full: their spaces' topics got AllBlocksCleared.",
                                  value=s.kv_events_dropped_keys)

    nbytes = CounterMetricFamily("kvserver_transfer_bytes", "Bytes copied, by direction and lane.",
                                 labels=("direction", "lane"))
    ops = CounterMetricFamily("kvserver_transfers", "Completed transfers, by direction and lane.",
                              labels=("direction", "lane"))
    for (direction, lane), v in s.transfer_bytes.items():
        nbytes.add_metric([direction, lane], v)
        ops.add_metric([direction, lane], s.transfer_ops[direction, lane])
    yield nbytes
    yield ops
    if not per_space:  # tenants' and models' names are the admin's view (--metrics-per-space)
        return

    cap = GaugeMetricFamily("kvserver_client_memory_bytes", "Host region bytes granted to clients.",
                            labels=("tenant", "model"))
    used = GaugeMetricFamily("kvserver_client_memory_used_bytes",
                             "Bytes of allocated pages in clients' regions.", labels=("tenant", "model"))
    for (tenant, model), (c, u) in s.client_memory.items():
        cap.add_metric([tenant, model], c)
        used.add_metric([tenant, model], u)
    yield cap
    yield used

    t_quota = GaugeMetricFamily("kvserver_tenant_quota_bytes",
                                "Most cache bytes the tenant may hold (no sample: no quota).",
                                labels=("tenant",))
    t_bytes = GaugeMetricFamily("kvserver_tenant_cache_bytes", "Cache bytes the tenant holds.",
                                labels=("tenant",))
    t_pages = GaugeMetricFamily("kvserver_tenant_cache_pages", "Cache pages the tenant holds.",
                                labels=("tenant",))
    for t in s.tenants:
        if t.quota_bytes:
            t_quota.add_metric([t.tenant], t.quota_bytes)
        t_bytes.add_metric([t.tenant], t.counters.bytes)
        t_pages.add_metric([t.tenant], t.counters.pages)
    yield t_quota
    yield t_bytes
    yield t_pages

    per_space = [
        (GaugeMetricFamily, "kvserver_cache_pages", "Cached pages of the space (being written included).",
         "pages"),
        (GaugeMetricFamily, "kvserver_cache_bytes", "Cached bytes of the space.", "bytes"),
        (CounterMetricFamily, "kvserver_cache_hits", "Pages Lookup found.", "hits"),
        (CounterMetricFamily, "kvserver_cache_misses", "Pages asked for and not found.", "misses"),
        (CounterMetricFamily, "kvserver_cache_evictions", "Pages evicted.", "evictions"),
        (CounterMetricFamily, "kvserver_cache_dedup_pages", "Put pages already cached (not stored again).",
         "dedup_pages"),
        (CounterMetricFamily, "kvserver_cache_dropped_pages", "Put pages dropped for want of room.",
         "dropped"),
    ]
    attrs = [attr for *_, attr in per_space]
    # A space opened and never used (OpenSpace alone) adds no series.
    active = [st for st in s.spaces if any(getattr(st.counters, a) for a in attrs)]
    for kind, name, doc, attr in per_space:
        fam = kind(name, doc, labels=SPACE_LABELS)
        for st in active:
            fam.add_metric(_space_labels(st.space), getattr(st.counters, attr))
        yield fam


class Metrics:
    """One daemon's registry: histograms observed where the work happens, transfer counters, and
    the state collector; ``serve`` starts the HTTP endpoint."""

    def __init__(self, core: KVCore, per_space: bool = False) -> None:
        self.core = core
        self.per_space = per_space
        self.host: str | None = None
        self.transfers = Transfers()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PlaneHarvest(self))  # first: the histograms below then include it
        self.duration = Histogram("kvserver_operation_duration_seconds",
                                  "Time an RPC took in the daemon, from when it began serving it to its "
                                  "answer (a wait for the event loop before that is in "
                                  "kvserver_event_loop_lag_seconds).",
                                  ("op",), buckets=BUCKETS, registry=self.registry)
        self.first_layer = Histogram("kvserver_time_to_first_layer_seconds",
                                     "Time from when the daemon began serving a Load or Get until its "
                                     "first layer landed.",
                                     ("op",), buckets=BUCKETS, registry=self.registry)
        self.loop_lag = Histogram("kvserver_event_loop_lag_seconds",
                                  f"How late the daemon's event loop ran a timer due every {LAG_INTERVAL} s: "
                                  "time in which it served no engine.",
                                  buckets=LAG_BUCKETS, registry=self.registry)
        self._duration = {op: self.duration.labels(op) for op in OPERATIONS}
        self._first_layer = {op: self.first_layer.labels(op) for op in ("Load", "Get")}
        self.registry.register(StateCollector(self))
        self._server = None
        self._thread = None
        self.port: int | None = None

    def observe(self, op: str, started: float) -> None:
        child = self._duration.get(op)
        if child is not None:
            child.observe(time.perf_counter() - started)

    def first_layer_landed(self, op: str, started: float) -> None:
        self._first_layer[op].observe(time.perf_counter() - started)

    async def watch_loop(self) -> None:
        """Observes the loop's lateness until cancelled: a timer is due every ``LAG_INTERVAL``;
        what it runs late is time every engine's call waited."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_INTERVAL
            await asyncio.sleep(LAG_INTERVAL)
            self.loop_lag.observe(max(0.0, loop.time() - due))

    async def snapshot(self) -> Snapshot:
        return snapshot(self.core, self.transfers)

    def harvest_plane(self) -> None:
        """Adds the compiled data plane's latencies (kept there in the same buckets) to the
        histograms. Any thread (both sides lock)."""
        plane = self.core.plane
        if plane is None:
            return
        (writes, w_sum), (loads, l_sum), (firsts, f_sum), (gets, g_sum), (get_firsts, gf_sum), \
            (lookups, k_sum), (puts, p_sum) = plane.engine.take_histograms()
        _add_counts(self._duration["Write"], writes, w_sum)
        _add_counts(self._duration["Load"], loads, l_sum)
        _add_counts(self._first_layer["Load"], firsts, f_sum)
        _add_counts(self._duration["Get"], gets, g_sum)  # the Gets whose copy answered their slot
        _add_counts(self._first_layer["Get"], get_firsts, gf_sum)
        _add_counts(self._duration["Lookup"], lookups, k_sum)  # an engine's, served whole there
        _add_counts(self._duration["Put"], puts, p_sum)  # of keys all stored already, likewise

    def serve(self, address: str) -> str:
        """Starts /metrics on ``address`` (HOST:PORT); returns its URL. Call on the daemon's loop."""
        self.loop = asyncio.get_running_loop()
        host, port = parse_metrics_listen(address)
        self.host = host
        self._server, self._thread = start_http_server(port, host, self.registry)
        self.port = self._server.server_port
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/metrics"

    async def stop(self) -> None:
        self.loop = None  # a scrape from now on reads no state
        server, self._server = self._server, None
        if server is None:
            return
        # shutdown() waits for the serving thread's loop: off the event loop, which a scrape may wait on.
        await asyncio.to_thread(server.shutdown)
        server.server_close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)
