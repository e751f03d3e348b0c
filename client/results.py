"""What the cache calls answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``pages``: how many leading keys are stored; ``lease_id``: the pin taken on them (with
    ``pin_ms``), for ``release`` or a ``get``; ``disk_pages``: of the pages, those only the
    daemon's disk tier holds (a get reads them from disk first; they are not pinned);
    ``cluster_pages``: those after the node's own, that only the cluster tier holds (a get pulls
    them from other nodes first; not pinned, and a miss if their node is gone meanwhile)."""

    pages: int
    lease_id: str = ""
    disk_pages: int = 0
    cluster_pages: int = 0

    @property
    def host_pages(self) -> int:
        """Of the pages, those in the daemon's host memory."""
        return self.pages - self.disk_pages - self.cluster_pages

    @classmethod
    def from_wire(cls, resp) -> LookupResult:
        """From a LookupResponse."""
        return cls(resp.pages, resp.lease_id, resp.disk_pages, resp.cluster_pages)

    @property
    def away_pages(self) -> int:
        """Of the pages, those a get must first bring into host memory (disk or cluster)."""
        return self.disk_pages + self.cluster_pages


@dataclass(frozen=True, slots=True)
class PutResult:
    """Pages copied into the cache, skipped as already stored, and not stored for want of room
    (the last keys); ``bytes`` copied."""

    stored: int = 0
    present: int = 0
    dropped: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class KVEvent:
    """Keys every part of a space gained (``removed`` False) or lost in one tier of the node's
    cache: ``medium`` "CPU" or "STORAGE", ``locality`` "LOCAL" or "REMOTE" (vLLM's names)."""

    seq: int
    ts: float
    removed: bool
    medium: str
    locality: str
    keys: tuple[bytes, ...]
    unnamed: int = 0  # keys whose bytes the daemon no longer knew


@dataclass(frozen=True, slots=True)
class EventsResult:
    """What an ``events`` read returned: read again with ``log_id`` and ``next_seq``; ``gap``:
    events were dropped before these (the reader fell behind)."""

    log_id: str = ""
    next_seq: int = 0
    events: tuple[KVEvent, ...] = ()
    gap: bool = False

    @classmethod
    def from_wire(cls, resp) -> EventsResult:
        return cls(resp.log_id, resp.next_seq,
                   tuple(KVEvent(e.seq, e.ts, e.removed, e.medium, e.locality, tuple(e.keys), e.unnamed)
                         for e in resp.events), resp.gap)
