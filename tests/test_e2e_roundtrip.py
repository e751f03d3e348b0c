"""Write -> wipe -> load is bit-exact through the real daemon, for every layout, dtype and page size."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvclient import AsyncKVClient, KVClient, KVLayout, ShmKVPool
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

NUM_LAYERS = 8  # model layers
START, END = 2, 6  # this client's global layer range
POOL_TOKENS = 512
LAYOUTS = {"mha": KVLayout.mha(2, 8), "mla": KVLayout.mla(16, 8)}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def fill_random(pool: ShmKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for buf in layer:
            # Random bytes, NaN patterns included: comparisons are on raw bytes.
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=g))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def snapshot(pool: ShmKVPool) -> list[list[torch.Tensor]]:
    return [[raw(b).clone() for b in layer] for layer in pool.buffers]


def wipe(pool: ShmKVPool) -> None:
    for layer in pool.buffers:
        for buf in layer:
            buf.view(torch.uint8).zero_()


def scattered_slots(n_tokens: int, page_size: int, seed: int) -> torch.Tensor:
    """Whole device pages in shuffled order (page_size 1: shuffled single tokens)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(POOL_TOKENS // page_size, generator=g)[: n_tokens // page_size]
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def register(client: KVClient, pool: ShmKVPool, page_size: int, host_tokens: int = 256) -> None:
    client.register(model="tiny", pool=pool, start_layer=START, end_layer=END, num_layers=NUM_LAYERS,
                    host_tokens=host_tokens, page_size=page_size)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_roundtrip_all_layers_and_subset(daemon, kind, dtype, page_size):
    layout = LAYOUTS[kind]
    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS) as pool, KVClient(daemon.address) as client:
        fill_random(pool, seed=page_size)
        original = snapshot(pool)
        register(client, pool, page_size)
        n = 128
        host = client.alloc(n)
        # Scatter the host side too: use the allocated pages in reverse order.
        host = host.view(-1, page_size).flip(0).reshape(-1)
        dev = scattered_slots(n, page_size, seed=1)

        assert client.write(host_indices=host, device_indices=dev) == n * layout.token_bytes(dtype) \
            * layout.num_parts * (END - START)
        wipe(pool)
        handle = client.load(host_indices=host, device_indices=dev)
        for layer in range(START, END):
            handle.wait_layer(layer)
        handle.wait()
        untouched = torch.ones(POOL_TOKENS, dtype=torch.bool)
        untouched[dev] = False
        for local, layer in enumerate(pool.buffers):
            for part, buf in enumerate(layer):
                got = raw(buf)
                assert torch.equal(got[dev], original[local][part][dev]), (local, part)
                assert not got[untouched].any(), "a slot outside the load was written"

        # A subset of layers (global ids): only those land, the others stay wiped.
        wipe(pool)
        subset = [START + 1, END - 1]
        client.load(host_indices=host, device_indices=dev, layers=subset).wait()
        for local, layer in enumerate(pool.buffers):
            for part, buf in enumerate(layer):
                if START + local in subset:
                    assert torch.equal(raw(buf)[dev], original[local][part][dev])
                else:
                    assert not raw(buf).any()
        client.unregister()


@pytest.mark.parametrize("page_size", [1, 16])
def test_write_subset_touches_only_those_layers(daemon, page_size):
    layout, dtype = LAYOUTS["mha"], torch.bfloat16
    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, page_size)
        host = client.alloc(64)
        dev = scattered_slots(64, page_size, seed=3)
        fill_random(pool, seed=10)
        first = snapshot(pool)
        client.write(host_indices=host, device_indices=dev)
        fill_random(pool, seed=11)
        second = snapshot(pool)
        client.write(host_indices=host, device_indices=dev, layers=[START, START + 2])
        wipe(pool)
        client.load(host_indices=host, device_indices=dev).wait()
        for local in range(END - START):
            expect = second if START + local in (START, START + 2) else first
            for part in range(2):
                assert torch.equal(raw(pool.buffers[local][part])[dev], expect[local][part][dev])


def test_strided_pool_and_unaligned_device_slots(daemon):
    """A pool with padding between tokens, and device slots that are not whole pages."""
    layout, dtype, page_size = LAYOUTS["mha"], torch.float16, 16
    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS, token_padding=6) as pool, \
            KVClient(daemon.address) as client:
        fill_random(pool, seed=5)
        original = snapshot(pool)
        register(client, pool, page_size)
        host = client.alloc(48)
        g = torch.Generator().manual_seed(7)
        dev = torch.randperm(POOL_TOKENS, generator=g)[:48]  # single scattered tokens
        client.write(host_indices=host, device_indices=dev)
        wipe(pool)
        client.load(host_indices=host, device_indices=dev).wait()
        for local, layer in enumerate(pool.buffers):
            for part, buf in enumerate(layer):
                assert torch.equal(raw(buf)[dev], original[local][part][dev])
        # The padding bytes between tokens are never written by the daemon.
        flat = pool._shm.mm
        stride = pool.token_stride
        for t in dev.tolist():
            pad_start = t * stride + layout.token_bytes(dtype)
            assert flat[pad_start : pad_start + 6] == b"\0" * 6


