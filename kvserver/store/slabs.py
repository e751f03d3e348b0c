"""Slabs: runs of equal-sized pages taken from the top of the host arena, one class each.

A class is a tenant and a page size: a slab holds the pages of one tenant only, so what a tenant
holds (its slabs, whole, whatever it pins in them) is known and charged to its quota, and its pins
keep only its own slabs from eviction.

Each slab keeps its own free pages, so that releasing one costs its own pages only, whatever
else its class holds; and a slab holds at most ``MAX_SLAB_PAGES`` pages, so that evicting one (every
key of it out of the index) is a bounded piece of work however small the pages.

Primitives: ``Slab``, ``SlabPool.grow`` (reserve one more slab of a class), ``SlabPool.take`` /
``SlabPool.give`` (free pages of a class out and back), ``SlabPool.held`` (a tenant's slab bytes)
and ``SlabPool.release`` (a slab back to the arena, its hooks called first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvserver.errors import NoCapacity
from kvserver.host.arena import BOOK_ALLOWANCE, REGION_ALIGN, HostArena
from kvserver.store.pages import BYTES_PER_PAGE, FREE, MAX_SLAB_PAGES, PageTable
from kvserver.store.stack import IdStack

if TYPE_CHECKING:
    from kvserver.host.room import Room
    from kvserver.store.keep import Keep

logger = logging.getLogger(__name__)


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


Class = tuple[int, int]  # (tenant id, page bytes)


@dataclass(slots=True)
class Slab:
    sid: int
    offset: int
    nbytes: int
    page_bytes: int
    pages: np.ndarray  # page ids, page i at offset + i * page_bytes
    tenant: int = -1  # the tenant whose pages it holds
    free_ids: IdStack = field(default_factory=IdStack)  # its pages that hold nothing

    @property
    def cls(self) -> Class:
        return (self.tenant, self.page_bytes)

    @property
    def free(self) -> int:
        return len(self.free_ids)


class SlabPool:
    """The cache's slabs and, per page size class, its free pages."""

    def __init__(self, arena: HostArena, pages: PageTable, slab_bytes: int) -> None:
        self.arena = arena
        self.pages = pages
        self.slab_bytes = slab_bytes
        self.slabs: dict[int, Slab] = {}
        self.bytes = 0
        self.on_slab_added: list[Callable[[int, int], None]] = []
        self.on_slab_removed: list[Callable[[int, int], None]] = []
        # class -> its slabs with free pages, the one given pages most recently last
        self._with_free: dict[Class, dict[int, None]] = {}
        self._nfree: dict[Class, int] = {}  # class -> its free pages
        self.of_class: dict[Class, set[int]] = {}  # class -> its slab ids
        self._held: dict[int, int] = {}  # tenant id -> bytes of its slabs' pages, free ones included
        self._booked: dict[int, int] = {}  # tenant id -> bookkeeping bytes of its slabs' pages
        self._spare_sids: list[int] = []
        self._next_sid = 0
        self.keep: Keep | None = None  # a kept cache's slab records (kvserver.store.keep)

    @property
    def nslabs(self) -> int:
        """One past the highest slab id in use (the length of per-slab arrays)."""
        return self._next_sid

    def per_slab(self, page_bytes: int) -> int:
        return max(1, min(MAX_SLAB_PAGES, self.slab_bytes // page_bytes))

    def free_count(self, cls: Class) -> int:
        return self._nfree.get(cls, 0)

    def pages_of(self, cls: Class) -> dict[int, np.ndarray]:
        """The class's slabs: id -> page ids."""
        return {s: self.slabs[s].pages for s in self.of_class.get(cls, ())}

    @staticmethod
    def cost(nbytes: int, booked: int, quota: int) -> int:
        """What slabs of ``nbytes`` whose pages book ``booked`` bytes cost a tenant of ``quota``:
        their bytes and their bookkeeping past the same free allowance the arena gives."""
        return nbytes + max(0, booked - quota // BOOK_ALLOWANCE)

    def held(self, tenant: int, quota: int = 0, more: tuple[int, int] = (0, 0)) -> int:
        """What the tenant's slabs cost it under ``quota`` (``cost``), with ``more`` (``shape``
        of one more slab) added."""
        return self.cost(self._held.get(tenant, 0) + more[0], self._booked.get(tenant, 0) + more[1], quota)

    def charge(self, tenant: int, booked: int) -> None:
        """Books (negative: gives back) bookkeeping of the tenant's beside its slabs' pages (its
        pins), which ``held`` counts as theirs."""
        self._booked[tenant] = self._booked.get(tenant, 0) + booked

    def fitting(self, page_bytes: int, quota: int) -> int:
        """Pages in one slab of the class for a tenant of ``quota`` (0: none): the pool's number,
        fewer if one slab would cost more than the quota, 0 if not even one page fits."""
        n = self.per_slab(page_bytes)
        while quota and n and self.slab_cost(n, page_bytes, quota) > quota:
            n //= 2
        return n

    @staticmethod
    def shape(n: int, page_bytes: int) -> tuple[int, int]:
        """What a slab of ``n`` pages of ``page_bytes`` holds for its tenant: (bytes of its pages,
        bytes booked for their bookkeeping). The slab's rounding up to the arena's alignment is
        not the tenant's: under 2 MiB a slab, at most as much as its pages."""
        return n * page_bytes, n * BYTES_PER_PAGE

    def slab_cost(self, n: int, page_bytes: int, quota: int) -> int:
        return self.cost(*self.shape(n, page_bytes), quota)

    def grow(self, cls: Class, n: int = 0) -> bool:
        """Reserves one more slab of the class, of ``n`` pages (the pool's number if 0); False if
        the arena has no room."""
        tenant, page_bytes = cls
        n = n or self.per_slab(page_bytes)
        nbytes = _align_up(n * page_bytes, REGION_ALIGN)
        try:
            # Its pages' bookkeeping is charged to the arena too: what the daemon holds for the
            # cache stays within the host memory it was given, however small the pages.
            offset = self.arena.reserve_high(nbytes, booked=n * BYTES_PER_PAGE)
        except NoCapacity:
            return False
        ids = self.pages.take(n)
        if ids is None:  # the page table is full (pages of the smallest size fill the budget)
            self.arena.release(offset, nbytes, booked=n * BYTES_PER_PAGE)
            return False
        sid = self._spare_sids.pop() if self._spare_sids else self._new_sid()
        self.pages.new_slab(sid)
        p = self.pages
        p.offset[ids] = offset + np.arange(n, dtype=np.int64) * page_bytes
        p.slab[ids] = sid
        p.nbytes[ids] = page_bytes
        p.part[ids] = -1
        p.tenant[ids] = -1
        p.stamp[ids] = 0
        p.pins[ids] = 0
        p.readers[ids] = 0
        p.state[ids] = FREE  # last: a kept page counts as the slab's only with its offset and slab
        self._install(Slab(sid, offset, nbytes, page_bytes, ids, tenant), ids)
        if self.keep is not None:
            self.keep.slab_added(sid, offset, nbytes, page_bytes, n)
        return True

    def _install(self, slab: Slab, free: np.ndarray) -> None:
        """Files a slab whose pages are set up, ``free`` of them among the free ones, and charges
        it to its tenant; the slab hooks learn of its memory."""
        self.slabs[slab.sid] = slab
        self._push(slab, free)
        self.of_class.setdefault(slab.cls, set()).add(slab.sid)
        n = len(slab.pages)
        self._held[slab.tenant] = self._held.get(slab.tenant, 0) + n * slab.page_bytes
        self._booked[slab.tenant] = self._booked.get(slab.tenant, 0) + n * BYTES_PER_PAGE
        self.bytes += slab.nbytes
        for hook in self.on_slab_added:
            hook(slab.offset, slab.nbytes)

    def adopt(self, sid: int, offset: int, nbytes: int, page_bytes: int, tenant: int, ids: np.ndarray,
              free: np.ndarray) -> None:
        """Takes back slab ``sid`` of a kept cache: its region, its pages ``ids`` (their records
        checked by the caller), of which ``free`` hold nothing."""
        n = len(ids)
        self.arena.reserve_at(offset, nbytes, booked=n * BYTES_PER_PAGE)
        self.pages.new_slab(sid)
        p = self.pages
        p.state[free] = FREE
        p.index.owner[free] = -1
        p.nbytes[ids] = page_bytes
        p.part[ids] = -1
        p.tenant[ids] = -1
        p.pins[ids] = 0
        p.readers[ids] = 0
        p.stamp[free] = 0
        self._install(Slab(sid, offset, nbytes, page_bytes, ids, tenant), free)

    def adopted(self) -> None:
        """Every kept slab is adopted: new slabs take the ids between and above theirs."""
        self._next_sid = max(self.slabs, default=-1) + 1
        self._spare_sids = sorted(set(range(self._next_sid)) - set(self.slabs), reverse=True)

    def _new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid - 1

    def take(self, cls: Class, n: int) -> np.ndarray:
        """``n`` free pages of the class (at most as many as it has), from the slabs given free
        pages most recently first."""
        with_free = self._with_free.get(cls)
        out: list[np.ndarray] = []
        while n and with_free:
            sid = next(reversed(with_free))
            free = self.slabs[sid].free_ids
            ids = free.pop(n)
            if not len(free):
                del with_free[sid]
            out.append(ids)
            n -= len(ids)
        if not out:
            return np.empty(0, np.int64)
        ids = np.concatenate(out) if len(out) > 1 else out[0]
        self._nfree[cls] -= len(ids)
        return ids

    def set_aside(self, slab: Slab) -> np.ndarray:
        """The slab is being evicted in steps: its free pages leave the free lists (returned), and
        none of its pages is handed out or evicted by anyone else until ``put_back`` or
        ``release``."""
        self.pages.slab_leaving[slab.sid] = True
        self._with_free.get(slab.cls, {}).pop(slab.sid, None)
        self._nfree[slab.cls] -= slab.free
        return slab.free_ids.pop(slab.free)

    def put_back(self, slab: Slab, ids: np.ndarray) -> None:
        """The slab stays after all: ``ids``, its pages cleared meanwhile, go to its free list
        (with any freed there meanwhile); released if that leaves it empty."""
        self.pages.slab_leaving[slab.sid] = False
        ids = np.concatenate([slab.free_ids.pop(slab.free), ids])
        self.give(ids)

    def _push(self, slab: Slab, ids: np.ndarray) -> None:
        slab.free_ids.push(ids)
        if self.pages.slab_leaving[slab.sid]:  # (counted once it is put back, if it is)
            return
        with_free = self._with_free.setdefault(slab.cls, {})
        with_free.pop(slab.sid, None)
        with_free[slab.sid] = None
        self._nfree[slab.cls] = self._nfree.get(slab.cls, 0) + len(ids)

    def give(self, ids: np.ndarray, release_empty: bool = True) -> list[int]:
        """Puts cleared pages back among the free ones; releases slabs left empty unless told not
        to. Returns the ids of the slabs the pages belong to."""
        if not len(ids):
            return []
        slab = self.pages.slab[ids]
        order = np.argsort(slab, kind="stable")
        uniq, starts = np.unique(slab[order], return_index=True)
        sids = uniq.tolist()
        for sid, chunk in zip(sids, np.split(ids[order], starts[1:]), strict=True):
            self._push(self.slabs[sid], chunk)
        if release_empty:
            self.release_empty(sids)
        return sids

    def release_empty(self, sids: Iterable[int]) -> None:
        """Releases those of the slabs whose pages all hold nothing."""
        empty = [s for s in set(sids) if s in self.slabs and self.slabs[s].free == len(self.slabs[s].pages)]
        if empty:
            self.release(empty)

    def release(self, sids: list[int], room: Room | None = None) -> None:
        """Gives slabs back to the arena; their pages must all be free (or cleared and in no free
        list). With ``room``, their ranges stay reserved, held there (their bookkeeping goes)."""
        slabs = [self.slabs.pop(s) for s in sids]
        ids = np.concatenate([s.pages for s in slabs])
        for slab in slabs:  # their free lists go with them: nothing else of the class is touched
            if self.keep is not None:
                self.keep.slab_removed(slab.sid)
            self._with_free[slab.cls].pop(slab.sid, None)
            if not self.pages.slab_leaving[slab.sid]:
                self._nfree[slab.cls] -= slab.free
            self.pages.slab_leaving[slab.sid] = False
        self.pages.give(ids)
        for slab in slabs:
            self.of_class[slab.cls].discard(slab.sid)
            self._held[slab.tenant] -= len(slab.pages) * slab.page_bytes
            self._booked[slab.tenant] -= len(slab.pages) * BYTES_PER_PAGE
            for hook in self.on_slab_removed:
                hook(slab.offset, slab.nbytes)
            booked = len(slab.pages) * BYTES_PER_PAGE
            if room is None:
                self.arena.release(slab.offset, slab.nbytes, booked=booked)
            else:
                self.arena.unbook(booked)
                room.hold_released(slab.offset, slab.nbytes)
            self.bytes -= slab.nbytes
            self._spare_sids.append(slab.sid)
        logger.debug("released %d cache slabs", len(slabs))
