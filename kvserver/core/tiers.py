"""The node-wide cache's tiers as Stats and /metrics report them: host memory, then the disk.

Primitives: ``TierStat`` and ``tier_stats`` (read on the daemon's loop, from the same counters
for both reports, so that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserver.core.kvcore import KVCore
from kvserver.store.keep import Recovery


@dataclass(frozen=True, slots=True)
class TierStat:
    name: str  # "host" or "disk"
    capacity_bytes: int
    slab_bytes: int
    pages: int
    bytes: int
    hits: int  # looked-up pages found in this tier and not in the one above
    evicted_pages: int
    written_pages: int = 0
    written_bytes: int = 0
    promoted_pages: int = 0
    promoted_bytes: int = 0
    skipped_pages: int = 0
    write_errors: int = 0
    read_errors: int = 0
    bad_checks: int = 0
    direct_io: bool = False
    recovery: Recovery | None = None  # what the start found of the tier's kept files


def tier_stats(core: KVCore) -> list[TierStat]:
    """The host tier, then the disk tier if there is one: node-wide totals."""
    cache, disk = core.cache, core.disk
    tenants = [t.counters for t in cache.tenants.by_name.values()]
    below = disk.counters.hits if disk is not None else 0
    host = TierStat("host", core.arena.capacity, cache.bytes, sum(c.pages for c in tenants),
                    sum(c.bytes for c in tenants), max(0, sum(c.hits for c in tenants) - below),
                    sum(c.evictions for c in tenants), recovery=core.recovery)
    if disk is None:
        return [host]
    c = disk.counters
    on_disk = [t.counters for t in disk.cache.tenants.by_name.values()]
    return [host, TierStat(
        "disk", disk.arena.capacity, disk.cache.bytes, sum(t.pages for t in on_disk),
        sum(t.bytes for t in on_disk), c.hits, sum(t.evictions for t in on_disk), c.written_pages,
        c.written_bytes, c.promoted_pages, c.promoted_bytes, c.skipped_pages, c.write_errors,
        c.read_errors, c.bad_checks, disk.direct, disk.recovery)]
