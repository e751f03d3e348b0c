"""The cache calls of both clients and both views against the real daemon: put, lookup, a view's
pinned lookup and release, get layer by layer, and a get of keys nobody stored."""

from __future__ import annotations

import asyncio

import torch

from kvclient import AsyncCacheView, AsyncKVClient, CacheView, KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys
from tests.test_e2e_roundtrip import fill_random, raw, snapshot

LAYOUT, DTYPE, PAGE, LAYERS = KVLayout.mha(2, 8), torch.float16, 16, 4


def register(client, pool):
    return client.register(model="calls", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=0, page_size=PAGE)


def test_sync_client_and_view(daemon):
    keys = page_keys(range(1000, 1000 + 5 * PAGE + 3), PAGE)  # 5 whole pages; the rest has no key
    assert len(keys) == 5 * 16
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 256) as pa, ShmKVPool(LAYOUT, DTYPE, LAYERS, 256) as pb_, \
            KVClient(daemon.address) as a, KVClient(daemon.address) as b:
        register(a, pa)
        register(b, pb_)
        fill_random(pa, 3)
        orig = snapshot(pa)
        assert (a.put(keys, [0, 1, 2, 3, 4]).stored, a.put(keys, [0, 1, 2, 3, 4]).present) == (5, 5)
        assert b.lookup(keys).pages == 5
        with CacheView(daemon.address, model="calls", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                       num_layers=LAYERS) as view:
            found = view.lookup(keys, pin_ms=2000)
            assert found.pages == 5 and found.lease_id
            assert view.release(found.lease_id) == 1 and view.release(found.lease_id) == 0
        handle = b.get(keys, [10, 11, 12, 13, 14])
        assert handle.pages() == 5
        assert all(handle.wait_layer(layer) for layer in range(LAYERS))
        handle.wait()
        for layer in range(LAYERS):
            for part, buf in enumerate(pb_.buffers[layer]):
                assert torch.equal(raw(buf)[10 * PAGE:15 * PAGE], orig[layer][part][:5 * PAGE])
        assert b.get(page_keys([1, 2, 3] * PAGE, PAGE), [6, 7, 8]).pages() == 0


def test_a_get_of_several_parts_loads_each_parts_own_prefix_in_one_call(daemon):
    k = 16  # page_keys' key bytes: it packs them
    keys = page_keys(range(2000, 2000 + 8 * PAGE), PAGE)  # 8 pages
    other = page_keys(range(9000, 9000 + 2 * PAGE), PAGE)  # never stored
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 256) as pa, ShmKVPool(LAYOUT, DTYPE, LAYERS, 256) as pb_, \
            KVClient(daemon.address) as a, KVClient(daemon.address) as b:
        register(a, pa)
        register(b, pb_)
        fill_random(pa, 5)
        fill_random(pb_, 6)
        orig, before = snapshot(pa), snapshot(pb_)
        assert a.put(keys, list(range(8))).stored == 8
        with CacheView(daemon.address, model="calls", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                       num_layers=LAYERS) as view:
            lease = view.lookup(keys[:3 * k], pin_ms=5000).lease_id
            # Part 0: pages 0-2 (pinned); part 1: pages 5-6, then a key never stored, then page 7;
            # part 2: nothing stored.
            handle = b.get_parts([(keys[:3 * k], [8, 9, 10], lease),
                                  (keys[5 * k:7 * k] + other[:k] + keys[7 * k:], [11, 12, 13, 14], ""),
                                  (other[k:], [15], "")])
            assert handle.part_pages() == [3, 2, 0] and handle.pages() == 5
            handle.wait()
            assert view.release(lease) == 0  # the Get ended its part's lease
        for layer in range(LAYERS):
            for part, buf in enumerate(pb_.buffers[layer]):
                got, want, old = raw(buf), orig[layer][part], before[layer][part]
                assert torch.equal(got[8 * PAGE:11 * PAGE], want[:3 * PAGE])
                assert torch.equal(got[11 * PAGE:13 * PAGE], want[5 * PAGE:7 * PAGE])
                assert torch.equal(got[13 * PAGE:16 * PAGE], old[13 * PAGE:16 * PAGE])  # past a prefix
        nothing = b.get_parts([(other[:k], [0], ""), (b"", [], "")])
        assert nothing.part_pages() == [0, 0] and nothing.pages() == 0


