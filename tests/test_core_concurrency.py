"""Stated outcomes when operations on the same pages overlap (see docs/reliability.md)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvclient import KVClient, KVLayout, ShmKVPool

LAYERS, TOKENS, PAGE = 32, 4096, 16
LAYOUT = KVLayout.mha(2, 64)  # 256 B per token and part: a 64 MiB transfer of all tokens


def big_pool() -> ShmKVPool:
    pool = ShmKVPool(LAYOUT, torch.float16, LAYERS, TOKENS)
    g = torch.Generator().manual_seed(0)
    for layer in pool.buffers:
        for buf in layer:
            buf.view(torch.int16).random_(generator=g)
    return pool


def snapshot(pool: ShmKVPool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).clone() for layer in pool.buffers for b in layer]


def restore(pool: ShmKVPool, snap: list[torch.Tensor]) -> None:
    for b, s in zip((b for layer in pool.buffers for b in layer), snap, strict=True):
        b.view(torch.uint8).copy_(s)


def same(pool: ShmKVPool, snap: list[torch.Tensor]) -> bool:
    return all(torch.equal(b.view(torch.uint8), s)
               for b, s in zip((b for layer in pool.buffers for b in layer), snap, strict=True))


def register(client: KVClient, pool: ShmKVPool, host_tokens: int = TOKENS) -> None:
    client.register(model="c", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                    host_tokens=host_tokens, page_size=PAGE)


@pytest.fixture
def slow_daemon(daemon_factory):
    # One progress message per layer, so a test can act while later layers are still copying.
    return daemon_factory(progress_interval=0.0)


def test_free_during_a_load_waits_for_it(slow_daemon):
    """Free of pages a load is reading returns once the load is done with them, so pages
    re-allocated and re-written right after cannot leak into the load."""
    with big_pool() as pool, KVClient(slow_daemon.address) as client:
        register(client, pool)  # the region holds exactly one transfer
        dev = torch.arange(TOKENS)
        host = client.alloc(TOKENS)
        client.write(host_indices=host, device_indices=dev)
        first = snapshot(pool)
        handle = client.load(host_indices=host, device_indices=dev)
        handle.wait_layer(0)
        assert client.free(host) == TOKENS
        reused = client.alloc(TOKENS)
        assert sorted(reused.tolist()) == sorted(host.tolist())  # the same pages again
        handle.wait()
        assert same(pool, first), "the load saw bytes written after the free"
        # Now overwrite the re-allocated pages with other data and check they hold it.
        for layer in pool.buffers:
            for buf in layer:
                buf.neg_()
        second = snapshot(pool)
        client.write(host_indices=reused, device_indices=dev)
        restore(pool, first)
        client.load(host_indices=reused, device_indices=dev).wait()
        assert same(pool, second)


def test_two_writes_to_the_same_pages_do_not_mix(slow_daemon):
    """Writes are applied whole, in arrival order: the pages end up holding one of them."""
    with big_pool() as pool, KVClient(slow_daemon.address) as a:
        register(a, pool)
        host = a.alloc(1024)
        dev_a, dev_b = torch.arange(0, 1024), torch.arange(1024, 2048)
        for _ in range(10):
            barrier = threading.Barrier(2)

            def write(dev, barrier=barrier):
                barrier.wait()
                a.write(host_indices=host, device_indices=dev)

            threads = [threading.Thread(target=write, args=(d,)) for d in (dev_a, dev_b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out = torch.arange(2048, 3072)
            a.load(host_indices=host, device_indices=out).wait()
            bufs = [buf.view(torch.uint8) for layer in pool.buffers for buf in layer]
            from_a = all(torch.equal(buf[out], buf[dev_a]) for buf in bufs)
            from_b = all(torch.equal(buf[out], buf[dev_b]) for buf in bufs)
            assert from_a != from_b, "the pages hold a mix of both writes (or neither)"


def test_shutdown_during_a_write_finishes_it_then_frees(daemon_factory):
    d = daemon_factory(progress_interval=0.0)
    with big_pool() as pool, KVClient(d.address, resilient=False) as client:
        register(client, pool)
        host = client.alloc(TOKENS)
        result = {}

        def write():
            result["bytes"] = client.write(host_indices=host, device_indices=torch.arange(TOKENS))

        t = threading.Thread(target=write)
        t.start()
        # Stop while the write is in flight (in the copy workers, or on the compiled data plane):
        # it gets the grace period to finish.
        def in_flight() -> int:
            plane = d.core.plane
            return d.core.copier.queued + (plane.engine.jobs if plane is not None else 0)

        while d.run(in_flight) == 0 and t.is_alive():
            pass

        async def stop_now() -> int:
            copies = in_flight()  # read on the loop, right as the shutdown begins
            await d.daemon.stop()
            return copies

        assert d.call(stop_now()) == 1, "the write was not in flight when the shutdown began"
        d.stop()
        t.join(30)
        assert result.get("bytes") == TOKENS * LAYERS * 2 * 256
        assert len(d.core.clients) == 0 and d.core.arena.reserved == 0
