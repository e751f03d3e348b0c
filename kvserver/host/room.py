"""Room being made in the arena for a client region: ranges kept out of everyone else's reach
until the region takes them.

A Register that needs the cache's memory evicts slabs in steps (``KVCache.make_room_steps``), the
event loop serving other engines between two. Meanwhile the room it has made must not go to anyone
else (a Put growing the cache would take it), and an evicted slab's memory must go back to the
kernel before the region is handed out, so that the engine never reads what the cache held; that
takes ~0.09 s a populated GiB (benchmarks/bench_release.py), too long for the loop. So the window's
free ranges and the evicted slabs' ranges stay reserved in a ``Room``: ``discard`` gives the slabs'
memory back in whichever thread calls it, and ``give_back`` returns every range to the free ones
on the loop, just before the region is reserved there (where ``discard`` did not run, or failed,
``release`` frees what is left first).

Primitives: ``Room`` (``hold_free``, ``hold_released``, ``discard``, ``give_back``, ``nbytes``).
"""

from __future__ import annotations

import logging

from kvserver.host.regions import Regions

logger = logging.getLogger(__name__)


class Room:
    """Ranges of ``arena`` held for a region: reserved, and nobody's."""

    def __init__(self, arena: Regions) -> None:
        self.arena = arena
        self._ranges: list[list[int]] = []  # [start, nbytes, clean]: clean ones hold nothing

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self._ranges)

    def hold_free(self, start: int, nbytes: int) -> None:
        """Takes the free range at ``start`` (free ranges hold nothing: already clean)."""
        self.arena.reserve_at(start, nbytes)
        self._ranges.append([start, nbytes, True])

    def hold_released(self, start: int, nbytes: int) -> None:
        """Keeps a range its holder let go while still reserved (its bookkeeping given back): what
        it held is still there until ``discard``."""
        self._ranges.append([start, nbytes, False])

    def discard(self) -> None:
        """Gives the memory of the ranges that held something back (any thread, without the GIL
        while the kernel works); a failure leaves the rest to ``give_back``."""
        for r in self._ranges:
            if not r[2]:
                self.arena.discard(r[0], r[1])
                r[2] = True

    def give_back(self) -> None:
        """Every range back among the free ones (the loop; ``discard``, if it ran, is over)."""
        ranges, self._ranges = self._ranges, []
        for start, nbytes, clean in ranges:
            self.arena.release(start, nbytes, discarded=bool(clean))
