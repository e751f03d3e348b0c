"""Back within seconds of the daemon answering, however long it was away.

Outages of 1, 4 and 10 s run side by side, one daemon process and one engine each: the
engine must be registered again and storing pages within 2 s of its daemon answering health
checks. gRPC's own reconnect backoff (up to 120 s by default) would leave a client idle for
many seconds after a long outage; the client caps it.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import torch
from daemon_proc import DaemonProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvclient import KVClient, KVLayout, ShmKVPool

OUTAGES = (1.0, 4.0, 10.0)
BACK_WITHIN = 2.0


def answers(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def outage(socket: str, seconds: float, results: dict) -> None:
    try:
        d = DaemonProcess(socket)
        with ShmKVPool(KVLayout.mha(2, 16), torch.float16, 2, 256) as pool, KVClient(d.address) as client:
            client.register(model="o", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=256)
            assert client.write(host_indices=client.alloc(16), device_indices=torch.arange(16)) > 0
            d.kill()
            time.sleep(seconds)
            d.start()
            while not answers(d.address):
                time.sleep(0.005)
            answered = time.monotonic()
            while True:
                host = client.alloc(16) if client.connected else None
                if host is not None and client.write(host_indices=host, device_indices=torch.arange(16)) > 0:
                    break
                assert time.monotonic() - answered < 60, "never came back"
                time.sleep(0.005)
            results[seconds] = time.monotonic() - answered
            d.stop()
    except BaseException as exc:
        results[seconds] = exc


def test_engines_are_back_within_two_seconds_after_outages_of_any_length(socket_dir):
    results: dict = {}
    threads = [threading.Thread(target=outage, args=(os.path.join(socket_dir, f"o{i}.sock"), s, results))
               for i, s in enumerate(OUTAGES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    print("serving again after the daemon answered:",
          ", ".join(f"{s:g} s outage: {r:.2f} s" if isinstance(r, float) else f"{s:g} s: {r!r}"
                    for s, r in sorted(results.items())))
    for seconds in OUTAGES:
        got = results.get(seconds)
        assert not isinstance(got, BaseException), f"{seconds} s outage: {got!r}"
        assert got is not None and got < BACK_WITHIN, (
            f"after a {seconds} s outage the engine was serving again {got:.2f} s after the daemon "
            f"answered (goal: {BACK_WITHIN} s); all: {results}")
