"""What the daemon holds for one registered client: its geometry, pools, pages and counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserver.copies.order import JobOrder
from kvserver.copies.transfer import BufferTable
from kvserver.errors import InvalidArgument
from kvserver.host.pages import PageAllocator
from kvserver.media.base import DevicePool
from kvserver.peers.tickets import PeerCred
from kvserver.protocol.layout import KVDType, KVLayout, LayerRange, kv_dtype
from kvserver.store import PartKey, SpaceKey
from kvserver.v1 import kvserver_pb2 as pb

MAX_PARALLEL = 4096  # TP and PP sizes a model (a registration's, a space's) may name
# Layers a model (a registration's, a space's) may have: 30 times the deepest model served today. A
# Register's views and checks are Python objects per (layer, part), made in a worker thread: for
# 65536 layers they took 7-8 s and held the event loop 129-145 ms (full collections over them).
MAX_LAYERS = 4096


def check_model_shape(tp_size: int, pp_size: int, num_layers: int, what: str = "") -> None:
    """The bounds every registration and every KV space named on the wire are held to."""
    if tp_size > MAX_PARALLEL or pp_size > MAX_PARALLEL or num_layers > MAX_LAYERS:
        raise InvalidArgument(f"{what}tp_size {tp_size}, pp_size {pp_size}, num_layers {num_layers}: "
                              f"at most {MAX_PARALLEL}, {MAX_PARALLEL} and {MAX_LAYERS}")
    if pp_size > num_layers:
        raise InvalidArgument(f"{what}pp_size {pp_size} is more than its {num_layers} layers")


def public_id(client_id: str) -> str:
    """What logs and listings show of a client id: its first 8 of 32 hex digits. The id is the
    client's bearer capability, so it is never shown whole to anyone but its holder."""
    return client_id[:8] + "..."


@dataclass(slots=True)
class Counters:
    bytes_written: int = 0
    bytes_loaded: int = 0
    write_ops: int = 0
    load_ops: int = 0

    def add(self, other: Counters) -> None:
        self.bytes_written += other.bytes_written
        self.bytes_loaded += other.bytes_loaded
        self.write_ops += other.write_ops
        self.load_ops += other.load_ops


@dataclass(frozen=True, slots=True)
class ClientSpec:
    model: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    num_layers: int
    layers: LayerRange
    layout: KVLayout
    dtype: KVDType
    page_size: int
    weights: str = ""  # the weights' identity beyond the model's name: part of its KV space

    @classmethod
    def from_request(cls, req: pb.RegisterRequest) -> ClientSpec:
        if not req.model:
            raise InvalidArgument("model must be set")
        if len(req.model) > 256:
            raise InvalidArgument(f"model name is {len(req.model)} characters; at most 256")
        if len(req.weights) > 256:
            raise InvalidArgument(f"weights is {len(req.weights)} characters; at most 256")
        tp_size, pp_size = max(req.tp_size, 1), max(req.pp_size, 1)
        if req.tp_rank >= tp_size or req.pp_rank >= pp_size:
            raise InvalidArgument(
                f"rank out of range: tp {req.tp_rank}/{tp_size}, pp {req.pp_rank}/{pp_size}"
            )
        layers = LayerRange(req.start_layer, req.end_layer)
        if req.end_layer > req.num_layers:
            raise InvalidArgument(
                f"layer range {layers} does not fit in a model of num_layers={req.num_layers}"
            )
        check_model_shape(tp_size, pp_size, req.num_layers)
        if req.page_size == 0 or req.page_size > 4096:
            raise InvalidArgument(f"page_size must be in [1, 4096], got {req.page_size}")
        if req.dtype == pb.DTYPE_UNSPECIFIED:
            raise InvalidArgument("dtype must be set")
        return cls(
            model=req.model,
            tp_rank=req.tp_rank,
            tp_size=tp_size,
            pp_rank=req.pp_rank,
            pp_size=pp_size,
            num_layers=req.num_layers,
            layers=layers,
            layout=KVLayout.from_wire(req.layout),
            dtype=kv_dtype(req.dtype),
            page_size=req.page_size,
            weights=req.weights,
        )

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one part of one layer."""
        return self.layout.token_bytes(self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page: every layer and part of the range, page-first."""
        return len(self.layers) * self.layout.num_parts * self.page_size * self.token_bytes


@dataclass(slots=True)
class ClientState:
    client_id: str
    epoch: int  # carried in the high bits of every host index this registration hands out
    spec: ClientSpec
    device: DevicePool
    region_offset: int
    region_bytes: int
    pages: PageAllocator
    host_views: list[list[np.ndarray]]  # [layer][part] -> [num_pages, page_size*elems]
    host_table: BufferTable
    counters: Counters = field(default_factory=Counters)
    busy: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    inflight: int = 0
    jobs: set = field(default_factory=set)  # copier.ClientJob in flight, stopped when the client is released
    closing: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set and replaced on release
    # Liveness (see liveness.py): open Session streams, last call, when the last session ended.
    sessions: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    session_ended_at: float | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set once unregistered or reclaimed
    copies_pending: bool = False  # released with GPU work that may still run (quarantined)
    # The registering process (pid, uid, gid from its peer ticket); None for a CUDA pool sent without one.
    peer: PeerCred | None = None
    # A pidfd of that process, from its ticket (-1: none): a registration whose process exited
    # before it opened a Session is reclaimed as one whose Session ended (liveness.py).
    pidfd: int = -1
    tenant: str = "anonymous"  # whose cached pages it sees (kvserver.peers.tenants)
    quota_bytes: int = 0  # what its region counts in its tenant's region quota (0: no quota)
    # The descriptors its pool's mappings hold (kvserver.core.kvcore.pool_descriptors), and whose
    # count they are in: its uid's, or its tenant's where the call came with no peer.
    pool_fds: int = 0
    pool_fds_of: int | str = ""
    mapped_bytes: int = 0  # of the daemon's address space, what its pool's mappings take (its uid's count)
    cache_table: BufferTable | None = None  # its part's page layout for cache jobs, made on first use
    part_keys: tuple[SpaceKey, PartKey] | None = None  # its part of the cache, made on first use
    order: JobOrder | None = None  # which of its copies wait for which (copies.order), made on first copy
    lane: Any = None  # its kvserver.lane.server.Lane, if it opened one; closed on release
    # Its gate on the compiled data plane (kvserver.lane.plane), if its lane is served there: the
    # plane's copies of its pages, counted apart from ``busy``/``inflight``; closed on release.
    gate: Any = None
    # The plane cannot serve its cache calls whole (``CacheOps._serve_on_plane`` found its rows or
    # its pool's checks refused, which never change): not asked again.
    off_plane: bool = False
    plane_token: int = 0  # the token its cache calls on the plane end with (CacheOps._serve_on_plane)
    plane_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # turns among the plane's copies, in order

    @property
    def capacity_tokens(self) -> int:
        return self.pages.num_pages * self.spec.page_size

    @property
    def used_tokens(self) -> int:
        return self.pages.num_used * self.spec.page_size
