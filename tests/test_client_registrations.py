"""One client never holds two registrations: registering again replaces the one it holds (live or
lost), a re-registration answered after the client unregistered is dropped, and the asyncio client
treats a call its own close cancelled as the blocking client does (a miss)."""

from __future__ import annotations

import asyncio
import time

import torch
from checks import wait_until

from kvclient import AsyncKVClient, KVClient, KVLayout, ShmKVPool

LAYERS = 2


def register(client, pool):
    return client.register(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=1024, page_size=16)


def live_ids(daemon) -> list[str]:
    return daemon.run(lambda: [cid for cid, c in daemon.core.clients.items() if not c.closing])


def test_registering_twice_replaces_the_first(daemon):
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, LAYERS, 1024) as pool, KVClient(daemon.address) as c:
        first = register(c, pool)
        second = register(c, pool)
        wait_until(lambda: live_ids(daemon) == [second.client_id], 3.0, "the first registration to go")
        assert first.client_id != second.client_id
        time.sleep(1.5)  # past the reclaim grace: the first one's session was cancelled, nothing else
        assert live_ids(daemon) == [c.client_id]


def test_registering_while_a_lost_registration_is_being_restored_leaves_one(daemon):
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, LAYERS, 1024) as pool, \
            KVClient(daemon.address, timeout=1.0) as c:
        first = register(c, pool)
        daemon.call(daemon.core.unregister(first.client_id))  # lost: the client starts re-registering
        ours = register(c, pool)  # and the engine registers again itself meanwhile
        time.sleep(2.5)
        assert live_ids(daemon) == [c.client_id] and c.client_id == ours.client_id, live_ids(daemon)


def test_a_restore_answered_after_unregister_is_dropped(daemon, monkeypatch):
    core = daemon.core
    plain = core.register
    restoring = []

    async def slow_register(req, *args, **kwargs):
        if req.replaces_client_id:  # the background restore: answered only after the unregister
            restoring.append(req.replaces_client_id)
            await asyncio.sleep(0.6)
        return await plain(req, *args, **kwargs)

    monkeypatch.setattr(core, "register", slow_register)
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, LAYERS, 1024) as pool, \
            KVClient(daemon.address, timeout=2.0) as c:
        first = register(c, pool)
        daemon.call(core.unregister(first.client_id))  # its session ends: the client restores it
        wait_until(lambda: restoring, 3.0, "the background restore to be sent")
        c.unregister()  # while the restore is in flight
        time.sleep(1.0)
        wait_until(lambda: not live_ids(daemon), 3.0, "no registration left")


def test_an_asyncio_call_cancelled_by_close_is_a_miss(daemon):
    async def run():
        with ShmKVPool(KVLayout.mha(2, 8), torch.float16, LAYERS, 1024) as pool:
            client = AsyncKVClient(daemon.address)
            await register(client, pool)
            host = await client.alloc(16)
            write = asyncio.ensure_future(client.write(host_indices=host, device_indices=list(range(16))))
            await asyncio.sleep(0)
            await client.close()
            return await write

    assert asyncio.run(run()) in (0, 16 * 2 * 2 * 2 * 8 * 2)  # a miss, or done before the close


def test_a_replacing_registration_that_could_never_fit_leaves_the_one_it_names(daemon):
    """A re-registration naming the registration it replaces, but asking for more host memory than
    the daemon could give even with that registration's region and every cached page given back:
    RESOURCE_EXHAUSTED, and the old registration, its region and its pages stay."""
    import grpc
    import pytest

    from kvclient._messages import register_request
    from kvclient._transport.fd_socket import get_ticket
    from kvserver.v1 import kvserver_pb2 as pb
    from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, LAYERS, 256) as pool, \
            KVClient(daemon.address, resilient=False) as client:
        reg = register(client, pool)
        host = client.alloc(64)
        assert client.write(host_indices=host, device_indices=torch.arange(64)) > 0
        req = register_request(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                               host_tokens=1 << 24, page_size=16, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        req.replaces_client_id = reg.client_id
        req.peer_ticket = get_ticket(daemon.config.socket + ".fd", pool.fds)
        with grpc.insecure_channel(daemon.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KVServerStub(channel).Register(req, timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "stays" in refused.value.details()
            assert live_ids(daemon) == [reg.client_id]
            stats = pb_grpc.KVServerStub(channel).Stats(pb.StatsRequest(client_id=reg.client_id), timeout=5)
            assert stats.clients[0].used_tokens == 64
        assert client.load(host_indices=host, device_indices=torch.arange(64)).wait() > 0
