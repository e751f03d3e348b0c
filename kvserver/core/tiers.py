"""The node-wide cache's tiers as Stats and /metrics report them: host memory, the disk, the cluster.

Primitives: ``TierStat`` and ``tier_stats`` (read on the daemon's loop, from the same counters
for both reports, so that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserver.core.kvcore import KVCore
from kvserver.store.keep import Recovery


@dataclass(frozen=True, slots=True)
class TierStat:
    name: str  # "host", "disk" or "cluster"
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
    present_pages: int = 0  # cluster: pages not stored, the cluster held them already
    joined: bool = False  # cluster: this node joined it
    available: bool = False  # cluster: joined, and answering (its breaker closed)
    breaker_trips: int = 0
    timeouts: int = 0
    busy: int = 0
    quarantined_pages: int = 0


def tier_stats(core: KVCore) -> list[TierStat]:
    """The host tier, then the disk tier and the cluster tier if there are: node-wide totals."""
    cache, disk = core.cache, core.disk
    tenants = [t.counters for t in cache.tenants.by_name.values()]
    # A tier's hits are the pages found there and not above: the tenants' count every page found.
    below = (disk.counters.hits if disk is not None else 0) + (
        core.cluster.counters.hits if core.cluster is not None else 0)
    host = TierStat("host", core.arena.capacity, cache.bytes, sum(c.pages for c in tenants),
                    sum(c.bytes for c in tenants), max(0, sum(c.hits for c in tenants) - below),
                    sum(c.evictions for c in tenants), recovery=core.recovery)
    out = [host]
    if disk is not None:
        c = disk.counters
        on_disk = [t.counters for t in disk.cache.tenants.by_name.values()]
        out.append(TierStat(
            "disk", disk.arena.capacity, disk.cache.bytes, sum(t.pages for t in on_disk),
            sum(t.bytes for t in on_disk), c.hits, sum(t.evictions for t in on_disk), c.written_pages,
            c.written_bytes, c.promoted_pages, c.promoted_bytes, c.skipped_pages, c.write_errors,
            c.read_errors, c.bad_checks, disk.direct, disk.recovery))
    cluster = core.cluster
    if cluster is not None:
        k = cluster.counters
        # Its pages and bytes are the master's to count (every node's, evicted by it): not here.
        out.append(TierStat(
            "cluster", cluster.client.segment_bytes, 0, 0, 0, k.hits, 0, k.published_pages,
            k.published_bytes, k.pulled_pages, k.pulled_bytes, k.skipped_pages, k.put_errors,
            k.get_errors, present_pages=k.present_pages, joined=cluster.joined, available=cluster.ready,
            breaker_trips=cluster.breaker.trips, timeouts=k.timeouts, busy=k.busy,
            quarantined_pages=k.quarantined_pages))
    return out
