"""Cache counters: what a space, a tenant and the whole cache have stored, hit, missed and evicted.

Primitives: ``CacheCounters`` (mutable counters, the fields of the proto's CacheCounters).
"""

from __future__ import annotations

from dataclasses import dataclass


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
