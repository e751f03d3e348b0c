"""Bad input against the real daemon: each rejected request gets a specific status and changes nothing.

Every case runs against a daemon holding one client (global layers [4, 8) of an 8-layer model,
MHA 2 heads x 8 dims bf16, 256-token pool, 8 host pages of 16 tokens) that has stored host pages
0..3 from device slots [0, 64). Around each rejected request the test checks that:

- the status code is the specific one and the message names the problem;
- Stats (daemon-wide and the client's own) is identical: capacity, reservations, usage, counters;
- the whole device pool (the shm object's bytes) is unchanged;
- the client's host region (read white-box from the in-process arena) is unchanged, and the stored
  pages, loaded back into a zeroed scratch range of the pool, still hash to what was written;
- a rejected Register leaves no mapping of its shm objects in this (the daemon's) process.

The daemon here runs with --allow-named-shm, so Register cases cover both memfd pools (passed
with a peer ticket) and named /dev/shm objects; tests/test_peers_fd_passing.py covers the default.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from checks import error_of as _error_of
from checks import mappings_of as _mappings_of
from stored_env import (
    END,
    HOST_TOKENS,
    NUM_LAYERS,
    OTHER,
    PAGE,
    POOL_TOKENS,
    START,
    TIMEOUT,
    StoredEnv,
    named_shm_daemon,
    slots,
    ticket_for,
    tokens,
)

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient._messages import register_request
from kvclient.load_handle import LoadHandle
from kvserver.protocol.shared_memory import SHM_DIR
from kvserver.v1 import kvserver_pb2 as pb

C = grpc.StatusCode
U64_MAX = (1 << 64) - 1

# Page 0 of another registration epoch: what an engine holds after a daemon restart.
STALE = [-1 - i for i in range(PAGE)]  # a marker: Env turns it into the current epoch + 1


def _make_raw_shm(name: str, size: int) -> None:
    """A /dev/shm object this process does not map (so any mapping of it is the daemon's)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


class Env(StoredEnv):
    """The stored client (tests/stored_env.py) and raw transfer requests naming its pages."""

    def tagged(self, host: list[int]) -> list[int]:
        """Host slots as this registration's host indices (``tag``); negative numbers stay as
        they are, and STALE becomes page 0 of another epoch."""
        if host == STALE:
            return self.tag(tokens(0), self.epoch + 1)
        return [self.tag([h])[0] if h >= 0 else h for h in host]

    def transfer(self, op: str, host, device, layers=(), client_id: str | None = None, lane: str = "grpc"):
        """The raw request as a call on ``lane``: "grpc", or "ring" (the client's fast lane)."""
        cid = self.cid if client_id is None else client_id
        host = self.tagged(list(host))
        if op == "write":
            req = pb.WriteRequest(client_id=cid, host_indices=host, device_indices=device, layers=layers)
            if lane == "ring":
                return lambda: self._on_ring().unary("Write", req.SerializeToString(), TIMEOUT)
            return lambda: self.stub.Write(req, timeout=TIMEOUT)
        req = pb.LoadRequest(client_id=cid, host_indices=host, device_indices=device, layers=layers)
        if lane == "ring":
            return lambda: ring_stream(self._on_ring(), "Load", req, list(layers) or list(range(START, END)))
        return lambda: list(self.stub.Load(req, timeout=TIMEOUT))

    def _on_ring(self):
        lane = self.client.lane
        assert lane is not None and not lane.closed, "the client's lane is not open"
        return lane


def ring_stream(lane, rpc: str, req, layers: list[int]) -> int:
    """A Load or Get sent on ``lane`` as the client sends it, waited to its end."""
    src = lane.stream(rpc, req.SerializeToString(), TIMEOUT)
    assert src is not None
    handle = LoadHandle(layers)
    handle._source, src.handle = src, handle
    return handle.wait(TIMEOUT)


@pytest.fixture
def daemon(socket_dir: str):
    d = named_shm_daemon(socket_dir)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def env(daemon) -> Iterator[Env]:
    e = Env(daemon)
    try:
        yield e
    finally:
        e.close()


# ---- unknown client ids ----------------------------------------------------------------------------


def _stale_id(env: Env) -> str:
    """The id of a client that registered (on the same pool) and unregistered."""
    other = KVClient(env.daemon.address, timeout=TIMEOUT)
    try:
        reg = other.register(model="gone", pool=env.pool, start_layer=START, end_layer=END,
                             num_layers=NUM_LAYERS, host_tokens=PAGE, page_size=PAGE)
        other.unregister()
    finally:
        other.close()
    return reg.client_id


CLIENT_IDS = {
    "random": lambda env: secrets.token_hex(16),
    "empty": lambda env: "",
    "unregistered": _stale_id,
    "uppercased": lambda env: env.cid.upper() if env.cid.upper() != env.cid else "X" + env.cid[1:],
    "extended": lambda env: env.cid + "0",
    "prefix": lambda env: env.cid[:-1],
}


def _by_id(env: Env, method: str, cid: str):
    s = env.stub
    if method == "Alloc":
        return lambda: s.Alloc(pb.AllocRequest(client_id=cid, num_tokens=PAGE), timeout=TIMEOUT)
    if method == "Free":
        return lambda: s.Free(pb.FreeRequest(client_id=cid, host_indices=tokens(0)), timeout=TIMEOUT)
    if method in ("Write", "Load"):
        return env.transfer(method.lower(), tokens(0), slots(OTHER), client_id=cid)
    if method == "Stats":
        return lambda: s.Stats(pb.StatsRequest(client_id=cid), timeout=TIMEOUT)
    assert method == "Unregister"
    return lambda: s.Unregister(pb.UnregisterRequest(client_id=cid), timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("method", "which"),
    [
        pytest.param(m, w, id=f"{m}-{w}")
        for m in ["Alloc", "Free", "Write", "Load", "Stats", "Unregister"]
        for w in CLIENT_IDS
        if (m, w) != ("Stats", "empty")  # an empty id asks Stats for the daemon-wide view
    ],
)
def test_unknown_client_id(env: Env, method: str, which: str) -> None:
    cid = CLIENT_IDS[which](env)
    message = env.reject(C.NOT_FOUND, "unknown client id", _by_id(env, method, cid))
    assert repr(cid) in message


def test_unknown_client_id_through_kvclient(env: Env) -> None:
    other = KVClient(env.daemon.address, timeout=TIMEOUT, resilient=False)
    other.registration = dataclasses.replace(env.reg, client_id="f" * 32)
    other.connected = True
    try:
        env.reject(C.NOT_FOUND, "unknown client id 'ffff", lambda: other.alloc(PAGE))
        env.reject(C.NOT_FOUND, "unknown client id",
                   lambda: other.load(host_indices=env.host, device_indices=slots(OTHER, 64)).wait(TIMEOUT))
    finally:
        other.registration = None
        other.close()


def test_unknown_client_id_is_a_miss_in_resilient_mode(env: Env) -> None:
    """An engine whose registration the daemon lost sees misses, not exceptions."""
    other = KVClient(env.daemon.address, timeout=TIMEOUT)
    other.registration = dataclasses.replace(env.reg, client_id="f" * 32)
    other.connected = True
    try:
        before = env.snapshot()
        assert other.alloc(PAGE) is None
        other.connected = True  # a lost registration stops calls; let the load try too
        handle = other.load(host_indices=env.host, device_indices=slots(OTHER, 64))
        assert handle.wait(TIMEOUT) == 0 and handle.missed
        assert other.misses == 2
        env.assert_unchanged(before)
    finally:
        other.registration = None
        other.close()


# ---- Write and Load: bad indices and layers ----------------------------------------------------------

OOR, INV, FP = C.OUT_OF_RANGE, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION
REGION = "outside this client's host region of 8 pages"
WHOLE = "whole, aligned pages of 16 tokens"

TRANSFER_CASES = [
    # host indices
    pytest.param(tokens(8), slots(OTHER), [], OOR, f"host page 8 is {REGION}", id="host-past-region"),
    pytest.param(tokens(0, (1 << 32) - 1), slots(OTHER, 32), [], OOR, f"page {(1 << 32) - 1} is {REGION}",
                 id="host-far-past-region"),
    pytest.param(tokens(-1), slots(OTHER), [], OOR, "host index -16 is negative", id="host-negative"),
    pytest.param(tokens(-(1 << 59)), slots(OTHER), [], OOR, "is negative", id="host-int64-min"),
    pytest.param([-1], [OTHER], [], OOR, "host index -1 is negative", id="host-negative-single-slot"),
    pytest.param(STALE, slots(OTHER), [], FP, "allocated before a daemon restart", id="host-stale-epoch"),
    pytest.param(tokens(4), slots(OTHER), [], FP, "host page 4 is not allocated to this client",
                 id="host-not-allocated"),
    pytest.param(tokens(0, 5), slots(OTHER, 32), [], FP, "host page 5 is not allocated",
                 id="host-partly-not-allocated"),
    pytest.param(slots(1), slots(OTHER), [], INV, WHOLE, id="host-misaligned"),
    pytest.param(slots(0, 8), slots(OTHER, 8), [], INV, WHOLE, id="host-partial-page"),
    pytest.param(slots(0, 24), slots(OTHER, 24), [], INV, WHOLE, id="host-page-and-a-half"),
    pytest.param(tokens(0)[::-1], slots(OTHER), [], INV, WHOLE, id="host-page-reversed"),
    pytest.param([0] * PAGE, slots(OTHER), [], INV, WHOLE, id="host-duplicate-slot"),
    pytest.param(tokens(0, 0), slots(OTHER, 32), [], INV, "host indices name the same page more than once",
                 id="host-duplicate-page"),
    pytest.param(tokens(1, 0, 1), slots(OTHER, 48), [], INV, "same page more than once",
                 id="host-duplicate-page-apart"),
    # device indices
    pytest.param(tokens(0), [OTHER] * PAGE, [], INV, "device indices name the same slot more than once",
                 id="device-duplicate-slot"),
    pytest.param(tokens(0, 1), slots(OTHER) * 2, [], INV, "same slot more than once",
                 id="device-duplicate-page"),
    pytest.param(tokens(0), slots(POOL_TOKENS - 6), [], OOR,
                 f"device index {POOL_TOKENS + 9} is outside the device pool of {POOL_TOKENS} tokens",
                 id="device-past-pool"),
    pytest.param(tokens(0), slots(OTHER, 15) + [1 << 62], [], OOR, f"device index {1 << 62} is outside",
                 id="device-far-past-pool"),
    pytest.param(tokens(0), slots(-1), [], OOR, "device index -1 is outside the device pool",
                 id="device-negative"),
    pytest.param(tokens(0), slots(OTHER, 15) + [-(1 << 63)], [], OOR, f"device index {-(1 << 63)}",
                 id="device-int64-min"),
    # pairing
    pytest.param(tokens(0), slots(OTHER, 15), [], INV, "16 host indices but 15 device indices",
                 id="count-mismatch-short"),
    pytest.param(tokens(0), slots(OTHER, 17), [], INV, "16 host indices but 17 device indices",
                 id="count-mismatch-long"),
    pytest.param(tokens(0), [], [], INV, "16 host indices but 0 device indices", id="count-mismatch-empty"),
    pytest.param([], slots(OTHER), [], INV, "0 host indices but 16 device indices",
                 id="count-mismatch-no-host"),
    # layers
    pytest.param(tokens(0), slots(OTHER), [2], OOR, "layer 2 is outside this client's layer range [4, 8)",
                 id="layer-below-range"),
    pytest.param(tokens(0), slots(OTHER), [3], OOR, "layer 3 is outside this client's layer range [4, 8)",
                 id="layer-just-below-range"),
    pytest.param(tokens(0), slots(OTHER), [8], OOR, "layer 8 is outside this client's layer range [4, 8)",
                 id="layer-at-end"),
    pytest.param(tokens(0), slots(OTHER), [4, 5, 9], OOR, "layer 9 is outside", id="layer-last-outside"),
    pytest.param(tokens(0), slots(OTHER), [(1 << 32) - 1], OOR, f"layer {(1 << 32) - 1} is outside",
                 id="layer-uint32-max"),
    pytest.param(tokens(0), slots(OTHER), [5, 5], INV, "layers must be ascending without repeats",
                 id="layer-repeated"),
    pytest.param(tokens(0), slots(OTHER), [6, 5], INV, "ascending without repeats, got [6, 5]",
                 id="layer-descending"),
    pytest.param(tokens(0), slots(OTHER), [4, 5, 7, 7], INV, "ascending without repeats",
                 id="layer-repeated-at-end"),
]


@pytest.mark.parametrize("op", ["write", "load"])
@pytest.mark.parametrize(("host", "device", "layers", "code", "text"), TRANSFER_CASES)
def test_bad_transfer(env: Env, op: str, host, device, layers, code, text) -> None:
    env.reject(code, text, env.transfer(op, host, device, layers))


# The key cases again on the fast lane (docs/lane.md): the same table, so the same status and
# message as test_bad_transfer and test_unknown_client_id get on gRPC, and nothing changed.
LANE_CASES = ("host-not-allocated", "device-past-pool", "count-mismatch-short", "layer-below-range")


@pytest.mark.parametrize("lane", ["ring"])
@pytest.mark.parametrize("op", ["write", "load"])
@pytest.mark.parametrize(("host", "device", "layers", "code", "text"),
                         [c for c in TRANSFER_CASES if c.id in LANE_CASES])
def test_bad_transfer_on_the_lane(env: Env, lane: str, op: str, host, device, layers, code, text) -> None:
    env.reject(code, text, env.transfer(op, host, device, layers, lane=lane))


@pytest.mark.parametrize("lane", ["ring"])
@pytest.mark.parametrize("op", ["write", "load"])
@pytest.mark.parametrize("which", ["unregistered"])
def test_unknown_client_id_on_the_lane(env: Env, lane: str, op: str, which: str) -> None:
    cid = CLIENT_IDS[which](env)
    env.reject(C.NOT_FOUND, "unknown client id", env.transfer(op, tokens(0), slots(OTHER), client_id=cid,
                                                             lane=lane))


@pytest.mark.parametrize("layers", [[2], [4, 8]], ids=["below", "end"])
def test_layer_outside_range_through_kvclient(env: Env, layers: list[int]) -> None:
    """The client library surfaces the same status and the range named as [4, 8)."""
    bad = layers[-1]
    text = f"layer {bad} is outside this client's layer range [4, 8)"
    dev = slots(OTHER, 64)
    env.reject(C.OUT_OF_RANGE, text,
               lambda: env.client.write(host_indices=env.host, device_indices=dev, layers=layers))
    env.reject(C.OUT_OF_RANGE, text,
               lambda: env.client.load(host_indices=env.host, device_indices=dev, layers=layers).wait(5))


# ---- Alloc and Free ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "code", "text"),
    [
        pytest.param(65, C.RESOURCE_EXHAUSTED, "host region full: 5 pages requested, 4 of 8 free",
                     id="more-than-free"),
        pytest.param(HOST_TOKENS + 1, C.RESOURCE_EXHAUSTED, "9 pages requested, 4 of 8 free",
                     id="more-than-region"),
        pytest.param(U64_MAX, C.RESOURCE_EXHAUSTED, "host region full", id="uint64-max"),
        pytest.param(0, C.INVALID_ARGUMENT, "num_tokens must be positive", id="zero"),
    ],
)
def test_bad_alloc(env: Env, num_tokens: int, code, text) -> None:
    req = pb.AllocRequest(client_id=env.cid, num_tokens=num_tokens)
    env.reject(code, text, lambda: env.stub.Alloc(req, timeout=TIMEOUT))


