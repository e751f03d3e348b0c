"""What the daemon holds for one registered client: its geometry, pools, pages and counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserver.device_pool import ShmDevicePool
from kvserver.layout import KVLayout, LayerRange
from kvserver.page_allocator import PageAllocator
from kvserver.transfer import BufferTable


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
    dtype: torch.dtype
    page_size: int

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
    device: ShmDevicePool
    region_offset: int
    region_bytes: int
    pages: PageAllocator
    host_views: list[list[torch.Tensor]]  # [layer][part] -> [num_pages, page_size*elems]
    host_table: BufferTable
    counters: Counters = field(default_factory=Counters)
    busy: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    inflight: int = 0
    closing: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set and replaced on release
    # Liveness (see liveness.py): open Session streams, last call, when the last session ended.
    sessions: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    session_ended_at: float | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set once unregistered or reclaimed

    @property
    def capacity_tokens(self) -> int:
        return self.pages.num_pages * self.spec.page_size

    @property
    def used_tokens(self) -> int:
        return self.pages.num_used * self.spec.page_size
