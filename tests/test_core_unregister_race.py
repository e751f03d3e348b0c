"""An Unregister that comes while another release of the same client is closing its pool (the
client already out of the client table, its pool's close running in a thread) waits for that
release and answers as it does; it is never NOT_FOUND for a client still being released."""

from __future__ import annotations

import threading
import time

import torch

from kvclient import KVClient, KVLayout, ShmKVPool
from kvserver.media.shm import ShmDevicePool
from kvserver.v1 import kvserver_pb2 as pb


def test_an_unregister_during_a_releases_pool_close_waits_for_it(daemon, monkeypatch) -> None:
    real_close, closing = ShmDevicePool.close, threading.Event()

    def slow_close(self) -> None:  # the release's close of the pool, in a worker thread
        closing.set()
        time.sleep(0.5)
        return real_close(self)

    monkeypatch.setattr(ShmDevicePool, "close", slow_close)
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, 2, 256) as pool, \
            KVClient(daemon.address, resilient=False, lane="grpc") as c:
        c.register(model="race", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=64,
                   page_size=16)
        cid, out = c.client_id, {}
        first = threading.Thread(target=lambda: out.setdefault(
            "first", c._stub.Unregister(pb.UnregisterRequest(client_id=cid), timeout=10)))
        first.start()
        assert closing.wait(10), "the release did not reach the pool's close"
        assert daemon.run(lambda: cid not in daemon.core.clients)  # the gap: out of the table
        second = c._stub.Unregister(pb.UnregisterRequest(client_id=cid), timeout=10)
        first.join(10)
        assert not second.copies_pending and not out["first"].copies_pending
