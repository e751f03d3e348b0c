"""The shared-memory medium: an engine's KV buffers in memfds (or named /dev/shm objects) mapped
into the daemon, copied by the CPU. Views use the widest integer dtype that divides every offset,
stride and token size, so copies move 8-byte words where they can whatever the KV dtype is."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvserver.copies import geometry, transfer, workers
from kvserver.copies.transfer import BufferTable
from kvserver.copies.workers import Work
from kvserver.errors import FailedPrecondition, InvalidArgument, NoCapacity, PermissionDenied, Unimplemented
from kvserver.media.base import DevicePool, wide_dtype
from kvserver.peers.tickets import PeerCred
from kvserver.protocol.layout import KVDType, KVLayout
from kvserver.protocol.raw_memory import address_of, array_at, rows_at
from kvserver.protocol.shared_memory import ShmMapping, map_sealed_fd, open_shm
from kvserver.v1 import kvserver_pb2 as pb

if TYPE_CHECKING:
    from kvserver.copies.job import Job
    from kvserver.copies.progress import LayerSignal


@dataclass(frozen=True, slots=True)
class ShmAccess:
    """What a shared-memory pool may be opened from: the descriptors and credentials of the
    Register call's peer ticket (none without one), whether named /dev/shm objects are allowed
    (--allow-named-shm), and whether the daemon has the Unix socket tickets come from."""

    fds: tuple[int, ...] = ()
    peer: PeerCred | None = None
    allow_named: bool = False
    fd_socket: bool = True
    # Bytes of the daemon's address space the pool's mappings may take (None: no bound): what its
    # uid's pools have left of theirs.
    map_budget: int | None = None


@dataclass(slots=True)
class ShmDevicePool(DevicePool):
    """Views into the engine's shared-memory KV buffers, checked against each object's size."""

    num_tokens: int
    page_size: int
    dtype: np.dtype  # the wide copy dtype
    token_views: list[list[np.ndarray]]  # [layer][part] -> [num_tokens, elems]
    page_views: list[list[np.ndarray]] | None  # [layer][part] -> [num_pages, page_size*elems]
    mappings: list[ShmMapping] = field(default_factory=list)
    token_table: BufferTable | None = None
    page_table: BufferTable | None = None

    @property
    def mapped_bytes(self) -> int:
        return sum(m.size for m in self.mappings)

    def __post_init__(self) -> None:
        if self.token_table is not None:  # a strided pool: its table is given, it has no views
            return
        self.token_table = BufferTable.of(self.token_views)
        if self.page_views is not None:
            self.page_table = BufferTable.of(self.page_views)

    @property
    def paged(self) -> bool:
        return self.page_views is not None

    @property
    def event_slots(self) -> int:
        return 0

    @property
    def event_handles(self) -> tuple[bytes, ...]:
        return ()

    @property
    def ipc_allocations(self) -> frozenset[bytes]:
        return frozenset()

    @property
    def inline_ok(self) -> bool:
        return True

    @property
    def records_events(self) -> bool:
        return False

    @property
    def failed(self) -> str | None:
        return None  # a CPU copy cannot hang behind anything

    def check_request(self, ready_event: bytes, event_slot: int) -> None:
        if ready_event or event_slot:
            raise InvalidArgument("ready_event and event_slot are for CUDA pools; this pool is shared memory")

    def attach_host(self, host_ptr: int, nbytes: int, num_layers: int) -> None:
        """The CPU copies between shared memory and the host region: nothing to set up."""

    def check_cache_rows(self) -> None:
        """The CPU reaches the cache's slabs as any arena memory: nothing to check."""

    def plane_buffers(self) -> tuple[list[int], int] | None:
        """Plain buffers of one token stride, every object a sealed descriptor: a named object may
        shrink under the mapping, which only the loop's size check before each copy catches."""
        table = self.token_table
        if table is None or table.geometry is not None or table.row_stride is None:
            return None
        if any(m.fd >= 0 for m in self.mappings):
            return None
        return [int(b) for b in table.bases.reshape(-1)], table.row_stride

    def check_sizes(self) -> None:
        """Named objects can shrink under the mapping; sealed fds cannot (their fd is -1)."""
        for m in self.mappings:
            m.check_size()

    def start(self, job: Job, to_device: bool, signal: LayerSignal | None, executor: Executor,
              waiters: Executor, plane: Callable | None = None) -> Future[None]:
        if plane is not None:  # the data plane's thread copies it, in C, where it takes the job
            fut = plane(job, to_device, signal)
            if fut is not None:
                job.queued = fut  # running: a stop is the job's stop word, read between layers
                return fut
        table = self.page_table if job.plan.device_paged else self.token_table
        count = transfer.row_count(job.plan, job.host, table)
        if count is None:  # no compiled kernel, or buffers of different strides: one piece
            work = Work(to_device, 1, lambda _: self._run_views(job, to_device, signal),
                        stopping=lambda _: job.stopping, ready=job.ready)
        else:
            work = _pieces(job, lambda: transfer.job_rows(job.plan, job.host, table), count, table,
                           to_device, signal, getattr(executor, "threads", 1))
        job.work = work
        fut = job.queued = executor.submit_work(work)
        return fut

    def _run_views(self, job: Job, to_device: bool, signal: LayerSignal | None) -> None:
        """Copies the job's layers in order, a (layer, part) at a time (``transfer.copy_part``), in
        this thread; raises ``JobStopped`` if it was stopped first (before any layer, or at a layer
        boundary)."""
        for i, layer in enumerate(job.local_layers):
            if job.stopping:
                raise job.stopped(i)
            for part, dev_tokens in enumerate(self.token_views[layer]):
                pages = self.page_views[layer][part] if self.page_views is not None else None
                if job.host_table is None:
                    host = job.region_views[layer][part]
                    transfer.copy_part(job.plan, host, pages, dev_tokens, to_device)
                else:
                    transfer.copy_part_at(job.plan, job.host_table, layer, part, pages, dev_tokens, to_device)
            if signal is not None:
                signal.publish(i + 1)
        job.check_ended(to_device)

    def close(self) -> None:
        # The tables hold the mappings' addresses: a copy started after this finds none to use.
        self.token_table = self.page_table = None
        self.token_views = []
        self.page_views = None
        for m in self.mappings:
            m.close()
        self.mappings = []