def test_a_get_of_many_parts_gives_the_event_loop_a_turn_between_parts(daemon, monkeypatch):
    """Parts of a Get are prepared as one cache operation's steps: the loop gets a turn between
    two parts (LoopShare.between_steps) as between two steps of one part."""
    share = daemon.core.share
    turns: list[float] = []
    between = share.between_steps

    async def counted(elapsed: float) -> None:
        turns.append(elapsed)
        await between(elapsed)

    monkeypatch.setattr(share, "between_steps", counted)
    keys = page_keys(range(3000, 3000 + 8 * PAGE), PAGE)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 256) as pool, KVClient(daemon.address) as c:
        register(c, pool)
        handle = c.get_parts([(keys[i * 16:(i + 1) * 16], [i], "") for i in range(8)])
        assert handle.part_pages() == [0] * 8
        handle.wait()
    assert len(turns) >= 7


def test_asyncio_client_and_view(daemon):
    keys = page_keys(range(2 * PAGE), PAGE)

    async def run():
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, 64) as pa, ShmKVPool(LAYOUT, DTYPE, LAYERS, 64) as pb_:
            async with AsyncKVClient(daemon.address) as a, AsyncKVClient(daemon.address) as b:
                await a.register(model="calls", pool=pa, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                                 host_tokens=0, page_size=PAGE)
                await b.register(model="calls", pool=pb_, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                                 host_tokens=0, page_size=PAGE)
                fill_random(pa, 4)
                orig = snapshot(pa)
                assert (await a.put(keys, [2, 3])).stored == 2
                async with AsyncCacheView(daemon.address, model="calls", layout=LAYOUT, dtype=DTYPE,
                                          page_size=PAGE, num_layers=LAYERS) as view:
                    assert (await view.lookup(keys)).pages == 2
                handle = b.get(keys, [0, 1])
                assert await handle.pages() == 2
                await handle.wait()
                parts = b.get_parts([(keys[:16], [0], ""), (keys[16:], [1], "")])
                assert await parts.part_pages() == [1, 1]
                await parts.wait()
                for layer in range(LAYERS):
                    for part, buf in enumerate(pb_.buffers[layer]):
                        assert torch.equal(raw(buf)[: 2 * PAGE], orig[layer][part][2 * PAGE:4 * PAGE])

    asyncio.run(run())


def test_a_get_says_its_pages_before_its_copy_runs(daemon):
    """The prefix is known once the cache has looked: pages() answers while the copy still waits for
    the worker (here held by a stand-in for another engine's long copy)."""
    import threading
    import time

    keys = page_keys(range(160 * PAGE), PAGE)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 4096) as pool, KVClient(daemon.address) as client:
        register(client, pool)
        assert client.put(keys, list(range(160))).stored == 160
        release = threading.Event()
        queue = daemon.core.copier._executor
        for _ in range(queue.threads):  # every worker is busy elsewhere (loads take them all)
            queue.submit_as(True, release.wait, 10)
        plane = daemon.core.plane  # and the data plane's thread, which copies the cache's jobs too
        if plane is not None:
            plane.engine.pause(True)
        try:
            handle = client.get(keys, list(range(96, 256)))  # 160 pages, too large to run inline
            t = time.monotonic()
            assert handle.pages(timeout=5) == 160
            assert time.monotonic() - t < 1.0
            assert not handle.landed(0)
        finally:
            release.set()
            if plane is not None:
                plane.engine.pause(False)
        assert handle.wait() > 0
