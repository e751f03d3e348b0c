"""Room made in the arena for Registers that need the cache's memory, and what that room means to
other Registers meanwhile.

A Register whose region fits in no free range evicts cached slabs in steps, the event loop serving
other engines between two (``KVCache.make_room_steps``); what it makes is held in a ``Room`` until
its region is reserved. While one is held, the arena is in passing: its free ranges and evicted
slabs are nobody's, and they split the arena, so a second Register can find no window for a region
that fits once the first is done. ``Rooms`` keeps the rooms in flight and what each is made for, so
that such a Register waits for them rather than being refused, and one that fits not even then is
refused at once (``budget_back``, ``space_back``). A Register that fits, or needs no region, never waits.

Primitives: ``Rooms`` (``make``, ``budget_back``, ``space_back``).
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
        self._held: dict[Room, tuple[int, asyncio.Event]] = {}  # room: (bytes it is made for, done)

    def budget_back(self) -> int:
        """The budget the rooms in flight give back beyond the regions they are made for, once those
        are reserved: free ranges' claims and evicted slabs' bytes, less the regions. Negative where
        they have still to evict (from the cache's bytes, which the caller counts already)."""
        return sum(room.claimed + room.released - need for room, (need, _) in self._held.items())

    def space_back(self) -> int:
        """The arena's bytes the rooms in flight leave free beyond their regions once those are
        reserved: what they hold, less the regions (negative as ``budget_back``)."""
        return sum(room.nbytes - need for room, (need, _) in self._held.items())

    async def make(self, need: int) -> None:
        """Evicts cached slabs until the arena has a free range of ``need`` bytes, in steps, the
        evicted memory given back to the kernel in a worker thread (~0.09 s a populated GiB). The
        room made is held until this returns, so that nothing else takes it, and the caller reserves
        its region with no await in between. Where other Registers' rooms are in flight and the
        region fits only once they are given back, it waits for them first (up to ``ROOM_WAITS``
        times). Where other engines' use of the cache got in the way (a slab pinned meanwhile) in
        every one of ``ROOM_TRIES`` tries, the caller makes the rest of the room at once."""
        tries = waits = 0
        stopped = False  # the last try found no window, or was stopped
        while need and self.arena.largest_free() < need:
            now = self.arena.available + self.cache.bytes
            if (self._held and waits < ROOM_WAITS and (stopped or now < need)
                    and now + self.budget_back() >= need):
                waits += 1
                stopped = False
                await self._settled()
            elif now >= need and tries < ROOM_TRIES:
                tries += 1
                stopped = not await self._try(need)
                if not stopped:
                    return
            else:
                return

    async def _settled(self) -> None:
        """Returns once every room in flight now is given back (its region reserved, or refused)."""
        for _, done in list(self._held.values()):
            await done.wait()

    async def _try(self, need: int) -> bool:
        """One room made in steps, then given back: True if the arena has the range after."""
        room, done = Room(self.arena), asyncio.Event()
        self._held[room] = (need, done)
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
