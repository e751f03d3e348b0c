"""Deadlines: a copy reported as failed never lands later, and a slow call is not an outage.

A load or write that outlives its deadline is stopped by the daemon itself (dropped if queued,
ended at a layer boundary if running), and the daemon answers only once the job is dead; the
client reports the failure after that answer. Only an unreachable daemon, a lost session or an
unknown client make the client register again, and a new registration replaces the old one.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch

# The same 32-layer pool as the concurrency tests (256 B per token and part: 16 MiB for 1024
# tokens of 32 layers), and the same registration.
from checks import wait_until
from test_core_concurrency import LAYERS, LAYOUT, PAGE, TOKENS, register
from test_core_concurrency import big_pool as make_pool

from kvclient import AsyncKVClient, KVClient, KVClientError, KVLayout, ShmKVPool


def slots(pool: ShmKVPool, dev: torch.Tensor) -> list[torch.Tensor]:
    return [buf.view(torch.int16)[dev].clone() for layer in pool.buffers for buf in layer]


def scribble(pool: ShmKVPool, dev: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for buf in layer:
            buf.view(torch.int16)[dev] = torch.randint(-30000, 30000, buf.view(torch.int16)[dev].shape,
                                                       generator=g, dtype=torch.int16)


class BusyWorker:
    """Holds every copy worker of the daemon, as other engines' long copies would."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.gate = threading.Event()
        queue = daemon.core.copier._executor
        started = threading.Barrier(queue.threads + 1)

        def hold() -> None:
            started.wait(10)
            self.gate.wait(60)

        for _ in range(queue.threads):
            queue.submit_as(True, hold)  # as loads: they take every worker, and writes wait
        started.wait(10)
        self.plane = daemon.core.plane  # the compiled data plane's copies are held too
        if self.plane is not None:
            self.plane.engine.pause(True)

    def release(self) -> None:
        self.gate.set()
        if self.plane is not None:
            self.plane.engine.pause(False)
        self.daemon.core.copier._executor.submit(lambda: None).result(30)  # the queue has drained


def idle(daemon) -> bool:
    return daemon.run(lambda: all(c.inflight == 0 and (c.gate is None or c.gate.inflight == 0)
                                  for c in daemon.core.clients.values()))


def test_a_load_reported_missed_never_lands_later(daemon):
    with make_pool() as pool, KVClient(daemon.address, timeout=0.5) as client:
        register(client, pool)
        dev = torch.arange(1024)
        host = client.alloc(1024)
        assert client.write(host_indices=host, device_indices=dev) > 0
        busy = BusyWorker(daemon)
        try:
            t0 = time.monotonic()
            handle = client.load(host_indices=host, device_indices=dev)
            assert handle.wait() == 0 and handle.missed
            assert not handle.wait_layer(0)
            waited = time.monotonic() - t0
            scribble(pool, dev, seed=7)  # the engine recomputes into the same slots
            fresh = slots(pool, dev)
        finally:
            busy.release()
        wait_until(lambda: idle(daemon), 10, "the copier to be idle")
        assert all(torch.equal(a, b) for a, b in zip(slots(pool, dev), fresh, strict=True)), (
            "a load reported as missed overwrote the slots afterwards")
        assert handle.confirmed, "the daemon did not confirm the load was dropped"
        assert waited < 0.5 + 1.0, "not answered by the daemon's own deadline"
        assert client.connected and client.reconnects == 0


def test_a_write_past_its_deadline_keeps_the_registration_and_its_pages(daemon):
    with make_pool() as pool, KVClient(daemon.address, timeout=0.5) as client:
        register(client, pool)
        cid, capacity = client.client_id, client.registration.host_tokens
        dev = torch.arange(1024)
        host = client.alloc(1024)
        assert client.write(host_indices=host, device_indices=dev) > 0
        want = slots(pool, dev)
        other = client.alloc(1024)
        busy = BusyWorker(daemon)
        try:
            assert client.write(host_indices=other, device_indices=dev) == 0  # a miss: too slow
        finally:
            busy.release()
        assert client.connected and client.reconnects == 0 and client.client_id == cid
        core = daemon.core
        assert daemon.run(lambda: len(core.clients)) == 1
        assert client.stats().clients[0].capacity_tokens == capacity
        scribble(pool, dev, seed=3)
        assert client.load(host_indices=host, device_indices=dev).wait() > 0  # the pages are still there
        assert all(torch.equal(a, b) for a, b in zip(slots(pool, dev), want, strict=True))


def test_an_unanswered_load_is_reported_after_the_registration_is_replaced(daemon):
    """The daemon alive but unable to answer (its loop held): the client cannot learn that the
    job is dead, so it ends the registration and registers anew; the daemon holds one region.
    (On gRPC: a lane call is answered by the compiled data plane while the loop is held, below.)"""
    with make_pool() as pool, KVClient(daemon.address, timeout=0.5, lane="grpc") as client:
        register(client, pool)
        old = client.client_id
        region = daemon.run(lambda: daemon.core.arena.reserved)
        dev = torch.arange(1024)
        host = client.alloc(1024)
        assert client.write(host_indices=host, device_indices=dev) > 0
        daemon.loop.call_soon_threadsafe(time.sleep, 3.0)  # the daemon's loop stops answering
        handle = client.load(host_indices=host, device_indices=dev)
        assert handle.wait(timeout=30) == 0 and handle.missed
        assert not handle.confirmed
        wait_until(lambda: client.connected and client.client_id != old, 30, "the new registration")
        core = daemon.core
        assert daemon.run(lambda: (list(core.clients), core.arena.reserved)) == ([client.client_id], region)


