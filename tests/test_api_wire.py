"""Large requests are parsed in a worker thread, not on the event loop (kvserver/api/wire.py): a
Write, Load and Free of 128 Ki indices over gRPC are parsed off the loop and served bit-exact;
small ones, and other methods, are parsed as grpc.aio parses them."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch
from test_core_bounded_cost import _request

from kvclient import KVLayout, ShmKVPool
from kvserver.api import servicer, wire
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

BIG_MESSAGES = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def test_only_large_free_write_and_load_requests_wait_to_be_parsed() -> None:
    big = pb.FreeRequest(client_id="c", host_indices=range(1 << 17)).SerializeToString()
    assert len(big) >= wire.LARGE_REQUEST_BYTES
    deferred = servicer._lenient(pb.FreeRequest)(big)
    assert isinstance(deferred, wire.Unparsed)
    assert wire.parse_large(deferred) == pb.FreeRequest.FromString(big)
    small = pb.FreeRequest(client_id="c", host_indices=[1, 2]).SerializeToString()
    assert servicer._lenient(pb.FreeRequest)(small) == pb.FreeRequest.FromString(small)
    # Put's keys and device pages run to megabytes too, but its code reads them on the loop anyway.
    put = pb.PutRequest(client_id="c", keys=b"k" * (1 << 19)).SerializeToString()
    assert isinstance(servicer._lenient(pb.PutRequest)(put), pb.PutRequest)


def test_large_write_load_and_free_are_parsed_off_the_loop_and_served(daemon, monkeypatch) -> None:
    parsed_on: list[tuple[str, threading.Thread]] = []
    parse = wire.parse_large

    def spy(request: wire.Unparsed):
        parsed_on.append((request.message_cls.DESCRIPTOR.name, threading.current_thread()))
        return parse(request)

    monkeypatch.setattr(wire, "parse_large", spy)
    n = 1 << 17
    with ShmKVPool(KVLayout.mla(64, 0), torch.float8_e4m3fn, num_layers=1, num_tokens=n) as pool, \
            grpc.insecure_channel(daemon.address, options=BIG_MESSAGES) as ch:
        stub = pb_grpc.KVServerStub(ch)
        cid = stub.Register(_request(daemon, pool, n, 1), timeout=60).client_id
        raw = pool.buffers[0][0].view(torch.uint8)
        g = torch.Generator().manual_seed(3)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        want = raw.clone()
        host = np.asarray(stub.Alloc(pb.AllocRequest(client_id=cid, num_tokens=n), timeout=60).host_indices)
        dev = np.random.default_rng(4).permutation(n)
        write = pb.WriteRequest(client_id=cid, host_indices=host, device_indices=dev)
        assert len(write.SerializeToString()) >= wire.LARGE_REQUEST_BYTES
        assert stub.Write(write, timeout=60).bytes == n * 64
        raw.zero_()
        load = pb.LoadRequest(client_id=cid, host_indices=host, device_indices=dev)
        assert [p.layers_done for p in stub.Load(load, timeout=60)][-1] == 1
        assert torch.equal(raw, want)
        assert stub.Free(pb.FreeRequest(client_id=cid, host_indices=host), timeout=60).freed_tokens == n
        # A large request that does not parse is refused as a small one is, and changes nothing.
        cut = pb.FreeRequest(client_id=cid, host_indices=host).SerializeToString()[:-3]
        free = ch.unary_unary("/kvserver.v1.KVServer/Free")
        with pytest.raises(grpc.RpcError) as err:
            free(cut, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request is not a valid kvserver.v1.FreeRequest" in err.value.details()
    assert [name for name, _ in parsed_on] == ["WriteRequest", "LoadRequest", "FreeRequest", "FreeRequest"]
    assert all(t is not daemon._thread for _, t in parsed_on), "a large request was parsed on the loop"
