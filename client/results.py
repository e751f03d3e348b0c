"""What the cache calls answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``pages``: how many leading keys are stored; ``lease_id``: the pin taken on them (with
    ``pin_ms``), for ``release`` or a ``get``; ``disk_pages``: of the pages, those only the
    daemon's disk tier holds (a get reads them from disk first; they are not pinned)."""

    pages: int
    lease_id: str = ""
    disk_pages: int = 0

    @property
    def host_pages(self) -> int:
        """Of the pages, those in the daemon's host memory."""
        return self.pages - self.disk_pages


@dataclass(frozen=True, slots=True)
class PutResult:
    """Pages copied into the cache, skipped as already stored, and not stored for want of room
    (the last keys); ``bytes`` copied."""

    stored: int = 0
    present: int = 0
    dropped: int = 0
    bytes: int = 0
