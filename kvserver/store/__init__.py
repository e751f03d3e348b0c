"""The node-wide KV cache index: content-addressed pages shared by every engine of a KV space.

It keeps which pages hold which keys, where they lie in the host arena, and who may evict them;
it copies nothing and knows no gRPC.
"""

from kvserver.store.cache import MAX_PIN_MS, KVCache
from kvserver.store.keys import MAX_KEY_BYTES, split_keys
from kvserver.store.plans import GetPlan, PutPlan
from kvserver.store.spaces import Part, PartKey, Space, SpaceKey
from kvserver.store.stats import CacheCounters, SpaceStat, TenantStat

__all__ = [
    "MAX_KEY_BYTES", "MAX_PIN_MS", "CacheCounters", "GetPlan", "KVCache", "Part", "PartKey", "PutPlan",
    "Space", "SpaceKey", "SpaceStat", "TenantStat", "split_keys",
]
