"""Cache counters and the stats the cache reports per space and per tenant.

Primitives: ``CacheCounters`` (mutable counters, the fields of the proto's CacheCounters),
``SpaceStat`` and ``TenantStat`` (snapshots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserver.store.spaces import SpaceKey


@dataclass(slots=True)
class CacheCounters:
    """pages and bytes are current values (pages being written included); the rest count up."""

    pages: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    dedup_pages: int = 0
    dedup_bytes: int = 0
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class SpaceStat:
    space: SpaceKey
    counters: CacheCounters
    parts_seen: int
    parts: int
    complete_pages: int


@dataclass(frozen=True, slots=True)
class TenantStat:
    tenant: str
    counters: CacheCounters
    quota_bytes: int  # 0: no quota
