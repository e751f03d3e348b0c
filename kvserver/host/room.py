"""Room being made in the arena for a client region: ranges kept out of everyone else's reach
until the region takes them.

A Register that needs the cache's memory evicts slabs in steps (``KVCache.make_room_steps``), the
event loop serving other engines between two. Meanwhile the room it has made must not go to anyone
else (a Put growing the cache would take it), and an evicted slab's memory must go back to the
kernel before the region is handed out, so that the engine never reads what the cache held; that
takes ~0.09 s a populated GiB (benchmarks/bench_release.py), too long for the loop. So the window's
free ranges (out of the free ones, claiming what is left of the budget, up to what the region
needs besides the window's slabs) and the
evicted slabs' ranges (still reserved) stay held in a ``Room``: ``discard`` gives the slabs' memory
back in whichever thread calls it, and ``give_back`` returns every range to the free ones
on the loop, just before the region is reserved there (where ``discard`` did not run, or failed,
``release`` frees what is left first).

Primitives: ``Room`` (``hold_free``, ``hold_released``, ``discard``, ``give_back``, ``nbytes``,
``released``, ``claimed``, ``dirty``).
"""

from __future__ import annotations

import logging

from kvserver.host.regions import REGION_ALIGN, Regions, align_up

logger = logging.getLogger(__name__)


class Room:
    """Ranges of ``arena`` held for a region: nobody's. The free ones it holds are not reserved,
    and claim of the budget what was left of it, up to their size and what the holder says the
    region needs besides (``Regions.hold``); the released ones stay reserved, as they were, until
    given back."""

    def __init__(self, arena: Regions) -> None:
        self.arena = arena
        self._free: list[tuple[int, int, int]] = []  # held free ranges (they hold nothing), claims
        self._released: list[list[int]] = []  # [start, nbytes, discarded]

    @property
    def nbytes(self) -> int:
        """The bytes it holds."""
        return sum(n for _, n, _ in self._free) + self.released

    @property
    def claimed(self) -> int:
        """The budget its free ranges claim: available again once given back."""
        return sum(c for _, _, c in self._free)

    @property
    def released(self) -> int:
        """The bytes of released ranges it holds: reserved until given back."""
        return sum(n for _, n, _ in self._released)

    @property
    def dirty(self) -> bool:
        """Whether a range it holds still holds what was there (``discard`` frees it)."""
        return any(not done for _, _, done in self._released)

    def hold_free(self, start: int, nbytes: int, most: int) -> None:
        """Takes the free range at ``start``, claiming at most ``most`` of the budget."""
        self._free.append((start, nbytes, self.arena.hold(start, nbytes, max(0, most))))

    def hold_released(self, start: int, nbytes: int) -> None:
        """Keeps a range its holder let go while still reserved (its bookkeeping given back): what
        it held is still there until ``discard``."""
        self._released.append([start, nbytes, False])
        self.arena.leaving += align_up(nbytes, REGION_ALIGN)

    def discard(self) -> None:
        """Gives the memory of the released ranges back (any thread, without the GIL while the
        kernel works); a failure leaves the rest to ``give_back``."""
        for r in self._released:
            if not r[2]:
                self.arena.discard(r[0], r[1])
                r[2] = True

    def give_back(self) -> None:
        """Every range back among the free ones (the loop; ``discard``, if it ran, is over)."""
        free, self._free = self._free, []
        released, self._released = self._released, []
        for start, nbytes, claim in free:
            self.arena.unhold(start, nbytes, claim)
        for start, nbytes, discarded in released:
            self.arena.leaving -= align_up(nbytes, REGION_ALIGN)
            self.arena.release(start, nbytes, discarded=bool(discarded))