def _free_page_4_once(env: Env) -> None:
    assert env.client.alloc(PAGE).tolist() == env.tagged(tokens(4))
    assert env.client.free(env.tagged(tokens(4))) == PAGE


@pytest.mark.parametrize(
    ("setup", "host", "code", "text"),
    [
        pytest.param(None, tokens(4), FP, "host page 4 is not allocated to this client",
                     id="never-allocated"),
        pytest.param(_free_page_4_once, tokens(4), FP, "host page 4 is not allocated", id="double-free"),
        pytest.param(None, tokens(0, 5), FP, "host page 5 is not allocated", id="allocated-and-not"),
        pytest.param(None, tokens(8), OOR, f"host page 8 is {REGION}", id="past-region"),
        pytest.param(None, tokens(0, 9), OOR, f"host page 9 is {REGION}", id="allocated-and-past-region"),
        pytest.param(None, tokens(-1), OOR, "host index -16 is negative", id="negative"),
        pytest.param(None, STALE, FP, "belongs to registration epoch", id="stale-epoch"),
        pytest.param(None, tokens(0, 0), INV, "host indices name the same page more than once",
                     id="duplicate-page"),
        pytest.param(None, tokens(0)[:-1] + [0], INV, WHOLE, id="duplicate-slot"),
        pytest.param(None, slots(1), INV, WHOLE, id="misaligned"),
        pytest.param(None, slots(0, 8), INV, WHOLE, id="partial-page"),
    ],
)
def test_bad_free(env: Env, setup, host: list[int], code, text) -> None:
    if setup is not None:
        setup(env)
    env.reject(code, text,
               lambda: env.stub.Free(pb.FreeRequest(client_id=env.cid, host_indices=env.tagged(host)),
                                     timeout=TIMEOUT))


