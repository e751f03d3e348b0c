"""scripts/gpu_hops.py, the hop timers for a lent GPU machine, on CPU: its timers wrap methods
that exist and fire on the CUDA path (CuPy replaced by tests/fake_cupy.py), and its analysis
matches copies to calls."""

from __future__ import annotations

import os
import sys

import fake_cupy
import grpc
import pytest
from kernel_host import compiler
from test_media_cuda_fake import cuda_pool, register
from ticketing import ticketing_stub

from kvserver.v1 import kvserver_pb2 as pb

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import gpu_hops  # noqa: E402


def test_the_timers_fire_at_each_hop_of_a_cuda_write_and_load(daemon, monkeypatch):
    """Each wrapped method exists (monkeypatch refuses a missing one), and a Write and a Load of a
    CUDA pool pass every timer but the lane's (these go through gRPC)."""
    if compiler() is None:
        pytest.skip("no C++ compiler (g++) to build the copy kernel")
    fake = fake_cupy.install(monkeypatch)
    marks: dict = {}
    wrapped = gpu_hops.install_timers(marks, monkeypatch.setattr)
    assert len(wrapped) == 6
    refs, kv, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        c = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=c.client_id, num_tokens=16)).host_indices)
        kv[:] = 7
        stub.Write(pb.WriteRequest(client_id=c.client_id, host_indices=host, device_indices=list(range(16))),
                   timeout=10)
        kv[:] = 0
        list(stub.Load(pb.LoadRequest(client_id=c.client_id, host_indices=host,
                                      device_indices=list(range(16))), timeout=10))
    assert (kv[:, :, :16] == 7).all()
    counts = {name: len(v) for name, v in marks.items()}
    assert counts == {"serve": 0, "submit": 2, "enq0": 2, "enq1": 2, "wait0": 2, "wait1": 2, "done": 0,
                      "recorded": 1}
    for name in ("submit", "enq0", "enq1", "wait0", "wait1"):
        assert marks[name] == sorted(marks[name])
    assert marks["submit"][0] < marks["enq0"][0] < marks["enq1"][0] <= marks["wait0"][0] < marks["wait1"][0]


def test_the_analysis_matches_the_daemons_copies_to_the_engines_calls() -> None:
    """Two round trips (a write and a load each), the daemon having served one Alloc before them
    and one Stats between them (answers that are not a copy's): each hop's median is the gap built
    in, in microseconds."""
    marks = {name: [] for name in gpu_hops.MARKS}
    calls = []
    t = 100.0
    marks["serve"].append((t - 1.0, None))  # an Alloc on the lane: not a copy
    marks["done"].append(t - 0.9)
    for j in range(4):
        base = t + j
        calls.append((base, base + 0.001000))
        marks["serve"].append((base + 0.000010, "WriteB" if j % 2 == 0 else "LoadB"))
        for name, at in (("submit", 30), ("enq0", 60), ("enq1", 100), ("wait0", 150), ("wait1", 210)):
            marks[name].append(base + at * 1e-6)
        marks["done"].append(base + 280e-6 + (j % 2) * 1e-6)  # loads answer 1 us later than writes
        if j == 1:  # a Stats on the lane, answered between the round trips
            marks["serve"].append((base + 0.5, None))
            marks["done"].append(base + 0.5001)
    report = gpu_hops.analyze(marks, calls)
    assert report["calls"] == 4
    write = {label: row["p50"] for label, row in report["write"].items()}
    assert list(write.values()) == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 720.0, 1000.0]
    assert report["load"]["until the loop has answered"]["p50"] == 71.0
