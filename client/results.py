"""What the cache calls answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``pages``: how many leading keys are stored; ``lease_id``: the pin taken on them (with
    ``pin_ms``), for ``release`` or a ``get``."""

    pages: int
    lease_id: str = ""


@dataclass(frozen=True, slots=True)
class PutResult:
    """Pages copied into the cache, skipped as already stored, and not stored for want of room
    (the last keys); ``bytes`` copied."""

    stored: int = 0
    present: int = 0
    dropped: int = 0
    bytes: int = 0