# ---- Register ---------------------------------------------------------------------------------------


@dataclass
class Spare:
    """A second pool for Register cases (a memfd, or a named object); this process keeps no
    mapping of it. Each ``request()`` carries a fresh peer ticket."""

    pool: ShmKVPool
    base: pb.RegisterRequest
    extra: list[str]  # more /dev/shm entries a case made, removed at teardown
    daemon: object

    @property
    def name(self) -> str:
        return self.pool.name

    def request(self) -> pb.RegisterRequest:
        req = pb.RegisterRequest()
        req.CopyFrom(self.base)
        req.peer_ticket = ticket_for(self.daemon, self.pool)
        return req

    def names(self) -> list[str]:
        return [self.name, *self.extra]


def _make_spare(env: Env, named: bool) -> Iterator[Spare]:
    name = f"kvtest-spare-{secrets.token_hex(6)}" if named else None
    pool = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=4, num_tokens=POOL_TOKENS, name=name)
    base = register_request(model="spare", pool=pool, start_layer=0, end_layer=4, num_layers=4,
                            host_tokens=64, page_size=PAGE, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    pool.unmap()
    s = Spare(pool, base, [], env.daemon)
    assert _mappings_of(s.name) == []
    try:
        yield s
    finally:
        pool.close()
        for name in s.extra:
            path = os.path.join(SHM_DIR, name)
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)


