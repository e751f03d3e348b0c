"""The stats the cache reports per space and per tenant.

Primitives: ``SpaceStat`` and ``TenantStat`` (snapshots of ``CacheCounters`` with what they count).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserver.store.counters import CacheCounters
from kvserver.store.spaces import SpaceKey


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
