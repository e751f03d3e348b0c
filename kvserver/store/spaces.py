"""KV spaces and their parts: what makes cached pages interchangeable.

Primitives: ``SpaceKey`` (tenant, model and geometry of a space), ``PartKey`` (one TP shard and PP
stage of it), ``Space`` (a space's parts and counters) and ``Part`` (one of its parts).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserver.protocol.layout import KVDType, KVLayout
from kvserver.store.complete import CompleteCount, PartCounts
from kvserver.store.counters import CacheCounters


@dataclass(frozen=True, slots=True)
class SpaceKey:
    """Everything that must be equal for two engines to share pages, the tenant included."""

    tenant: str
    model: str
    layout: KVLayout
    dtype: KVDType
    page_size: int
    num_layers: int
    tp_size: int
    pp_size: int
    weights: str = ""  # the weights' identity beyond the model's name (KVSpace.weights)

    @property
    def tp_shards(self) -> int:
        """Parts per PP stage: one per TP rank for MHA, one for MLA (the latent is replicated)."""
        return 1 if self.layout.is_mla else self.tp_size

    @property
    def num_parts(self) -> int:
        return self.tp_shards * self.pp_size


@dataclass(frozen=True, slots=True)
class PartKey:
    """One part of a space: a TP shard of one PP stage, with its layer range and page size."""

    tp_shard: int
    pp_rank: int
    start_layer: int
    end_layer: int
    page_bytes: int


class Space:
    """One KV space: its parts by (tp_shard, pp_rank) and its counters."""

    __slots__ = ("key", "parts", "counters", "complete", "__weakref__")

    def __init__(self, key: SpaceKey, counts: PartCounts) -> None:
        self.key = key
        self.parts: dict[tuple[int, int], Part] = {}
        self.counters = CacheCounters()
        self.complete = CompleteCount(key.num_parts, counts)  # keys committed in every part

    def __repr__(self) -> str:
        return f"Space({self.key.tenant!r}, {self.key.model!r}, parts={len(self.parts)}/{self.key.num_parts})"


class Part:
    """One part of a space; its keys are filed under ``gid`` in the page table's index."""

    __slots__ = ("space", "key", "index", "gid", "pages")

    def __init__(self, space: Space, key: PartKey, gid: int) -> None:
        self.space = space
        self.key = key
        self.index = key.pp_rank * space.key.tp_shards + key.tp_shard
        self.gid = gid  # cache-wide id, as kept in the page table
        self.pages = 0  # pages filed under it (being written or committed)

    def __repr__(self) -> str:
        return f"Part(tp_shard={self.key.tp_shard}, pp_rank={self.key.pp_rank}, pages={self.pages})"
