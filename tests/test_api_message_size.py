"""gRPC reads a request on the daemon's event loop, so the daemon takes no message larger than the
largest valid request (kvserver/api/message_size.py): that request is read and answered, one byte
more is refused by gRPC's transport, and a peer's 62 MiB message costs the loop nothing, where it
held it 55-82 ms when the cap was 64 MiB."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
from loop_lag import lag_during

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvserver.api import packed
from kvserver.api.message_size import request_message_bytes
from kvserver.core.cache_ops import MAX_CACHE_KEYS
from kvserver.core.epochs import EPOCH_SHIFT, MAX_EPOCH
from kvserver.store.keys import MAX_KEY_BYTES
from kvserver.v1 import kvserver_pb2 as pb

BIG_MESSAGES = [("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 64 << 20)]
LARGEST_INDEX = (MAX_EPOCH << EPOCH_SHIFT) | ((1 << EPOCH_SHIFT) - 1)  # 9 bytes as a varint
LARGEST_SLOT = (1 << EPOCH_SHIFT) - 1  # 6 bytes


def _call(address: str, method: str, data: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address, options=BIG_MESSAGES) as ch:
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary(f"/kvserver.v1.KVServer/{method}")(data, timeout=60)
    return info.value


def test_the_default_cap_is_16_mib() -> None:
    assert request_message_bytes(1 << 20) == 16 << 20


def test_the_largest_valid_requests_are_read_and_one_byte_more_is_refused(daemon) -> None:
    most = daemon.config.max_request_indices
    write = pb.WriteRequest(client_id="none", host_indices=np.full(most, LARGEST_INDEX),
                            device_indices=np.full(most, LARGEST_SLOT), layers=range(4096),
                            ready_event=b"e" * 64).SerializeToString()
    put = pb.PutRequest(client_id="none", keys=b"k" * (MAX_CACHE_KEYS * MAX_KEY_BYTES),
                        key_bytes=MAX_KEY_BYTES,
                        device_pages=np.full(MAX_CACHE_KEYS, (1 << 63) - 1)).SerializeToString()
    cap = request_message_bytes(most)
    for method, data in (("Write", write), ("Put", put)):
        assert len(data) <= cap
        err = _call(daemon.address, method, data)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "unknown client id" in err.details(), err
    for size in (cap, cap + 1):
        data = _unknown_field(size)
        err = _call(daemon.address, "Free", data)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        if size == cap:  # read, and refused by the daemon's own reader for its size
            assert f"FreeRequest of {cap} bytes" in err.details() and "split it" in err.details(), err
        else:
            assert "larger than max" in err.details() and f"({cap + 1} vs. {cap})" in err.details(), err


def _unknown_field(size: int) -> bytes:
    """A message of exactly ``size`` bytes: one unknown length-delimited field (number 15)."""
    for k in range(1, 11):  # the varint of the field's length takes k bytes
        n = size - 1 - k
        if len(packed._varint(n)) == k:
            return b"\x7a" + packed._varint(n) + b"x" * n
    raise ValueError(f"no one field is {size} bytes")


def test_the_client_says_what_a_request_too_large_for_the_daemon_needs(daemon) -> None:
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, num_layers=1, num_tokens=64) as pool, \
            KVClient(daemon.address, timeout=60) as c:
        c.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=64,
                   page_size=16)
        with pytest.raises(KVClientError) as err:
            c.free(np.arange(2 << 20) | (1 << 62))  # 18 MiB on the wire
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SERVER: Received message larger than max" in err.value.message, err.value
    assert "--max-request-indices" in err.value.message, err.value


BOMB = """
import sys, grpc
data = b"\\x0a" + bytes([0x80, 0x80, 0x80, 0x1f]) + b"x" * (62 << 20)  # a 62 MiB model name
with grpc.insecure_channel(sys.argv[1], options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
    grpc.channel_ready_future(ch).result(timeout=60)
    register = ch.unary_unary("/kvserver.v1.KVServer/Register")
    for line in sys.stdin:  # one message a line read, its answer a line written
        try:
            register(data, timeout=60)
            print("OK", flush=True)
        except grpc.RpcError as exc:
            print(exc.code().name, exc.details(), flush=True)
"""


def test_a_peers_62_mib_message_holds_the_loop_for_no_time(daemon) -> None:
    """The peer is a process of its own (a sender in this one would hold the GIL while it copies),
    its message built and its channel connected before the loop's timer is watched."""
    peer = subprocess.Popen([sys.executable, "-c", BOMB, daemon.address], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    answers = []

    async def sent():
        def one():
            peer.stdin.write("go\n")
            peer.stdin.flush()
            answers.append(peer.stdout.readline())
        await asyncio.to_thread(one)

    late = []
    try:
        for _ in range(5):
            lag, _ = daemon.call(lag_during(sent, 0.02))
            late.append(lag)
            answer = answers[-1]
            assert answer.startswith("RESOURCE_EXHAUSTED") and "larger than max" in answer, answer
            # A 64 MiB cap: gRPC read it on the loop, which ran a 2 ms timer 88-118 ms late on the
            # 2-core VM. Refused by the transport, the timer is late only by the machine's noise.
            if lag < 0.02:
                return
    finally:
        peer.stdin.close()
        peer.wait(timeout=60)
    pytest.fail(f"the loop's timer ran up to {[round(x * 1e3, 1) for x in late]} ms late while a "
                f"62 MiB message came ({answers[-1].strip()})")
