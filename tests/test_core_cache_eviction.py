"""Eviction seen through the daemon: least recently used pages go first, a prefix loses its end
first (never its middle), pinned pages stay until their lease is released, used by a Get or
expired, and a registration that does not fit evicts cached pages unless they are pinned."""

from __future__ import annotations

import time

import grpc
import numpy as np
from cache_engine import CacheEngine, prompt_keys, scattered
from checks import error_of
from daemon_proc import DaemonProcess

from kvclient._messages import register_request
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

PAGE_BYTES = 16 * 256 * 2 * 4  # 32 KiB: MHA 2 x 64 fp16, K and V, 4 layers, 16 tokens
QUOTA_PAGES = 32


def keys_of(rng: np.random.Generator, n: int) -> list[bytes]:
    return prompt_keys(rng.integers(0, 1 << 30, n * 16))


def space_counters(d: DaemonProcess):
    (space,) = d.stats().spaces
    return space.counters


def test_lru_prefix_end_first_and_pins(tmp_path) -> None:
    d = DaemonProcess(str(tmp_path / "kv.sock"), "--tenant-quota", f"{QUOTA_PAGES * PAGE_BYTES}",
                      host_memory="128MiB")
    try:
        with CacheEngine(d.address, pages=128) as eng:
            rng = np.random.default_rng(0)

            def put(keys: list[bytes]):
                pages = scattered(rng, len(keys), eng.num_pages)
                eng.fill(keys, pages)
                return eng.put(keys, pages)

            a, b, c = keys_of(rng, 16), keys_of(rng, 16), keys_of(rng, 8)
            assert put(a).stored == 16 and put(b).stored == 16
            (tenant,) = d.stats().tenants
            assert tenant.quota_bytes == QUOTA_PAGES * PAGE_BYTES
            assert tenant.counters.bytes == QUOTA_PAGES * PAGE_BYTES
            assert eng.lookup(a).pages == 16  # a is now more recent than b
            r = put(c)
            assert (r.stored, r.dropped) == (8, 0)
            # b lost its last 8 pages, not its first ones nor a's.
            assert eng.lookup(b).pages == 8
            assert eng.lookup(b[8:]).pages == 0 and eng.lookup(b[4:8]).pages == 4
            assert eng.lookup(a).pages == 16 and eng.lookup(c).pages == 8
            assert space_counters(d).evictions == 8
            assert d.stats().tenants[0].counters.bytes <= QUOTA_PAGES * PAGE_BYTES

            # A pin holds a's pages: a Put that needs their room stores only what else can go.
            lease = eng.lookup(a, pin_ms=10_000)
            assert lease.pages == 16 and lease.lease_id
            dd = keys_of(rng, 32)
            r = put(dd)
            assert (r.stored, r.dropped) == (16, 16), "only b's and c's 16 pages could be evicted"
            assert eng.lookup(a).pages == 16, "pinned pages were evicted"
            assert eng.lookup(dd).pages == 16
            assert eng.client.release(lease.lease_id) == 1
            assert eng.client.release(lease.lease_id) == 0, "a lease ends once"
            r = put(dd)  # its first half is stored: the rest evicts a, now unpinned and least recent
            assert (r.stored, r.present, r.dropped) == (16, 16, 0)
            assert eng.lookup(a).pages == 0 and eng.lookup(dd).pages == 32

            # A pin that is not released expires (the daemon ends leases past their time every second).
            short = eng.lookup(dd, pin_ms=500)
            e = keys_of(rng, 32)
            r = put(e)
            assert (r.stored, r.dropped) == (0, 32), "every page is pinned"
            time.sleep(1.8)
            r = put(e)
            assert (r.stored, r.dropped) == (32, 0), "the pin should have expired"
            assert eng.lookup(dd).pages == 0
            assert eng.client.release(short.lease_id) == 0

            # A Get naming a lease ends it once its pages are read.
            pinned = eng.lookup(e, pin_ms=60_000)
            eng.wipe()
            pages = scattered(rng, 32, eng.num_pages)
            assert eng.get(e, pages, lease_id=pinned.lease_id) == 32
            assert eng.wrong(e, pages) == []
            assert eng.client.release(pinned.lease_id) == 0, "the Get ended the lease"
            c = space_counters(d)
            assert c.dropped == 16 + 32 and c.evictions == 8 + 16 + 16 + 32
    finally:
        d.stop()