@pytest.fixture
def spare(env: Env) -> Iterator[Spare]:
    yield from _make_spare(env, named=False)


@pytest.fixture
def named_spare(env: Env) -> Iterator[Spare]:
    yield from _make_spare(env, named=True)


def _set_names(req: pb.RegisterRequest, name: str, layers: list[int] | None = None) -> None:
    for i, layer in enumerate(req.device_pool.layers):
        if layers is None or i in layers:
            for part in layer.parts:
                part.shm.name = name


def _extra(s: Spare, kind: str) -> str:
    name = f"kvtest-{kind}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    s.extra.append(name)
    if kind == "missing":
        pass
    elif kind == "small":
        _make_raw_shm(name, 1000)
    elif kind == "empty":
        _make_raw_shm(name, 0)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(os.path.join(SHM_DIR, s.name), path)
    elif kind == "foreign":  # another user's object, big enough: the daemon must not open it for us
        _make_raw_shm(name, 8 * POOL_TOKENS * 32)
        os.chown(path, 65534, 65534)
    return name


def _names(name: str) -> Callable[[Spare, pb.RegisterRequest], None]:
    return lambda s, r: _set_names(r, name)


def _strides(stride: int) -> Callable[[Spare, pb.RegisterRequest], None]:
    def f(s: Spare, r: pb.RegisterRequest) -> None:
        for layer in r.device_pool.layers:
            for part in layer.parts:
                part.token_stride = stride

    return f


def _parts(n: int) -> Callable[[Spare, pb.RegisterRequest], None]:
    def f(s: Spare, r: pb.RegisterRequest) -> None:
        for layer in r.device_pool.layers:
            first = pb.BufferRef()
            first.CopyFrom(layer.parts[0])
            del layer.parts[:]
            for _ in range(n):
                layer.parts.add().CopyFrom(first)

    return f


def _mla(s: Spare, r: pb.RegisterRequest) -> None:
    r.layout.CopyFrom(KVLayout.mla(12, 4).to_wire())  # 16 values: the same 32-byte token


def _num_layers(n: int) -> Callable[[Spare, pb.RegisterRequest], None]:
    def f(s: Spare, r: pb.RegisterRequest) -> None:
        layers = list(r.device_pool.layers)
        del r.device_pool.layers[:]
        for i in range(n):
            r.device_pool.layers.add().CopyFrom(layers[i % len(layers)])

    return f


def _fields(**values) -> Callable[[Spare, pb.RegisterRequest], None]:
    def f(s: Spare, r: pb.RegisterRequest) -> None:
        for k, v in values.items():
            setattr(r, k, v)

    return f


def _clear_location(s: Spare, r: pb.RegisterRequest) -> None:
    r.device_pool.layers[2].parts[1].ClearField("location")


def _cuda_location(s: Spare, r: pb.RegisterRequest) -> None:
    r.device_pool.layers[0].parts[0].cuda.ipc_handle = b"\0" * 64


def _offset_past_end(s: Spare, r: pb.RegisterRequest) -> None:
    r.device_pool.layers[3].parts[1].offset = 8 * POOL_TOKENS * 32


def _num_tokens(n: int) -> Callable[[Spare, pb.RegisterRequest], None]:
    def f(s: Spare, r: pb.RegisterRequest) -> None:
        r.device_pool.num_tokens = n

    return f


def _geometry(layers: list[int] | None = None, parts: list[int] | None = None, **fields):
    """Sets BufferRef addressing fields (docs/layouts.md) on the chosen buffers (all by default)."""
    def f(s: Spare, r: pb.RegisterRequest) -> None:
        for i, layer in enumerate(r.device_pool.layers):
            for j, part in enumerate(layer.parts):
                if (layers is None or i in layers) and (parts is None or j in parts):
                    for k, v in fields.items():
                        setattr(part, k, v)

    return f


def _overlap_v(s: Spare, r: pb.RegisterRequest) -> None:
    """Layer 0's V, described with blocks, starts half a token into K's last token."""
    k, v = r.device_pool.layers[0].parts
    v.offset = k.offset + (POOL_TOKENS - 1) * 32 + 16
    v.block_tokens, v.block_stride = 16, 16 * 32


NOT_ALLOWED = "is not allowed: use letters, digits"
BAD_NAMES = {
    "dotdot-etc-passwd": "../etc/passwd",
    "slash": "a/b",
    "absolute": "/dev/shm/x",
    "hidden": ".hidden",
    "empty": "",
    "dotdot": "..",
    "dot": ".",
    "inner-dotdot": "a..b",
    "nul": "a\0b",
    "space": "a b",
    "newline": "a\n",
    "non-ascii": "kv\u00e9",
    "too-long": "x" * 202,
}

