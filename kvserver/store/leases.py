"""Leases: pins on pages for a while, ended explicitly, by a Get naming them, or by expiry.

Primitives: ``Lease`` and ``LeaseTable`` (``add``, ``end``, ``release``, ``expire``, ``holds``).
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvserver.errors import NoCapacity
from kvserver.store.pages import PageTable


@dataclass(slots=True)
class Lease:
    tenant: str
    expires: float
    pages: np.ndarray  # page ids pinned (may repeat)


class LeaseTable:
    def __init__(self, pages: PageTable, max_per_tenant: int, clock: Callable[[], float]) -> None:
        self.pages = pages
        self.max_per_tenant = max_per_tenant
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self._per_tenant: dict[str, int] = {}
        self._heap: list[tuple[float, str]] = []

    def check(self, tenant: str) -> None:
        """Raises NoCapacity if the tenant cannot take one more lease (after ending expired ones)."""
        if self._per_tenant.get(tenant, 0) >= self.max_per_tenant:
            self.expire()
            if self._per_tenant.get(tenant, 0) >= self.max_per_tenant:
                raise NoCapacity(
                    f"tenant {tenant!r} holds {self.max_per_tenant} leases, the most allowed: "
                    "release some (Release, or a Get naming them) or let them expire"
                )

    def add(self, tenant: str, ids: np.ndarray, pin_ms: int) -> str:
        """Pins the pages until ``pin_ms`` from now; returns the new lease id."""
        self.check(tenant)
        lease_id = secrets.token_hex(16)
        expires = self.clock() + pin_ms / 1000
        np.add.at(self.pages.pins, ids, 1)
        self.leases[lease_id] = Lease(tenant, expires, ids)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        heapq.heappush(self._heap, (expires, lease_id))
        return lease_id

    def holds(self, lease_id: str, tenant: str) -> bool:
        lease = self.leases.get(lease_id)
        return lease is not None and lease.tenant == tenant

    def end(self, lease_id: str, tenant: str) -> bool:
        """Ends a lease of the tenant; False if it holds no such lease."""
        if not self.holds(lease_id, tenant):
            return False
        lease = self.leases.pop(lease_id)
        np.subtract.at(self.pages.pins, lease.pages, 1)
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]
        return True

    def release(self, tenant: str, lease_ids: Sequence[str]) -> int:
        return sum(self.end(lease_id, tenant) for lease_id in set(lease_ids))

    def expire(self) -> int:
        """Ends the leases whose time has passed; returns how many."""
        now = self.clock()
        ended = 0
        while self._heap and self._heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._heap)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires <= now:
                ended += self.end(lease_id, lease.tenant)
        return ended
