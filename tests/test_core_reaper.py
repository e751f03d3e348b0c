"""The reaper reclaims each expired client on its own: one whose release cannot finish (its GPU
never lets go) holds up nobody else's reclaim."""

from __future__ import annotations

import secrets
import threading

import fake_cupy
import grpc
import pytest
from kernel_host import compiler
from light_engine import LightEngine
from test_media_cuda_fake import cuda_pool, register, wait_for
from ticketing import ticketing_stub

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) for the CUDA stand-in")


def test_the_reaper_reclaims_others_while_one_release_hangs(daemon_factory, monkeypatch):
    cupy = fake_cupy.install(monkeypatch)
    rt = cupy.cuda.runtime
    gate = threading.Event()
    real_unregister = rt.hostUnregister

    def stuck(ptr):  # the stuck client's unpinning does not return until the test lets it
        assert gate.wait(20), "the gate was never opened"
        real_unregister(ptr)

    monkeypatch.setattr(rt, "hostUnregister", stuck)
    d = daemon_factory(lease=0.5)
    clients = lambda: d.run(lambda: set(d.core.clients))  # noqa: E731
    refs, _, _ = cuda_pool(cupy, 2, 64)
    with grpc.insecure_channel(d.address) as ch:
        stuck_id = register(ticketing_stub(ch, d.address), refs, 2, 64, 16).client_id  # first in the table
    others = [LightEngine(d.address, f"kvtest-reap-{i}-{secrets.token_hex(4)}", session=False)
              for i in range(2)]
    try:
        # No sessions and no calls: all three expire together; the stuck one is reclaimed first.
        assert wait_for(lambda: not clients(), seconds=5), clients()
        assert d.run(lambda: d.core.reclaimed) == 3
        # The stuck one's release is still under way: its host region is not given back yet.
        assert wait_for(lambda: "hostUnregister" not in [c[0] for c in rt.calls]) and not gate.is_set()
        reserved = lambda: d.run(lambda: d.core.arena.reserved)  # noqa: E731
        assert reserved() > 0
        gate.set()
        assert wait_for(lambda: reserved() == 0), reserved()
        assert stuck_id not in clients()
    finally:
        gate.set()
        for eng in others:
            eng.drop()