def test_room_eviction_and_registrations_take_back_cache_memory(tmp_path) -> None:
    # 16 MiB: the engine's 2 MiB region and one 8 MiB slab of 256 pages; no room for a second slab.
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="16MiB")
    try:
        with CacheEngine(d.address, pages=320) as eng:
            rng = np.random.default_rng(1)
            a, b = keys_of(rng, 256), keys_of(rng, 64)
            pa = scattered(rng, 256, eng.num_pages)
            eng.fill(a, pa)
            assert eng.put(a, pa).stored == 256
            assert d.stats().cache_bytes == 8 << 20
            pb_ = scattered(rng, 64, eng.num_pages)
            eng.fill(b, pb_)
            r = eng.put(b, pb_)
            assert (r.stored, r.dropped) == (64, 0)
            assert eng.lookup(a).pages == 192, "a's last 64 pages make room for b"
            assert eng.lookup(b).pages == 64
            stats = d.stats()
            assert stats.cache_bytes == 8 << 20 and stats.spaces[0].counters.evictions == 64

            # A registration refused for its pool (here: no peer ticket for its descriptors) evicts
            # nothing, though it asks for more than is free: the cache gives way only once a pool
            # has opened and passed its checks.
            req = register_request(model="refused", pool=eng.pool, start_layer=0, end_layer=4, num_layers=4,
                                   host_tokens=4096, page_size=16, tp_rank=0, tp_size=1, pp_rank=0,
                                   pp_size=1)
            with grpc.insecure_channel(d.address) as channel:
                code, message = error_of(lambda: pb_grpc.KVServerStub(channel).Register(req))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "peer ticket" in message, message
            assert eng.lookup(a).pages == 192 and eng.lookup(b).pages == 64, "a refused Register evicted"
            assert d.stats().cache_bytes == 8 << 20

            # A registration needing 8 MiB finds 6 MiB free: the slab goes, unless a page in it is pinned.
            lease = eng.lookup(b, pin_ms=30_000)
            code, message = error_of(lambda: CacheEngine(d.address, pages=16, host_tokens=4096))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
            assert eng.lookup(b).pages == 64 and eng.lookup(a).pages == 192, "the refusal changed the cache"
            assert eng.client.release(lease.lease_id) == 1
            with CacheEngine(d.address, pages=16, host_tokens=4096) as big:
                assert big.client.registration.host_tokens == 4096
                assert eng.lookup(a).pages == 0 and eng.lookup(b).pages == 0
                stats = d.stats()
                assert stats.cache_bytes == 0
                assert stats.spaces[0].counters.evictions == 64 + 192 + 64
            # The region is free again: the cache can grow back into it.
            eng.fill(b, pb_)
            assert eng.put(b, pb_).stored == 64
            assert eng.lookup(b).pages == 64
    finally:
        d.stop()


def test_longest_pin_is_accepted(tmp_path) -> None:
    pin_ms = 60_000
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="64MiB")
    try:
        with CacheEngine(d.address) as eng:
            keys = keys_of(np.random.default_rng(2), 4)
            pages = np.arange(4)
            eng.fill(keys, pages)
            eng.put(keys, pages)
            r = eng.lookup(keys, pin_ms=pin_ms)
            assert r.pages == 4 and r.lease_id
            assert eng.client.release([r.lease_id]) == 1
            assert eng.lookup(keys, pin_ms=pin_ms).lease_id != r.lease_id
    finally:
        d.stop()
