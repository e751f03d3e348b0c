"""The node-wide KV cache index: content-addressed pages shared by every engine of a KV space.

It keeps which pages hold which keys, where they lie in the host arena, and who may evict them;
it copies nothing and knows no gRPC.

Owns: ``cache`` (KVCache: lookup, prepare/complete put and get, leases, make_room, stats) and its
parts: ``spaces``, ``keys``, ``index``, ``stack``, ``pages``, ``slabs``, ``eviction``, ``leases``, ``quotas``,
``complete``, ``plans``, ``counters`` and ``stats``.
May import: ``host`` (the arena its slabs come from), ``protocol``, ``config`` and ``errors``; never
gRPC and never the copy code (``copies``, ``media``, ``core``).
"""

from kvserver.store.cache import MAX_PIN_MS, Found, KVCache
from kvserver.store.counters import CacheCounters
from kvserver.store.keys import MAX_KEY_BYTES, Keys
from kvserver.store.plans import GetPlan, PutPlan
from kvserver.store.spaces import Part, PartKey, Space, SpaceKey
from kvserver.store.stats import SpaceStat, TenantStat

__all__ = [
    "MAX_KEY_BYTES", "MAX_PIN_MS", "CacheCounters", "Found", "GetPlan", "KVCache", "Part", "PartKey",
    "PutPlan", "Keys", "Space", "SpaceKey", "SpaceStat", "TenantStat",
]
