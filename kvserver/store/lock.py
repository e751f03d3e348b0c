"""The cache's one lock: held by the event loop around every change of the key index and the pages.

The data plane's thread serves a lane Get whole where it can (docs/design.md, "A Get on the data
plane"): it walks the index and holds the pages it found, then copies them; and stores a lane Put
into pages the loop set aside for it, filing its keys (index entries and chains, the pages' parts,
states and holds, the index's count: "A Put on the data plane"). It does so under this lock, which
it only *tries*, for a few microseconds (a call finding it taken that long goes to the loop). The
loop takes it, blocking, around each of the cache's operations that change what that walk reads
(the index's chains and bucket counters, the pages' states, offsets and holds) or that decide on
holds read meanwhile (eviction: a page or slab found not held is dropped in the same
hold of the lock, so a hold the plane took before is seen and one it would take after waits).

Primitives: ``CacheLock``: a context manager for the loop (re-entrant: an operation that calls
another takes it once), ``attach`` (the plane's C lock: until then the lock only counts, so that a
cache without a plane pays one integer), and ``check``, which the page and index changes call:
a change outside the lock raises, so a path that forgets it fails every test that runs it.
"""

from __future__ import annotations

from typing import Any


class CacheLock:
    __slots__ = ("depth", "_c")

    def __init__(self) -> None:
        self.depth = 0  # nested holds on the loop's thread
        self._c: Any = None  # kvserver.lane._kvlane.Cache, once the plane serves Gets

    def attach(self, c: Any) -> None:
        """From now on the lock is ``c``'s (the plane's); not while it is held."""
        if self.depth:
            raise RuntimeError("the cache's lock is attached only while it is not held")
        self._c = c

    def __enter__(self) -> CacheLock:
        if not self.depth and self._c is not None:
            self._c.lock()
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth and self._c is not None:
            self._c.unlock()

    def check(self) -> None:
        """Raises unless the lock is held: every change of the pages or the index calls it."""
        if not self.depth:
            raise RuntimeError("the cache's pages or index changed outside its lock (kvserver.store.lock)")
