"""Tenants and their quotas: the most cache memory one tenant may hold (the bytes of its slabs,
whole: free pages and pinned pages in them included).

Primitives: ``Tenant`` (id, counters, quota, spaces) and ``Tenants`` (get or create by name, with
the quota resolved from the per-tenant table or the default).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvserver.store.counters import CacheCounters


class Tenant:
    __slots__ = ("name", "tid", "counters", "quota", "spaces")

    def __init__(self, name: str, tid: int, quota: int) -> None:
        self.name = name
        self.tid = tid  # id kept in the page table
        self.counters = CacheCounters()
        self.quota = quota  # 0: none
        self.spaces = 0



class Tenants:
    def __init__(self, capacity: int, default_quota: int, quotas: Mapping[str, int]) -> None:
        self.capacity = capacity
        self.default_quota = default_quota
        self.quotas = dict(quotas)
        self.by_name: dict[str, Tenant] = {}

    def quota_of(self, name: str) -> int:
        """The tenant's quota in bytes; 0 (none) for 0 or a quota the whole arena fits under."""
        quota = self.quotas.get(name, self.default_quota)
        return 0 if quota <= 0 or quota >= self.capacity else quota

    def get(self, name: str) -> Tenant:
        tenant = self.by_name.get(name)
        if tenant is None:
            tenant = self.by_name[name] = Tenant(name, len(self.by_name), self.quota_of(name))
        return tenant