def test_contiguous_runs_and_multiple_writes(daemon):
    """Consecutive pages on both sides (the run-copy path) and many small writes."""
    layout, dtype, page_size = LAYOUTS["mla"], torch.bfloat16, 16
    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS) as pool, KVClient(daemon.address) as client:
        fill_random(pool, seed=9)
        original = snapshot(pool)
        register(client, pool, page_size)
        host = client.alloc(256)
        dev = torch.arange(64, 64 + 256)
        for chunk in range(4):
            sl = slice(chunk * 64, (chunk + 1) * 64)
            client.write(host_indices=host[sl], device_indices=dev[sl])
        wipe(pool)
        client.load(host_indices=host, device_indices=dev).wait()
        for local, layer in enumerate(pool.buffers):
            assert torch.equal(raw(layer[0])[dev], original[local][0][dev])
        stats = client.stats()
        assert client.available_size() == stats.clients[0].capacity_tokens - 256
        assert stats.clients[0].transfers.write_ops == 4
        assert stats.clients[0].transfers.load_ops == 1
        assert stats.clients[0].used_tokens == 256


def test_load_streams_progress_in_layer_order(daemon):
    layout, dtype = LAYOUTS["mha"], torch.float32
    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, 1)
        host = client.alloc(200)
        dev = torch.arange(200)
        client.write(host_indices=host, device_indices=dev)
        with grpc.insecure_channel(daemon.address) as ch:
            stub = pb_grpc.KVServerStub(ch)
            req = pb.LoadRequest(client_id=client.client_id, host_indices=host.tolist(),
                                 device_indices=dev.tolist(), layers=[START, START + 1, END - 1])
            msgs = list(stub.Load(req))
        assert msgs, "no progress messages"
        assert [m.last_layer for m in msgs] == sorted(m.last_layer for m in msgs)
        assert all(m.last_layer in (START, START + 1, END - 1) for m in msgs)
        assert msgs[-1].done and msgs[-1].layers_done == 3 and msgs[-1].last_layer == END - 1
        assert not any(m.done for m in msgs[:-1])
        assert msgs[-1].bytes == 3 * 200 * layout.token_bytes(dtype) * 2


def test_async_client_roundtrip(daemon):
    layout, dtype, page_size = LAYOUTS["mha"], torch.bfloat16, 16

    async def run(pool: ShmKVPool) -> None:
        async with AsyncKVClient(daemon.address) as client:
            await client.register(model="tiny", pool=pool, start_layer=START, end_layer=END,
                                  num_layers=NUM_LAYERS, host_tokens=128, page_size=page_size)
            host = await client.alloc(64)
            dev = scattered_slots(64, page_size, seed=2)
            await client.write(host_indices=host, device_indices=dev)
            original = snapshot(pool)
            wipe(pool)
            handle = client.load(host_indices=host, device_indices=dev)
            for local, layer in enumerate(range(START, END)):
                await handle.wait_layer(layer)
                assert torch.equal(raw(pool.buffers[local][0])[dev], original[local][0][dev])
            await handle.wait()
            assert await client.available_size() == 64
            assert await client.free(host) == 64
            assert (await client.stats()).clients[0].used_tokens == 0
            assert await client.available_size() == 128
            await client.unregister()

    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS) as pool:
        fill_random(pool, seed=4)
        asyncio.run(run(pool))


def test_unregister_releases_everything(daemon):
    layout, dtype = LAYOUTS["mha"], torch.bfloat16
    base = daemon.run(lambda: (daemon.core.arena.reserved, len(daemon.core.clients)))
    with ShmKVPool(layout, dtype, END - START, POOL_TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, 16)
        client.write(host_indices=client.alloc(64), device_indices=torch.arange(64))
        assert daemon.run(lambda: daemon.core.arena.reserved) > base[0]
        client.unregister()
        assert daemon.run(lambda: (daemon.core.arena.reserved, len(daemon.core.clients))) == base
    with KVClient(daemon.address) as other:
        totals = other._stub.Stats(pb.StatsRequest())
        assert totals.num_clients == 0 and totals.used_bytes == 0
        assert totals.transfers.write_ops >= 1  # counters of a gone client stay in the totals
