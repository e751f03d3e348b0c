"""Room made in the arena for Registers that need the cache's memory, and what that room means to
other Registers meanwhile.

A Register whose region fits in no free range evicts cached slabs in steps, the event loop serving
other engines between two (``KVCache.make_room_steps``); what it makes is held in a ``Room`` until
its region is reserved. While one is held, the arena is in passing: its free ranges and evicted
slabs are nobody's, and they split the arena, so a second Register can find no window for a region
that fits once the first is done. ``Rooms`` keeps the rooms in flight and what each is made for:
such a Register waits for them first (``wait``), before it takes anything (its pool opened, the
registration it replaces released, its uid's turn to map a pool), and one that would not fit even
then does not wait. A room begun after that, while its pool opened, is waited for in ``make``. A
Register that fits in a free range, or needs no region, never waits.

What a room leaves beyond its region counts its Register's region as all the room holds, from the
least that Register accepts up to the most it asks (it takes what fits, up to that).

Primitives: ``Rooms`` (``make``, ``wait``, ``budget_back``, ``space_back``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvserver.core.share import LoopShare, in_steps
from kvserver.host.regions import Regions
from kvserver.host.room import Room
from kvserver.store import KVCache

logger = logging.getLogger(__name__)

# Times a Register evicts for its room in steps when other engines' use of the cache stops it, before
# it makes the rest at once.
ROOM_TRIES = 3
# Times a Register that fits only once other Registers' rooms are given back waits for those.
ROOM_WAITS = 3


class Rooms:
    """The rooms of the Registers under way. ``in_thread`` runs a function in a worker thread (the
    memory of the evicted slabs goes back to the kernel there), the caller's cancel waiting it out."""

    def __init__(self, arena: Regions, cache: KVCache, share: LoopShare,
                 in_thread: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.arena, self.cache, self.share = arena, cache, share
        self._in_thread = in_thread
        # room: (the least and the most bytes its Register's region takes, set once it is given back)
        self._held: dict[Room, tuple[int, int, asyncio.Event]] = {}

    def budget_back(self) -> int:
        """The budget the rooms in flight give back beyond the regions they are made for, once those
        are reserved: free ranges' claims and evicted slabs' bytes, less what the regions take of
        them (at least what each is made for, at most what its Register takes at most). Negative
        where they have still to evict (from the cache's bytes, which the caller counts already)."""
        return sum(room.claimed + room.released - _takes(room.nbytes, need, most)
                   for room, (need, most, _) in self._held.items())

    def space_back(self) -> int:
        """The arena's bytes the rooms in flight leave free beyond their regions once those are
        reserved: what they hold, less what the regions take of it (as ``budget_back``)."""
        return sum(room.nbytes - _takes(room.nbytes, need, most)
                   for room, (need, most, _) in self._held.items())

    def _worth_waiting(self, need: int, own: int) -> bool:
        """Whether a region of ``need`` bytes fits in no free range, and would once the rooms in
        flight are given back (``own``: bytes the caller gives back besides, its registration's;
        a region no larger than those needs no room of anyone's)."""
        return bool(need > own and self._held and self.arena.largest_free() < need
                    and self.arena.available + self.cache.bytes + own + self.budget_back() >= need)

    async def wait(self, need: int, own: int = 0) -> None:
        """Returns once a region of ``need`` bytes need not wait for others' rooms: it fits in a
        free range, no room is in flight, or it would not fit even once they are given back (with
        the ``own`` bytes of the registration it replaces); else waits for the rooms in flight to
        be given back, up to ``ROOM_WAITS`` times."""
        for _ in range(ROOM_WAITS):
            if not self._worth_waiting(need, own):
                return
            await self._settled()

    async def _settled(self) -> None:
        for _, _, done in list(self._held.values()):
            await done.wait()

    async def make(self, need: int, most: int) -> None:
        """Evicts cached slabs until the arena has a free range of ``need`` bytes, in steps, the
        evicted memory given back to the kernel in a worker thread (~0.09 s a populated GiB), for a
        region of up to ``most`` bytes. The room made is held until this returns, so that nothing
        else takes it, and the caller reserves its region with no await in between. A try that
        finds no window while others' rooms are in flight that would leave one (a room begun since
        ``wait``) waits for them once more, up to ``ROOM_WAITS`` times. Where other engines' use
        of the cache got in the way (a slab pinned meanwhile) in every one of ``ROOM_TRIES``
        tries, the caller makes the rest of the room at once."""
        tries = waits = 0
        while need and self.arena.largest_free() < need:
            if waits < ROOM_WAITS and self._worth_waiting(need, 0) and (tries or self.arena.available
                                                                         + self.cache.bytes < need):
                waits += 1
                await self._settled()
            elif tries < ROOM_TRIES and self.arena.available + self.cache.bytes >= need:
                tries += 1
                if await self._try(need, max(need, most)):
                    return
            else:
                return

    async def _try(self, need: int, most: int) -> bool:
        """One room made in steps, then given back: True if the arena has the range after."""
        room, done = Room(self.arena), asyncio.Event()
        self._held[room] = (need, most, done)
        try:
            made = await in_steps(self.share, self.cache.make_room_steps(need, room))
        finally:  # (cancelled too: the thread is waited out, then the cancel goes on)
            try:
                if room.dirty:
                    await self._in_thread(room.discard)
            except Exception:
                logger.exception("giving back %d bytes of evicted cache in a worker failed", room.released)
            finally:
                room.give_back()  # (what no thread discarded is freed here first)
                del self._held[room]
                done.set()  # (its waiters run once this Register yields: its region reserved by then)
        return made or self.arena.largest_free() >= need


def _takes(held: int, need: int, most: int) -> int:
    """What a region taking at least ``need`` bytes and at most ``most`` takes of a room whose
    ranges span ``held`` bytes (their budget may be less: a free range claims only what is left)."""
    return min(max(held, need), most)
