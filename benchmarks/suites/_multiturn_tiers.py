"""The host tiers of the multi-turn benchmark, each moving real bytes between a device pool and
host memory, timed:

- ``InProcessHost``: a host tensor in the engine's own process, copied with kvserver.copies.transfer's
  kernel (``copy_job``, the call the daemon makes);
- ``IndexHost``: the daemon's index API (Alloc, Write, Load, Free), the engine keeping the index
  of which host pages hold which client's prefix.

``serve_single`` runs the trace through one engine with one of them (or none: recompute only).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from _multiturn_kv import DevicePool, Geometry
from _multiturn_sim import PrefixLRU, Record, Request, Workload

from kvclient import KVClient
from kvserver.copies import transfer


class InProcessHost:
    def __init__(self, dev: DevicePool, pages: int) -> None:
        g = dev.geom
        self.dev = dev
        self.host = torch.zeros((pages, g.layers, 2, g.chunk), dtype=torch.uint8)
        self.host_table = transfer.BufferTable.of([[self.host[:, la, q].numpy() for q in range(2)]
                                                   for la in range(g.layers)])
        self.dev_table = transfer.BufferTable.of([[b.numpy() for b in layer] for layer in dev.raw])
        self.layers = np.arange(g.layers)
        self.lru = PrefixLRU(pages)

    def _copy(self, host_slots: list[int], dev_slots: list[int], to_device: bool) -> None:
        plan = transfer.make_plan(np.asarray(host_slots, dtype=np.int64), self.dev.tokens(dev_slots),
                                  self.dev.geom.page, self.dev.pages)
        done = transfer.copy_job(plan, self.layers, self.host_table, self.dev_table, to_device)
        assert done == len(self.layers), "the copy kernel is not compiled"

    def load(self, client: int, first: int, last: int, dev_slots: list[int]) -> None:
        self._copy(self.lru.of(client)[first:last], dev_slots, True)

    def write(self, client: int, dev_slots: list[int]) -> None:
        """Appends ``dev_slots`` (the client's next pages) to its host prefix."""
        self.lru.make_room(len(dev_slots), keep=client)
        self._copy(self.lru.extend(client, len(dev_slots)), dev_slots, False)

    def close(self) -> None:
        pass


class IndexHost:
    """Host pages from the daemon's Alloc; ``lru`` slots are the engine's names for them."""

    def __init__(self, dev: DevicePool, pages: int, address: str) -> None:
        g = dev.geom
        self.dev = dev
        self.client = KVClient(address, timeout=60, resilient=False)
        self.client.register(model="multiturn-index", pool=dev.pool, start_layer=0, end_layer=g.layers,
                             num_layers=g.layers, host_tokens=pages * g.page, page_size=g.page)
        self.lru = PrefixLRU(pages)
        self.where: dict[int, int] = {}  # slot -> first host token of its page

    def _host(self, slots: list[int]) -> np.ndarray:
        first = np.asarray([self.where[s] for s in slots], dtype=np.int64)
        return (first[:, None] + np.arange(self.dev.geom.page, dtype=np.int64)).reshape(-1)

    def load(self, client: int, first: int, last: int, dev_slots: list[int]) -> None:
        slots = self.lru.of(client)[first:last]
        self.client.load(host_indices=self._host(slots), device_indices=self.dev.tokens(dev_slots)).wait(60)

    def write(self, client: int, dev_slots: list[int]) -> None:
        evicted = self.lru.make_room(len(dev_slots), keep=client)
        if evicted:
            gone = [s for _, _, s in evicted]
            self.client.free(self._host(gone))
            for s in gone:
                del self.where[s]
        slots = self.lru.extend(client, len(dev_slots))
        host = self.client.alloc(len(slots) * self.dev.geom.page)
        if host is None:
            raise RuntimeError("the daemon could not allocate host pages the registration holds")
        for s, tok in zip(slots, host.view(-1, self.dev.geom.page)[:, 0].tolist(), strict=True):
            self.where[s] = tok
        self.client.write(host_indices=host, device_indices=self.dev.tokens(dev_slots))

    def clear(self) -> None:
        """Frees every host page the index holds."""
        if self.where:
            self.client.free(self._host(list(self.where)))
        self.where.clear()
        self.lru = PrefixLRU(self.lru.capacity)

    def close(self) -> None:
        try:
            self.client.unregister()
        finally:
            self.client.close()


def serve_single(w: Workload, reqs: list[Request], dev: DevicePool, host, bar) -> list[Record]:
    """One engine, trace order. ``host`` is None (recompute only) or a host tier; the tier gets
    every new page after its prefill (write-through), so evicting a device page copies nothing."""
    lru = PrefixLRU(dev.pages)
    out = []
    pb = w.page
    for req in reqs:
        c, prompt, total = req.client, w.prompt_pages(req.round), w.total_pages(req.round)
        d = lru.count(c)
        h = host.lru.count(c) if host is not None else 0
        lru.make_room(total - d, keep=c)
        slots = lru.extend(c, total - d)
        rec = Record(prompt_tokens=prompt * pb, device_hit=d * pb, host_hit=0, computed=0)
        hit = d
        if h > d:
            t0 = time.perf_counter()
            host.load(c, d, h, slots[: h - d])
            rec.load_s = time.perf_counter() - t0
            dev.verify(c, d, slots[: h - d])
            rec.loaded_bytes = (h - d) * dev.geom.page_bytes
            hit = h
        rec.host_hit = (hit - d) * pb
        rec.computed = (prompt - hit) * pb
        if host is not None:
            dev.fill(c, hit, slots[hit - d:])  # the prefill's and the answer's KV (untimed: modelled)
            start = host.lru.count(c)  # the host holds pages [0, start) already
            new = lru.of(c)[start:total]
            t0 = time.perf_counter()
            host.write(c, new)
            rec.write_s = time.perf_counter() - t0
            rec.written_bytes = len(new) * dev.geom.page_bytes
        out.append(rec)
        bar.update(1)
    return out


def geometry_note(geom: Geometry) -> dict:
    return {"layers": geom.layers, "kv_heads": geom.kv_heads, "head_dim": geom.head_dim,
            "dtype": str(geom.dtype).replace("torch.", ""), "page_tokens": geom.page,
            "page_bytes": geom.page_bytes, "token_bytes": geom.page_bytes // geom.page}
