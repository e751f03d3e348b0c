"""A cache Get whose engine is released between its first message (the pages found) and its copy:
the servicer sends that message and waits, and an Unregister (the engine's own shutdown, the
reaper, the daemon's stop) may close the pool meanwhile. The copy must never start then: its pool's
addresses may already be another engine's pool, or nothing (a crash of the daemon). An engine on
gRPC alone has no gate to hold the copy back: the check is the copier's own."""

from __future__ import annotations

import torch

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys
from kvserver.v1 import kvserver_pb2 as pb

LAYERS, TOKENS, PAGE = 2, 64, 16
LAYOUT = KVLayout.mha(2, 64)


def test_a_get_whose_engine_is_released_after_its_first_message_copies_nothing(daemon) -> None:
    keys = page_keys(range(4 * PAGE), PAGE)
    servicer, core = daemon.daemon.servicer, daemon.daemon.core
    with ShmKVPool(LAYOUT, torch.float16, LAYERS, TOKENS) as pool_a, \
            ShmKVPool(LAYOUT, torch.float16, LAYERS, TOKENS) as pool_b, \
            KVClient(daemon.address, lane="grpc") as a, KVClient(daemon.address, lane="grpc") as b:
        reg = a.register(model="released", pool=pool_a, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                         host_tokens=0, page_size=PAGE)
        for layer in pool_a.buffers:
            for buf in layer:
                buf.view(torch.uint8).fill_(0xAA)
        assert a.put(keys, [0, 1, 2, 3]).stored == 4
        req = pb.GetRequest(client_id=reg.client_id, keys=keys, key_bytes=16, device_pages=[0, 1, 2, 3])

        async def first_message_then_release():
            gen = servicer.cache.get(req)
            found, _ = await gen.__anext__()  # the servicer sends it, and waits for the send
            assert found == [4]
            await core.unregister(reg.client_id)
            return gen

        gen = daemon.call(first_message_then_release())
        b.register(model="other", pool=pool_b, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                   host_tokens=0, page_size=PAGE)
        for layer in pool_b.buffers:
            for buf in layer:
                buf.view(torch.uint8).fill_(0x11)

        async def resume():
            steps = []
            try:
                async for _, step in gen:
                    steps.append(step)
            except Exception as exc:
                return type(exc).__name__, steps
            return None, steps

        refused, steps = daemon.call(resume())
        assert refused == "UnknownClient" and steps == []
        for layer in pool_b.buffers:  # nothing of A's reached any pool
            for buf in layer:
                assert (buf.view(torch.uint8) == 0x11).all()
        assert daemon.run(lambda: int(core.cache.pages.readers.sum())) == 0  # its pages let go