def test_a_held_loop_does_not_hold_the_data_planes_answer(daemon):
    """The daemon's loop held: a lane Load is still served, and one past its deadline (the plane
    held too) is still answered, by the compiled data plane's own thread."""
    if daemon.core.plane is None:
        pytest.skip("the compiled data plane is not built")
    with make_pool() as pool, KVClient(daemon.address, timeout=0.5) as client:
        register(client, pool)
        old = client.client_id
        dev = torch.arange(1024)
        host = client.alloc(1024)
        assert client.write(host_indices=host, device_indices=dev) > 0
        want = slots(pool, dev)
        scribble(pool, dev, seed=5)
        daemon.loop.call_soon_threadsafe(time.sleep, 2.0)  # the daemon's loop stops answering
        assert client.load(host_indices=host, device_indices=dev).wait(timeout=1.5) > 0
        assert all(torch.equal(a, b) for a, b in zip(slots(pool, dev), want, strict=True))
        daemon.core.plane.engine.pause(True)
        try:
            handle = client.load(host_indices=host, device_indices=dev)
            assert handle.wait(timeout=30) == 0 and handle.missed
            assert handle.confirmed, "the plane did not answer the load it dropped at its deadline"
        finally:
            daemon.core.plane.engine.pause(False)
        assert client.connected and client.client_id == old


def test_unregister_stops_a_running_load_at_a_layer_boundary(daemon_factory):
    # 512 MiB in 32 layers: long enough that the Unregister arrives while the copy runs.
    d = daemon_factory(progress_interval=0.0, host_memory=600 << 20)
    big = 2 * TOKENS
    with ShmKVPool(KVLayout.mha(4, 128), torch.float16, LAYERS, big) as pool, \
            KVClient(d.address, timeout=60) as client:
        client.register(model="d", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                        host_tokens=big, page_size=PAGE)
        g = torch.Generator().manual_seed(1)
        for layer in pool.buffers:
            for buf in layer:
                buf.view(torch.int16).random_(generator=g)
        dev = torch.arange(big)
        host = client.alloc(big)
        client.write(host_indices=host, device_indices=dev)
        want = slots(pool, dev)
        for layer in pool.buffers:
            for buf in layer:
                buf.zero_()
        handle = client.load(host_indices=host, device_indices=dev)
        handle.wait_layer(0)
        client.unregister()  # returns once the copy is stopped and done with the pages
        handle.wait()
        assert d.run(lambda: (len(d.core.clients), d.core.arena.reserved)) == (0, 0)
        got = slots(pool, dev)
        landed = [layer for layer in range(LAYERS) if handle.landed(layer)]
        assert landed == list(range(len(landed))) and landed, "layers land in order"
        assert len(landed) < LAYERS, "the load ran to its end: it was not stopped"
        for layer in range(LAYERS):
            k, v = got[2 * layer], got[2 * layer + 1]
            if layer in landed:
                assert torch.equal(k, want[2 * layer]) and torch.equal(v, want[2 * layer + 1])
            else:  # a layer reported as not landed was not touched at all
                assert not k.any() and not v.any(), f"layer {layer} was written after the stop"


def test_not_resilient_raises_once_the_session_is_gone(daemon_factory):
    d = daemon_factory()
    with ShmKVPool(LAYOUT, torch.float16, 2, 64) as pool, KVClient(d.address, resilient=False) as client:
        client.register(model="d", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=64)
        d.stop()
        wait_until(lambda: not client.connected, 10, "the session to end")
        for call in (lambda: client.alloc(16), lambda: client.free([0]),
                     lambda: client.write(host_indices=[0], device_indices=[0]),
                     lambda: client.load(host_indices=[0], device_indices=[0])):
            with pytest.raises(KVClientError) as err:
                call()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_asyncio_a_load_reported_missed_never_lands_later(daemon):
    async def run() -> None:
        async with AsyncKVClient(daemon.address, timeout=0.5) as client:
            with make_pool() as pool:
                await client.register(model="d", pool=pool, start_layer=0, end_layer=LAYERS,
                                      num_layers=LAYERS, host_tokens=TOKENS, page_size=PAGE)
                dev = torch.arange(1024)
                host = await client.alloc(1024)
                assert await client.write(host_indices=host, device_indices=dev) > 0
                busy = BusyWorker(daemon)
                try:
                    handle = client.load(host_indices=host, device_indices=dev)
                    assert await handle.wait() == 0 and handle.missed
                    other = await client.alloc(1024)
                    assert await client.write(host_indices=other, device_indices=dev) == 0
                    scribble(pool, dev, seed=11)
                    fresh = slots(pool, dev)
                finally:
                    await asyncio.to_thread(busy.release)
                await asyncio.to_thread(wait_until, lambda: idle(daemon), 10, "the copier to be idle")
                assert all(torch.equal(a, b) for a, b in zip(slots(pool, dev), fresh, strict=True))
                assert handle.confirmed and client.connected and client.reconnects == 0

    asyncio.run(run())