def open_shm_pool(
    refs: list[pb.BufferRef],
    n: int,
    layout: KVLayout,
    kv_dtype: KVDType,
    num_layers: int,
    page_size: int,
    access: ShmAccess,
) -> ShmDevicePool:
    """Maps each descriptor or named object once, checks each buffer against its size, and
    builds views. Every reference is checked before anything is mapped."""
    token_bytes = layout.token_bytes(kv_dtype)
    _check_access(refs, access)
    heads, head_bytes = layout.num_heads, layout.head_dim * kv_dtype.itemsize
    budget = geometry.CheckBudget()
    geoms = [geometry.of_ref(r, n, heads, head_bytes, f"device_pool buffer {i}", budget)
             for i, r in enumerate(refs)]
    mappings: dict[str, ShmMapping] = {}
    # Of each object, the bytes its buffers reach, [lowest, highest): all that is mapped of it.
    spans: dict[str, tuple[int, int]] = {}
    for r, g in zip(refs, geoms, strict=True):
        lo, hi = g.span(n)
        was = spans.get(_key(r), (lo, hi))
        spans[_key(r)] = (min(was[0], lo), max(was[1], hi))
    page = mmap.ALLOCATIONGRANULARITY
    most = sum(-(-hi // page) * page - lo // page * page for lo, hi in spans.values())
    if access.map_budget is not None and most > access.map_budget:
        raise NoCapacity(
            f"this pool's buffers span {most} bytes of the daemon's address space, more than the "
            f"{max(access.map_budget, 0)} its uid's pools have left of theirs (the node's memory): "
            "unregister a pool, or pack its buffers closer"
        )
    try:
        for r, g in zip(refs, geoms, strict=True):
            key = _key(r)
            if key not in mappings:
                if r.HasField("fd"):
                    mappings[key] = map_sealed_fd(access.fds[r.fd.index], f"fd {r.fd.index}", spans[key])
                else:
                    mappings[key] = open_shm(r.shm.name, access.peer.uid, spans[key])
            m = mappings[key]
            end = g.span(n)[1]
            if end > m.end:
                what = f"shm object {r.shm.name!r}" if r.HasField("shm") else f"fd {r.fd.index}"
                raise InvalidArgument(
                    f"{what} is {m.end} bytes but the buffer at {geometry.describe(r)} "
                    f"needs {end} bytes for {n} tokens"
                )
        geometry.check_no_overlap(geoms, [_key(r) for r in refs], n, lambda i: f"device_pool buffer {i}",
                                  budget)
        if not all(g.plain for g in geoms):
            return _strided_pool(refs, geoms, n, layout, page_size, token_bytes, mappings)
        wide = wide_dtype(token_bytes, *(r.offset for r in refs), *(r.token_stride for r in refs))
        w = wide.itemsize
        flat = {key: array_at(address_of(m.mm), m.size, wide) for key, m in mappings.items()}

        def at(r: pb.BufferRef) -> int:  # its offset in its mapping (which starts at a page of it)
            return r.offset - mappings[_key(r)].start

        elems = token_bytes // w
        parts = layout.num_parts
        token_views = [
            [
                rows_at(flat[_key(r)], at(r), n, elems, r.token_stride)
                for r in refs[layer * parts : (layer + 1) * parts]
            ]
            for layer in range(num_layers)
        ]
        page_views = None
        if all(r.token_stride == token_bytes for r in refs) and n >= page_size:
            pages = n // page_size
            page_views = [
                [
                    rows_at(flat[_key(r)], at(r), pages, page_size * elems, page_size * token_bytes)
                    for r in refs[layer * parts : (layer + 1) * parts]
                ]
                for layer in range(num_layers)
            ]
        return ShmDevicePool(n, page_size, wide, token_views, page_views, list(mappings.values()))
    except BaseException:
        for m in mappings.values():
            m.close()
        raise


def _strided_pool(refs: list[pb.BufferRef], geoms: list[geometry.Geometry], n: int, layout: KVLayout,
                  page_size: int, token_bytes: int, mappings: dict[str, ShmMapping]) -> ShmDevicePool:
    """A pool with blocks or strided heads (docs/layouts.md): no tensor views, only a table of each
    buffer's address and the geometry every buffer shares; rows are tokens, or (token, head)
    segments where heads are not contiguous."""
    if transfer.copy_layers is None:
        raise Unimplemented("shared-memory pools with blocks or strided heads need kvserver's compiled "
                            "copy kernel (_kvcopy)")
    if len({g.shape_key() for g in geoms}) != 1:
        raise Unimplemented(
            "every buffer of a shared-memory pool with blocks or strided heads must have the same "
            "token_stride, block_tokens, block_stride and head_stride")
    addresses = {key: address_of(m.mm) for key, m in mappings.items()}
    parts = layout.num_parts
    bases = np.array([[addresses[_key(r)] + r.offset - mappings[_key(r)].start for r in refs[i : i + parts]]
                      for i in range(0, len(refs), parts)], dtype=np.uint64)
    g = geoms[0]
    row_bytes = g.token_bytes if g.heads_contiguous else g.head_bytes
    table = BufferTable(bases=bases, row_stride=None, row_bytes=row_bytes, geometry=g)
    return ShmDevicePool(n, page_size, wide_dtype(token_bytes, g.head_bytes), [], None,
                         list(mappings.values()), token_table=table)


def _key(r: pb.BufferRef) -> str:
    return f"fd:{r.fd.index}" if r.HasField("fd") else f"shm:{r.shm.name}"


def _check_access(refs: list[pb.BufferRef], access: ShmAccess) -> None:
    """The pool names only descriptors its caller sent, and named objects only where allowed."""
    if not access.fd_socket:
        raise FailedPrecondition(
            "shared-memory pools need the daemon's Unix socket (descriptors come over its fd "
            "socket); this daemon listens on TCP only"
        )
    named = any(r.HasField("shm") for r in refs)
    if named and not access.allow_named:
        raise PermissionDenied(
            "named shm objects (ShmLocation) are refused unless the daemon runs with "
            "--allow-named-shm; send the pool's memfd over the fd socket (FdLocation) instead"
        )
    if access.peer is None:
        raise InvalidArgument(
            "a shared-memory pool needs a peer_ticket from the daemon's fd socket (the gRPC socket's "
            "path + '.fd'): it carries the pool's descriptors and the caller's credentials"
        )
    for i, r in enumerate(refs):
        if r.HasField("fd") and r.fd.index >= len(access.fds):
            raise InvalidArgument(
                f"device_pool buffer {i} names fd {r.fd.index} but the peer ticket carries "
                f"{len(access.fds)} descriptor(s)"
            )


def _pieces(job: Job, plan_rows: Callable[[], transfer.JobRows], count: int, table: BufferTable,
            to_device: bool, signal: LayerSignal | None, threads: int) -> Work:
    """The job as pieces of at most about ``workers.CHUNK_BYTES``: groups of whole layers, or,
    where a layer is larger than a piece or the job is large enough to take every worker, each
    layer's rows split in ranges (of at least ``workers.MIN_RANGE_BYTES``) that run in
    parallel. ``count`` rows; ``plan_rows`` makes their offsets (in the first piece's worker, not
    on the loop).

    Progress: whole-layer pieces run in order and the kernel publishes every layer as it lands; a
    load whose layers each fit a piece is one kernel call. Split layers are published once all
    their ranges are done, in layer order."""
    total_layers = len(job.local_layers)
    layers = np.asarray(job.local_layers, dtype=np.int64)
    per_layer = max(1, job.bytes_per_layer)
    chunk = workers.CHUNK_BYTES
    split = -(-per_layer // chunk)
    parallel_from = workers.PARALLEL_BYTES
    if to_device and threads > 1 and parallel_from is not None and per_layer * total_layers >= parallel_from:
        split = max(split, threads)
    split = max(1, min(split, count, per_layer // max(1, workers.MIN_RANGE_BYTES)))
    if split == 1 and to_device:
        group = max(1, total_layers)  # one call: the kernel publishes each layer as it lands
    elif split == 1:
        group = max(1, chunk // per_layer)
    elif to_device:
        group = 1  # a load's layers are published as they land: one layer a piece
    else:
        group = max(1, chunk * split // per_layer)
    groups = -(-total_layers // group) if total_layers else 0
    bounds = [count * s // split for s in range(split + 1)]
    progress = signal.counter if signal is not None else np.zeros(1, dtype=np.int64)
    left = [split] * groups  # ranges still to copy, per layer group
    lock = threading.Lock()
    frontier = [0]  # layer groups done, in order (split layers)
    made: list[transfer.RowCopier] = []

    def copier() -> transfer.RowCopier:
        with lock:
            if not made:
                made.append(transfer.RowCopier(plan_rows(), layers, job.host, table, to_device))
            return made[0]

    def run(i: int) -> None:
        g, s = divmod(i, split)
        lo, hi = g * group, min(total_layers, (g + 1) * group)
        if split == 1:
            # Stopped at a layer boundary (the stop word): ``finish`` reports the layers done.
            fd, interval = (signal.fd, signal.interval) if signal is not None else (-1, 0.0)
            copier().copy(lo, hi, 0, count, progress, lo, fd, interval, job.stop_word)
            return
        # No stop word: a layer group once begun is finished (``stopping`` below), so a job
        # stops at a layer boundary, never with a layer half copied.
        copier().copy(lo, hi, bounds[s], bounds[s + 1])
        with lock:  # published under the lock: progress never goes back
            left[g] -= 1
            moved = False
            while frontier[0] < groups and left[frontier[0]] == 0:
                frontier[0] += 1
                moved = True
            if moved:
                landed = min(total_layers, frontier[0] * group)
                if signal is not None:
                    signal.publish(landed)
                else:
                    progress[0] = landed

    def finish() -> None:
        landed = int(progress[0]) if split == 1 else min(total_layers, frontier[0] * group)
        if landed < total_layers:
            if signal is not None:
                os.eventfd_write(signal.fd, 1)  # wake the loop: the copy ends here
            raise job.stopped(landed)
        job.check_ended(to_device)

    def stopping(i: int) -> bool:
        return job.stopping and i % split == 0  # the next piece would begin a layer group

    return Work(to_device, max(1, groups * split), run, finish, parallel=split > 1,
                stopping=stopping, ready=job.ready)


def pool_descriptors(pool: pb.DevicePool) -> tuple[int, set[int]]:
    """The descriptors a pool's mappings keep open while it is registered (one a memfd: the
    mapping's own copy of it; two a named object: its descriptor, kept to check its size before
    each copy, and the mapping's), and the ticket's descriptors it names."""
    fds, names = set(), set()
    for layer in pool.layers:
        for ref in layer.parts:
            kind = ref.WhichOneof("location")
            if kind == "fd":
                fds.add(ref.fd.index)
            elif kind == "shm":
                names.add(ref.shm.name)
    return len(fds) + 2 * len(names), fds