REGISTER_CASES = [
    pytest.param(lambda s, r: _set_names(r, _extra(s, "missing")), C.NOT_FOUND,
                 "does not exist in /dev/shm", id="shm-missing"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "missing"), [3]), C.NOT_FOUND,
                 "does not exist in /dev/shm", id="shm-missing-last-layer"),
    pytest.param(_num_tokens(POOL_TOKENS + 1), INV, "bytes but the buffer at offset", id="shm-too-small"),
    pytest.param(_offset_past_end, INV, f"is {8 * POOL_TOKENS * 32} bytes but the buffer at offset",
                 id="shm-offset-past-end"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "small")), INV, "is 1000 bytes but",
                 id="shm-object-small"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "small"), [1]), INV, "is 1000 bytes but",
                 id="shm-one-layer-small"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "empty")), INV, "is empty", id="shm-object-empty"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "dir")), INV, "cannot be opened", id="shm-directory"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "fifo")), INV, "is not a regular shared-memory object",
                 id="shm-fifo"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "symlink")), INV, "cannot be opened", id="shm-symlink"),
    pytest.param(lambda s, r: _set_names(r, _extra(s, "foreign")), C.PERMISSION_DENIED,
                 "is owned by uid 65534, not by the caller (uid 0)", id="shm-other-owner"),
    *[pytest.param(_names(n), INV, NOT_ALLOWED, id=f"shm-name-{k}") for k, n in BAD_NAMES.items()],
    pytest.param(lambda s, r: r.ClearField("peer_ticket"), C.UNAUTHENTICATED,
                 "needs a peer ticket", id="ticket-missing"),
    pytest.param(lambda s, r: setattr(r, "peer_ticket", "0" * 32), C.PERMISSION_DENIED,
                 "peer_ticket is unknown, expired or already used", id="ticket-unknown"),
    pytest.param(lambda s, r: setattr(r, "peer_ticket", "x" * 100_000), C.PERMISSION_DENIED,
                 "peer_ticket is unknown", id="ticket-huge"),
    pytest.param(lambda s, r: setattr(r.device_pool.layers[3].parts[1].fd, "index", 1), INV,
                 "device_pool buffer 7 names fd 1 but the peer ticket carries 1 descriptor(s)",
                 id="fd-past-ticket"),
    pytest.param(lambda s, r: setattr(r.device_pool.layers[0].parts[0].fd, "index", 2**32 - 1), INV,
                 f"names fd {2**32 - 1} but the peer ticket carries 1", id="fd-index-uint32-max"),
    pytest.param(_strides(16), INV, "token_stride 16 is smaller than one token (32 bytes", id="stride-half"),
    pytest.param(_strides(0), INV, "token_stride 0 is smaller than one token", id="stride-zero"),
    pytest.param(_geometry(block_stride=64), INV, "block_stride 64 is set but block_tokens is 0",
                 id="geom-block-stride-without-tokens"),
    pytest.param(_geometry(block_tokens=16), INV, "block_tokens 16 needs a block_stride > 0",
                 id="geom-block-tokens-without-stride"),
    pytest.param(_geometry(block_tokens=3, block_stride=96), INV,
                 "num_tokens 256 is not a whole number of blocks of 3 tokens", id="geom-partial-block"),
    pytest.param(_geometry(head_stride=8), INV, "head_stride 8 is smaller than one head (16 bytes)",
                 id="geom-head-stride-small"),
    pytest.param(_geometry(head_stride=32), INV, "device_pool buffer 0: token rows overlap",
                 id="geom-head-rows-overlap"),
    pytest.param(_geometry(block_tokens=4, block_stride=64), INV,
                 "blocks overlap: block_stride 64 is smaller than one block's 128 bytes",
                 id="geom-blocks-overlap"),
    pytest.param(_geometry(offset=2**48), INV, "offset 281474976710656 is too large", id="geom-field-huge"),
    pytest.param(_geometry(block_stride=2**63), INV, "block_stride 9223372036854775808 is too large",
                 id="geom-block-stride-huge"),
    pytest.param(_overlap_v, INV, "device_pool buffer 0 and device_pool buffer 1 overlap in the same memory",
                 id="geom-buffers-overlap"),
    pytest.param(_geometry(layers=[3], parts=[1], block_tokens=16, block_stride=1024), INV,
                 f"is {8 * POOL_TOKENS * 32} bytes but the buffer at offset", id="geom-block-span-past-end"),
    pytest.param(_geometry(layers=[0], token_stride=16, head_stride=4096), C.UNIMPLEMENTED,
                 "every buffer of a shared-memory pool with blocks or strided heads must have the same",
                 id="geom-mixed-geometries"),
    pytest.param(_parts(1), INV, "device_pool layer 0 has 1 buffers; MHA (K and V) needs 2",
                 id="mha-one-part"),
    pytest.param(_parts(3), INV, "has 3 buffers; MHA (K and V) needs 2", id="mha-three-parts"),
    pytest.param(_mla, INV, "has 2 buffers; MLA (one latent) needs 1", id="mla-two-parts"),
    pytest.param(_num_layers(3), INV, "device_pool lists 3 layers but the layer range holds 4",
                 id="too-few-layers"),
    pytest.param(_num_layers(5), INV, "device_pool lists 5 layers but the layer range holds 4",
                 id="too-many-layers"),
    pytest.param(_num_layers(0), INV, "device_pool lists 0 layers", id="no-layers"),
    pytest.param(_num_tokens(0), INV, "device_pool.num_tokens must be in [1, ", id="pool-zero-tokens"),
    pytest.param(_clear_location, INV, "must have a location", id="location-unset"),
    pytest.param(_cuda_location, INV, "all shared memory (fd or shm) or all CUDA IPC",
                 id="location-mixed-cuda"),
    pytest.param(_fields(dtype=pb.DTYPE_UNSPECIFIED), INV, "dtype must be set", id="dtype-unspecified"),
    pytest.param(_fields(dtype=99), INV, "dtype 99 is not supported; use one of DTYPE_BFLOAT16",
                 id="dtype-unknown"),
    pytest.param(lambda s, r: r.ClearField("layout"), INV, "layout must be set to mha or mla",
                 id="layout-unset"),
    pytest.param(lambda s, r: setattr(r.layout.mha, "num_heads", 0), INV, "needs num_heads > 0",
                 id="mha-zero-heads"),
    pytest.param(lambda s, r: setattr(r.layout.mha, "head_dim", 0), INV, "head_dim > 0", id="mha-zero-dim"),
    pytest.param(lambda s, r: r.layout.mla.SetInParent(), INV, "kv_lora_rank > 0", id="mla-zero-rank"),
    pytest.param(_fields(weights="w" * 257), INV, "weights is 257 characters; at most 256",
                 id="weights-too-long"),
    pytest.param(_fields(page_size=0), INV, "page_size must be in [1, 4096], got 0", id="page-size-zero"),
    pytest.param(_fields(page_size=4097), INV, "page_size must be in [1, 4096], got 4097",
                 id="page-size-huge"),
    pytest.param(_fields(start_layer=4, end_layer=4, num_layers=8), INV, "layer range [4, 4) is empty",
                 id="layer-range-empty"),
    pytest.param(_fields(start_layer=3, end_layer=1), INV, "layer range [3, 1) is empty",
                 id="layer-range-reversed"),
    pytest.param(_fields(num_layers=3), INV, "layer range [0, 4) does not fit in a model of num_layers=3",
                 id="end-past-num-layers"),
    pytest.param(_fields(num_layers=0), INV, "num_layers=0", id="num-layers-zero"),
    pytest.param(_fields(tp_rank=2, tp_size=2), INV, "rank out of range: tp 2/2", id="tp-rank-eq-size"),
    pytest.param(_fields(tp_rank=1, tp_size=0), INV, "rank out of range: tp 1/1", id="tp-rank-size-unset"),
    pytest.param(_fields(pp_rank=5, pp_size=2), INV, "pp 5/2", id="pp-rank-past-size"),
    pytest.param(_fields(model=""), INV, "model must be set", id="model-empty"),
    pytest.param(_fields(num_layers=1 << 30), INV, "num_layers 1073741824: at most 4096, 4096 and 4096",
                 id="num-layers-huge"),
    # A Register's per-layer views and checks are Python objects: 65536 layers took 7-8 s of worker
    # time and held the loop 129-145 ms in full collections over them and GIL handoffs.
    pytest.param(_fields(num_layers=4097), INV, "num_layers 4097: at most 4096, 4096 and 4096",
                 id="num-layers-past-4096"),
    pytest.param(_fields(tp_size=1 << 20), INV, "tp_size 1048576, pp_size 1, num_layers 4: at most",
                 id="tp-size-huge"),
    pytest.param(_fields(pp_size=1 << 20), INV, "pp_size 1048576, num_layers 4: at most", id="pp-size-huge"),
    pytest.param(_fields(pp_size=8, pp_rank=0, num_layers=4), INV, "pp_size 8 is more than its 4 layers",
                 id="pp-size-past-layers"),
]


