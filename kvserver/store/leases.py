"""Leases: pins on pages for a while, ended explicitly, part by part by the Gets naming them, or
by expiry.

A lease of a whole space pins the pages of every part (every TP rank and PP stage), and each rank
reads only its own part: a Get naming the lease unpins its own part's pages, and the lease ends
once no part is left, so the ranks that have not read yet keep their pins.

Primitives: ``Lease`` and ``LeaseTable`` (``add``, ``extend``, ``start``, ``end``, ``end_part``,
``end_owned``, ``release``, ``expire``, ``holds``; the last three also in steps, ``*_steps``).
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvserver.errors import NoCapacity
from kvserver.store.pages import PageTable
from kvserver.store.steps import run_steps

# Page pins one tenant's leases may hold together.
MAX_PINNED_PER_TENANT = 1 << 24
# Pins ended in one step at most, where many leases end at once (a Release, a registration's
# release, the expiry sweep): 16 Mi pins ended in one go held the event loop 40-90 ms.
END_STEP_PINS = 1 << 20
# A lease counts as at least END_STEP_PINS >> LEASE_STEP_SHIFT pins in a step, so that at most 512
# leases end in one (leases of one pin: 4096 took 15 ms in one step).
LEASE_STEP_SHIFT = 9
PIN_BYTES = 12  # a pin's bookkeeping: its page id and part in the lease's arrays, charged to the arena
# and to its tenant's quota


@dataclass(slots=True)
class Lease:
    tenant: str
    expires: float
    pages: np.ndarray  # page ids pinned, each once
    parts: np.ndarray  # the part gid of each of those pages
    owner: str = ""  # the registration that took it (its release ends it); "": a space's


class LeaseTable:
    def __init__(self, pages: PageTable, max_per_tenant: int, clock: Callable[[], float],
                 max_pinned_per_tenant: int = MAX_PINNED_PER_TENANT,
                 book: Callable[[str, int, np.ndarray], bool] | None = None,
                 unbook: Callable[[str, int], None] | None = None) -> None:
        self.pages = pages
        # Books a tenant's pins' bookkeeping bytes (evicting, but none of the given pages' slabs,
        # to make room), False if there is none; and gives them back (KVCache._book_pins).
        self.book = book
        self.unbook = unbook
        self.max_per_tenant = max_per_tenant
        self.max_pinned_per_tenant = max_pinned_per_tenant
        self._pinned: dict[str, int] = {}  # page pins the tenant's leases hold
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self._per_tenant: dict[str, int] = {}
        self._by_owner: dict[str, set[str]] = {}  # registration -> the leases it took
        self._heap: list[tuple[float, str]] = []

    def at_limit(self, tenant: str) -> bool:
        return self._per_tenant.get(tenant, 0) >= self.max_per_tenant

    def make_way_steps(self, tenant: str) -> Generator[None, None, None]:
        """Where ``tenant`` holds the most leases, ends every expired one first, in steps
        (``expire_steps``): in one go, 4096 leases of 4 Ki pins held the event loop 57-68 ms."""
        if self.at_limit(tenant):
            yield from self.expire_steps()

    def any_expired(self) -> bool:
        """Whether a lease may have expired and not yet ended (an entry due in the heap)."""
        return bool(self._heap) and self._heap[0][0] <= self.clock()

    def check(self, tenant: str) -> None:
        """Raises NoCapacity if the tenant cannot take one more lease, after ending expired ones,
        at most one step of them here (``make_way_steps``, which the daemon's callers run in
        steps first: leases that expired meanwhile would otherwise all end in this one)."""
        if self.at_limit(tenant):
            steps = self.make_way_steps(tenant)
            next(steps, None)  # one step at most
            steps.close()
        if self.at_limit(tenant):
            raise NoCapacity(
                f"tenant {tenant!r} holds {self.max_per_tenant} leases, the most allowed: "
                "release some (Release, or a Get naming them) or let them expire"
            )

    def add(self, tenant: str, ids: np.ndarray, pin_ms: int | None, distinct: bool = False,
            owner: str = "") -> str:
        """Pins the pages (each once, however often the request named it) until ``pin_ms`` from
        now; returns the new lease id. ``pin_ms`` None: the lease does not expire until ``start``
        gives it its time (a lookup still pinning in steps). ``distinct``: the caller knows no id
        repeats (deduplicating a million ids costs most of a second). ``owner``: the registration
        asking, whose release ends it (``end_owned``)."""
        self.check(tenant)
        ids = self._pin(tenant, ids, distinct)
        lease_id = secrets.token_hex(16)
        self.leases[lease_id] = Lease(tenant, float("inf"), ids, self.pages.part[ids], owner)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        if owner:
            self._by_owner.setdefault(owner, set()).add(lease_id)
        if pin_ms is not None:
            self.start(lease_id, pin_ms)
        return lease_id

    def start(self, lease_id: str, pin_ms: int) -> None:
        """The lease expires ``pin_ms`` from now."""
        expires = self.clock() + pin_ms / 1000
        self.leases[lease_id].expires = expires
        heapq.heappush(self._heap, (expires, lease_id))
        if len(self._heap) > 2 * len(self.leases) + 1024:  # mostly leases ended before their time
            self._heap = [(lease.expires, i) for i, lease in self.leases.items()
                          if lease.expires != float("inf")]
            heapq.heapify(self._heap)

    def extend(self, lease_id: str, tenant: str, ids: np.ndarray, distinct: bool = False) -> None:
        """Pins more pages under a lease of the tenant (a lookup's later step), on the same terms
        as ``add``."""
        lease = self.leases[lease_id]
        ids = self._pin(tenant, ids, distinct)
        lease.pages = np.concatenate([lease.pages, ids])
        lease.parts = np.concatenate([lease.parts, self.pages.part[ids]])

    def _pin(self, tenant: str, ids: np.ndarray, distinct: bool) -> np.ndarray:
        if not distinct:
            ids = np.unique(ids)
        held = self._pinned.get(tenant, 0)
        if held + ids.size > self.max_pinned_per_tenant:
            raise NoCapacity(
                f"tenant {tenant!r} pins {held} pages under its leases; {ids.size} more would pass the "
                f"most allowed ({self.max_pinned_per_tenant}): release leases or pin fewer pages"
            )
        if self.book is not None and not self.book(tenant, ids.size * PIN_BYTES, ids):
            raise NoCapacity(
                f"no room in host memory or in tenant {tenant!r}'s quota for the bookkeeping of "
                f"{ids.size} more pins: release leases or pin fewer pages"
            )
        self.pages.pin(ids)
        self._pinned[tenant] = held + ids.size
        return ids

    def holds(self, lease_id: str, tenant: str) -> bool:
        lease = self.leases.get(lease_id)
        return lease is not None and lease.tenant == tenant

    def end(self, lease_id: str, tenant: str) -> bool:
        """Ends a lease of the tenant; False if it holds no such lease."""
        if not self.holds(lease_id, tenant):
            return False
        lease = self.leases.pop(lease_id)
        self._unpin(tenant, lease.pages)
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]
        if lease.owner:
            owned = self._by_owner[lease.owner]
            owned.discard(lease_id)
            if not owned:
                del self._by_owner[lease.owner]
        return True

    def end_owned(self, owner: str) -> int:
        """Ends the leases registration ``owner`` took (it is released: no Get of its will read
        them); returns how many."""
        return run_steps(self.end_owned_steps(owner))

    def end_owned_steps(self, owner: str) -> Generator[None, None, int]:
        """``end_owned`` in steps of at most ``END_STEP_PINS`` pins (but a lease of more)."""
        return (yield from self._ending((lease_id, "") for lease_id in list(self._by_owner.get(owner, ()))))

    def _ending(self, leases: Iterable[tuple[str, str]]) -> Generator[None, None, int]:
        """Ends the (lease id, tenant: "" for any) ``leases`` that still stand, yielding between
        two once ``END_STEP_PINS`` pins were ended since the last yield; returns how many ended."""
        ended = pins = 0
        for lease_id, tenant in leases:
            lease = self.leases.get(lease_id)
            if lease is None or (tenant and lease.tenant != tenant):
                continue
            cost = _step_cost(lease)
            if pins and pins + cost > END_STEP_PINS:
                yield
                pins = 0
                if self.leases.get(lease_id) is not lease:
                    continue  # (ended meanwhile)
            pins += cost
            ended += self.end(lease_id, lease.tenant)
        return ended

    def end_part(self, lease_id: str, tenant: str, part_gid: int) -> None:
        """Unpins the lease's pages of one part (a rank's Get has read them); the lease ends once
        it pins nothing more."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.tenant != tenant:
            return
        mine = lease.parts == part_gid
        if mine.all():
            self.end(lease_id, tenant)
            return
        self._unpin(tenant, lease.pages[mine])
        lease.pages, lease.parts = lease.pages[~mine], lease.parts[~mine]

    def _unpin(self, tenant: str, ids: np.ndarray) -> None:
        self.pages.pin(ids, -1)
        if self.unbook is not None:
            self.unbook(tenant, ids.size * PIN_BYTES)
        left = self._pinned.get(tenant, 0) - ids.size
        if left > 0:
            self._pinned[tenant] = left
        else:
            self._pinned.pop(tenant, None)

    def release(self, tenant: str, lease_ids: Sequence[str]) -> int:
        return run_steps(self.release_steps(tenant, lease_ids))

    def release_steps(self, tenant: str, lease_ids: Sequence[str]) -> Generator[None, None, int]:
        """``release`` in steps of at most ``END_STEP_PINS`` pins (but a lease of more)."""
        return (yield from self._ending((lease_id, tenant) for lease_id in dict.fromkeys(lease_ids)))

    def expire(self) -> int:
        """Ends the leases whose time has passed; returns how many."""
        return run_steps(self.expire_steps())

    def expire_steps(self) -> Generator[None, None, int]:
        """``expire`` in steps of at most ``END_STEP_PINS`` pins (but a lease of more)."""
        now = self.clock()
        ended = pins = 0
        while self._heap and self._heap[0][0] <= now:
            lease_id = self._heap[0][1]
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires <= now:
                cost = _step_cost(lease)
                if pins and pins + cost > END_STEP_PINS:
                    yield  # (before it leaves the heap: a sweep given up here leaves it to the next)
                    pins = 0
                    continue
                pins += cost
                ended += self.end(lease_id, lease.tenant)
            heapq.heappop(self._heap)  # (ended, or an entry of a lease ended or started again)
        return ended


def _step_cost(lease: Lease) -> int:
    """What ending ``lease`` counts for in a step of at most ``END_STEP_PINS``: its pins, and at
    least a 512th of the step (read when called: tests set the step smaller)."""
    return max(lease.pages.size, END_STEP_PINS >> LEASE_STEP_SHIFT)