# Cases about names run on a named pool; the rest on a memfd pool (the default).
_SIZE_CASES = {"shm-too-small", "shm-offset-past-end"}
REGISTER_CASES = [
    pytest.param(*c.values, c.id.startswith("shm-") and c.id not in _SIZE_CASES, id=c.id)
    for c in REGISTER_CASES
]


@pytest.mark.parametrize(("mutate", "code", "text", "named"), REGISTER_CASES)
def test_bad_register(env: Env, request, mutate, code, text, named: bool) -> None:
    spare = request.getfixturevalue("named_spare" if named else "spare")
    req = spare.request()
    mutate(spare, req)
    env.reject(code, text, lambda: env.stub.Register(req, timeout=TIMEOUT))
    for name in spare.names():
        assert _mappings_of(name) == [], f"the daemon still maps {name}"


def test_a_named_object_under_a_lease_is_refused_without_waiting(env: Env, named_spare: Spare) -> None:
    """A peer holding a read lease on its object (fcntl F_SETLEASE, as its owner may) would hold the
    daemon's open of it for writing for the kernel's lease-break-time (45 s), in a worker thread
    every Register shares: the daemon does not wait, and says why."""
    name = _extra(named_spare, "small")
    os.truncate(os.path.join(SHM_DIR, name), 8 * POOL_TOKENS * 32)
    leased = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease's holder is told of a break
    try:
        fcntl.fcntl(leased, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        req = named_spare.request()
        _set_names(req, name)
        start = time.monotonic()
        env.reject(C.FAILED_PRECONDITION, "is under a lease",
                   lambda: env.stub.Register(req, timeout=TIMEOUT))
        assert time.monotonic() - start < 5, "the daemon waited for the lease"
        assert _mappings_of(name) == []
    finally:
        os.close(leased)
        signal.signal(signal.SIGIO, old)


def test_a_file_mounted_over_a_named_object_is_refused(env: Env, named_spare: Spare, tmp_path) -> None:
    """A name in /dev/shm with another file system mounted over it (a FUSE file its owner serves,
    say, whose pages it could stall or fail under the daemon's copies): refused before it is opened
    for writing."""
    name = _extra(named_spare, "empty")
    src = tmp_path / "elsewhere"
    src.write_bytes(b"\0" * 8 * POOL_TOKENS * 32)
    mounted = subprocess.run(["mount", "--bind", str(src), os.path.join(SHM_DIR, name)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        req = named_spare.request()
        _set_names(req, name)
        env.reject(C.INVALID_ARGUMENT, "is not in /dev/shm's file system",
                   lambda: env.stub.Register(req, timeout=TIMEOUT))
    finally:
        subprocess.run(["umount", os.path.join(SHM_DIR, name)], check=True)


@pytest.mark.parametrize("named", [False, True], ids=["memfd", "named"])
def test_spare_request_is_valid_and_mapping_check_sees_it(env: Env, request, named: bool) -> None:
    """Positive control: the unmodified request registers, the daemon's mapping shows up in
    /proc/<pid>/maps, and Unregister puts Stats and the maps back as they were."""
    spare = request.getfixturevalue("named_spare" if named else "spare")
    before = env.snapshot()
    resp = env.stub.Register(spare.request(), timeout=TIMEOUT)
    assert resp.host_tokens == 64 and resp.page_size == PAGE
    assert _mappings_of(spare.name) != []
    env.stub.Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)
    assert _mappings_of(spare.name) == []
    env.assert_unchanged(before)


def test_register_page_larger_than_host_memory(env: Env) -> None:
    """One page (4 layers x K,V x 4096 tokens x 32 KiB) is 1 GiB, more than the 512 MiB daemon."""
    pool = ShmKVPool(KVLayout.mha(16, 1024), torch.bfloat16, num_layers=4, num_tokens=1)
    req = register_request(model="big", pool=pool, start_layer=0, end_layer=4, num_layers=4, host_tokens=1,
                           page_size=4096, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                           peer_ticket=ticket_for(env.daemon, pool))
    pool.unmap()
    try:
        env.reject(C.RESOURCE_EXHAUSTED, f"no host memory left for one page of {1 << 30} bytes",
                   lambda: env.stub.Register(req, timeout=TIMEOUT))
        assert _mappings_of(pool.name) == []
    finally:
        pool.close()


@pytest.mark.parametrize("host_tokens", [10**12, U64_MAX], ids=["1e12", "uint64-max"])
def test_register_more_than_budget_grants_less(env: Env, spare: Spare, host_tokens: int) -> None:
    """Only when the engine says it accepts less (min_host_tokens); test_core_bounded_cost.py has the
    refusal of an ask the budget cannot serve."""
    before = env.snapshot()
    free = before.stats_all.capacity_bytes - before.stats_all.reserved_bytes
    req = spare.request()
    req.host_tokens = host_tokens
    req.min_host_tokens = PAGE
    resp = env.stub.Register(req, timeout=TIMEOUT)
    page_bytes = resp.host_bytes_per_token * PAGE
    assert resp.page_size == PAGE
    assert resp.host_tokens % PAGE == 0
    assert 0 < resp.host_tokens * resp.host_bytes_per_token <= free
    assert resp.host_tokens == free // page_bytes * PAGE  # all the room there was, in whole pages
    full = env.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
    assert full.num_clients == 2 and full.reserved_bytes <= full.capacity_bytes

    # Now nothing is left: a third registration is refused and changes nothing.
    third = spare.request()
    env.reject(C.RESOURCE_EXHAUSTED, "no host memory left for one page",
               lambda: env.stub.Register(third, timeout=TIMEOUT))
    assert len(_mappings_of(spare.name)) > 0  # the granted client's mapping only
    mapped = _mappings_of(spare.name)
    third = spare.request()  # the refused Register spent the first one's ticket
    third.host_tokens = 1
    env.reject(C.RESOURCE_EXHAUSTED, "no host memory left", lambda: env.stub.Register(third, timeout=TIMEOUT))
    assert _mappings_of(spare.name) == mapped

    env.stub.Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)
    assert _mappings_of(spare.name) == []
    # Back to where it was, but for the counters of the check loads that env.reject ran.
    after = env.snapshot()
    assert _without_counters(after.stats_all) == _without_counters(before.stats_all)
    assert (after.device_sha, after.region_sha) == (before.device_sha, before.region_sha)
    assert env.loaded_back_sha() == env.stored_sha


def _without_counters(stats: pb.StatsResponse) -> pb.StatsResponse:
    out = pb.StatsResponse()
    out.CopyFrom(stats)
    out.ClearField("transfers")
    for c in out.clients:
        c.ClearField("transfers")
    return out


# ---- requests that are not protobuf at all ------------------------------------------------------------

METHODS = ["Register", "Unregister", "Alloc", "Free", "Write", "Load", "Stats"]
CORRUPT = b"\xff\xff\xff"  # field 0x1fff... with an unfinished varint: not a message of any type


def _raw_call(env: Env, method: str):
    path = f"/kvserver.v1.KVServer/{method}"
    if method == "Load":
        rpc = env.channel.unary_stream(path)
        return lambda: list(rpc(CORRUPT, timeout=TIMEOUT))
    rpc = env.channel.unary_unary(path)
    return lambda: rpc(CORRUPT, timeout=TIMEOUT)


@pytest.mark.parametrize("method", METHODS)
def test_corrupt_request_changes_nothing(env: Env, method: str) -> None:
    before = env.snapshot()
    code, message = _error_of(_raw_call(env, method))
    assert code != C.OK and "Error parsing message" in message
    env.assert_unchanged(before)


@pytest.mark.parametrize("method", METHODS)
def test_corrupt_request_is_invalid_argument(env: Env, method: str) -> None:
    code, message = _error_of(_raw_call(env, method))
    assert code == C.INVALID_ARGUMENT, f"{code.name}: {message}"
    assert f"kvserver.v1.{method}Request" in message


# ---- huge input echoed into the status message ----------------------------------------------------------

HUGE = 100_000  # well past gRPC's metadata limits (8 KiB soft, 16 KiB hard); status details ride in trailers


def _huge_register(env: Env, spare: Spare):
    req = spare.request()
    _set_names(req, "x" * HUGE)
    return lambda: env.stub.Register(req, timeout=TIMEOUT)


HUGE_CASES = {
    **{
        f"client-id-{m}": (
            lambda env, spare, m=m: _by_id(env, m, "a" * HUGE), C.NOT_FOUND, "unknown client id",
        )
        for m in ["Alloc", "Free", "Write", "Load", "Stats", "Unregister"]
    },
    "shm-name": (_huge_register, C.INVALID_ARGUMENT, NOT_ALLOWED),
    **{
        f"layers-repeated-{op}": (
            lambda env, spare, op=op: env.transfer(op, tokens(0), slots(OTHER), [5] * (HUGE // 3)),
            C.INVALID_ARGUMENT, "ascending without repeats",
        )
        for op in ["write", "load"]
    },
}


@pytest.mark.parametrize("case", list(HUGE_CASES))
def test_huge_input_keeps_its_status(env: Env, named_spare: Spare, case: str) -> None:
    spare = named_spare
    make, code, text = HUGE_CASES[case]
    message = env.reject(code, text, make(env, spare))
    assert len(message) < 4096


# ---- a pool shrunk under the daemon -----------------------------------------------------------------------

SHRINK_SCRIPT = r"""
import os, sys
import torch
from conftest import DaemonThread
from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvserver.config import ServerConfig

name, sock = sys.argv[1:3]
dt = DaemonThread(ServerConfig(socket=sock, host_memory=8 << 20, allow_named_shm=True))
pool = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=1, num_tokens=256, name=name)  # 16 KiB
c = KVClient(dt.address, timeout=10, resilient=False)
c.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=16, page_size=16)
h = c.alloc(16)
pool.close(unlink=False)
os.truncate(f"/dev/shm/{name}", 4096)  # the engine shrinks its pool object to one page after Register
print("truncated", flush=True)
try:
    c.write(host_indices=h, device_indices=range(240, 256))  # past the first page
    print("ACCEPTED", flush=True)
except KVClientError as exc:
    print("REJECTED", exc.code.name, exc.message, flush=True)
print("alive", c.stats(all_clients=True).num_clients, flush=True)
c.unregister()
c.close()
dt.stop()
"""


def test_pool_shrunk_after_register_does_not_kill_the_daemon(socket_dir: str) -> None:
    name = f"kvtest-shrunk-{secrets.token_hex(6)}"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    try:
        # No core file, set by a shell the script then replaces (a preexec_fn runs Python code in
        # a child forked from this multithreaded process, which can hang on a lock held at the fork).
        res = subprocess.run(
            ["bash", "-c", 'ulimit -c 0 && exec "$0" "$@"', sys.executable, "-c", SHRINK_SCRIPT, name,
             os.path.join(socket_dir, "shrunk.sock")],
            capture_output=True, text=True, timeout=120, env=env,
        )
    finally:
        if os.path.lexists(os.path.join(SHM_DIR, name)):
            os.unlink(os.path.join(SHM_DIR, name))
    assert "truncated" in res.stdout, res.stderr[-2000:]
    assert res.returncode == 0, f"daemon process died with {res.returncode}: {res.stderr[-500:]}"
    assert "REJECTED FAILED_PRECONDITION" in res.stdout and "alive 1" in res.stdout, res.stdout


# ---- grants, layer lists longer than the range -------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "code", "text"),
    [
        pytest.param({"host_tokens": 10**7}, C.RESOURCE_EXHAUSTED,
                     "accepts no fewer than 10000000 host tokens", id="full-ask-is-the-least"),
        pytest.param({"host_tokens": U64_MAX, "min_host_tokens": 10**7}, C.RESOURCE_EXHAUSTED,
                     "not enough host memory", id="least-over-budget"),
        pytest.param({"host_tokens": 64, "min_host_tokens": 80}, INV,
                     "min_host_tokens 80 is more than host_tokens 64", id="least-over-ask"),
        pytest.param({"host_tokens": 1 << 40, "min_host_tokens": 1 << 40}, C.RESOURCE_EXHAUSTED,
                     f"a client holds at most {1 << 24} pages (--max-pages-per-client",
                     id="least-over-page-limit"),
    ],
)
def test_register_grant_below_the_least_is_refused(env: Env, spare: Spare, fields: dict, code, text) -> None:
    req = spare.request()
    for k, v in fields.items():
        setattr(req, k, v)
    env.reject(code, text, lambda: env.stub.Register(req, timeout=TIMEOUT))
    assert _mappings_of(spare.name) == []


@pytest.mark.parametrize("op", ["write", "load"])
@pytest.mark.parametrize(
    ("layers", "text"),
    [
        pytest.param([4, 5, 6, 7, 8], "layer 8 is outside this client's layer range [4, 8)",
                     id="one-past-end"),
        pytest.param([3, 4, 5, 6, 7], "layer 3 is outside this client's layer range [4, 8)",
                     id="one-below"),
        pytest.param([5] * 50_000 + [9], "layer 9 is outside this client's layer range [4, 8)",
                     id="long-and-outside"),
    ],
)
def test_layer_list_longer_than_the_range_names_the_range(env: Env, op: str, layers, text: str) -> None:
    env.reject(C.OUT_OF_RANGE, text, env.transfer(op, tokens(0), slots(OTHER), layers))


def test_two_layer_ids_for_a_one_layer_range_are_out_of_range(env: Env) -> None:
    """layers=[2, 3] for the range [2, 3): the id outside the range is named, not the count."""
    pool = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=1, num_tokens=64)
    other = KVClient(env.daemon.address, timeout=TIMEOUT, resilient=False)
    try:
        other.register(model="one", pool=pool, start_layer=2, end_layer=3, num_layers=NUM_LAYERS,
                       host_tokens=PAGE, page_size=PAGE)
        host = other.alloc(PAGE)
        text = "layer 3 is outside this client's layer range [2, 3)"
        env.reject(C.OUT_OF_RANGE, text,
                   lambda: other.write(host_indices=host, device_indices=range(PAGE), layers=[2, 3]))
        env.reject(C.OUT_OF_RANGE, text,
                   lambda: other.load(host_indices=host, device_indices=range(PAGE), layers=[2, 3]).wait(5))
        assert other.write(host_indices=host, device_indices=range(PAGE), layers=[2]) > 0
    finally:
        other.unregister()
        other.close()
        pool.close()
