"""Bad requests to the cache RPCs, through raw stubs and through kvclient: each gets a clear status,
and nothing changes (the daemon's Stats and the engine's device pool are the same before and after)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE, CacheEngine, prompt_keys
from checks import error_of, pool_sha
from daemon_proc import DaemonProcess

from kvclient import CacheView
from kvclient._transport.fd_socket import fd_socket_path, get_ticket
from kvserver.protocol.layout import wire_dtype
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

C = grpc.StatusCode
MAX_KEYS = 512  # --max-request-indices
PAGES = 64  # device pages of the engine
STORED = 8  # keys stored before the bad requests


@dataclass
class Env:
    d: DaemonProcess
    eng: CacheEngine
    stub: pb_grpc.KVServerStub
    cid: str
    space_id: str
    keys: list[bytes]
    lease: str

    def snapshot(self) -> tuple:
        return self.d.stats(), pool_sha(self.eng.pool)

    def reject(self, code: grpc.StatusCode, text: str, call: Callable[[], object]) -> None:
        before = self.snapshot()
        got, message = error_of(call)
        assert got == code, f"expected {code.name}, got {got.name}: {message}"
        assert text.lower() in message.lower(), f"{text!r} not in {message!r}"
        assert self.snapshot() == before, "a refused request changed the daemon or the pool"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:
    sock = str(tmp_path_factory.mktemp("cbad") / "kv.sock")
    d = DaemonProcess(sock, "--max-request-indices", str(MAX_KEYS), host_memory="64MiB")
    eng = CacheEngine(d.address, pages=PAGES)
    view = CacheView(d.address, model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=4)
    channel = grpc.insecure_channel(d.address)
    try:
        keys = prompt_keys(np.random.default_rng(0).integers(0, 1000, 2 * STORED * PAGE))
        pages = np.arange(STORED)
        eng.fill(keys[:STORED], pages)
        assert eng.put(keys[:STORED], pages).stored == STORED
        assert view.lookup(keys).pages == STORED
        lease = eng.lookup(keys, pin_ms=60_000).lease_id
        yield Env(d, eng, pb_grpc.KVServerStub(channel), eng.client.registration.client_id, view.space_id,
                  keys, lease)
    finally:
        channel.close()
        view.close()
        eng.close()
        d.stop()


def packed(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def stream(call) -> Callable[[], list]:
    return lambda: list(call())


# ---- Lookup --------------------------------------------------------------------------------------

LOOKUP_CASES = [
    pytest.param({"both": True}, C.INVALID_ARGUMENT, "client_id", id="both-ids"),
    pytest.param({"neither": True}, C.INVALID_ARGUMENT, "client_id", id="no-id"),
    pytest.param({"key_bytes": 0}, C.INVALID_ARGUMENT, "key_bytes", id="key-bytes-0"),
    pytest.param({"key_bytes": 65}, C.INVALID_ARGUMENT, "key_bytes", id="key-bytes-65"),
    pytest.param({"key_bytes": 24}, C.INVALID_ARGUMENT, "not a whole number of 24-byte keys",
                 id="keys-not-a-multiple"),
    pytest.param({"trim": 1}, C.INVALID_ARGUMENT, "255 bytes, not a whole number", id="keys-cut-short"),
    pytest.param({"pin_ms": 60_001}, C.INVALID_ARGUMENT, "60000", id="pin-too-long"),
    pytest.param({"pin_ms": (1 << 32) - 1}, C.INVALID_ARGUMENT, "60000", id="pin-uint32-max"),
    pytest.param({"client_id": "no-such-client"}, C.NOT_FOUND, "", id="unknown-client"),
    pytest.param({"space_id": "no-such-space"}, C.NOT_FOUND, "", id="unknown-space"),
    pytest.param({"many": MAX_KEYS + 1}, C.RESOURCE_EXHAUSTED, str(MAX_KEYS), id="too-many-keys"),
]


@pytest.mark.parametrize(("change", "code", "text"), LOOKUP_CASES)
def test_bad_lookup(env: Env, change: dict, code, text: str) -> None:
    keys = packed(env.keys)
    if "many" in change:
        keys = packed(prompt_keys(np.arange(change["many"] * PAGE)))
    if "trim" in change:
        keys = keys[:-change["trim"]]
    req = pb.LookupRequest(client_id=change.get("client_id", env.cid), keys=keys,
                           key_bytes=change.get("key_bytes", 16), pin_ms=change.get("pin_ms", 0))
    if change.get("both"):
        req.space_id = env.space_id
    if change.get("neither"):
        req.client_id = ""
    if "space_id" in change:
        req.client_id, req.space_id = "", change["space_id"]
    env.reject(code, text, lambda: env.stub.Lookup(req, timeout=10))


# ---- Put and Get ---------------------------------------------------------------------------------

FREE = np.arange(STORED, 3 * STORED)  # one device page per key, none of the stored ones

TRANSFER_CASES = [
    pytest.param({"pages": FREE[:-1]}, C.INVALID_ARGUMENT, "16 keys but 15", id="fewer-pages-than-keys"),
    pytest.param({"pages": np.arange(STORED, 3 * STORED + 1)}, C.INVALID_ARGUMENT, "17", id="more-pages"),
    pytest.param({"pages": np.r_[FREE[:-1], PAGES]}, C.OUT_OF_RANGE, f"{PAGES}", id="page-past-pool"),
    pytest.param({"pages": np.r_[FREE[:-1], 1 << 62]}, C.OUT_OF_RANGE, f"{1 << 62}", id="page-far-past"),
    pytest.param({"pages": np.r_[-1, FREE[1:]]}, C.OUT_OF_RANGE, "-1", id="page-negative"),
    pytest.param({"pages": np.r_[FREE[:-1], FREE[0]]}, C.INVALID_ARGUMENT, "more than once",
                 id="page-repeated"),
    pytest.param({"key_bytes": 0}, C.INVALID_ARGUMENT, "key_bytes", id="key-bytes-0"),
    pytest.param({"key_bytes": 65}, C.INVALID_ARGUMENT, "key_bytes", id="key-bytes-65"),
    pytest.param({"key_bytes": 32}, C.INVALID_ARGUMENT, "8 keys but 16", id="key-bytes-halves-count"),
    pytest.param({"client_id": "no-such-client"}, C.NOT_FOUND, "", id="unknown-client"),
    pytest.param({"many": MAX_KEYS + 1}, C.RESOURCE_EXHAUSTED, str(MAX_KEYS), id="too-many-keys"),
]


def transfer_request(env: Env, op: str, change: dict):
    keys, pages = env.keys, change.get("pages", FREE)
    if "many" in change:
        keys = prompt_keys(np.arange(change["many"] * PAGE))
        pages = np.arange(change["many"]) % PAGES
    fields = {"client_id": change.get("client_id", env.cid), "keys": packed(keys),
              "key_bytes": change.get("key_bytes", 16), "device_pages": np.asarray(pages).tolist()}
    if op == "put":
        return lambda: env.stub.Put(pb.PutRequest(**fields), timeout=10)
    return stream(lambda: env.stub.Get(pb.GetRequest(**fields), timeout=10))


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize(("change", "code", "text"), TRANSFER_CASES)
def test_bad_put_and_get(env: Env, op: str, change: dict, code, text: str) -> None:
    env.reject(code, text, transfer_request(env, op, change))


def test_bad_get_layers_and_lease(env: Env) -> None:
    base = {"client_id": env.cid, "keys": packed(env.keys), "key_bytes": 16, "device_pages": FREE.tolist()}
    env.reject(C.OUT_OF_RANGE, "[0, 4)",
               stream(lambda: env.stub.Get(pb.GetRequest(**base, layers=[4]), timeout=10)))
    env.reject(C.INVALID_ARGUMENT, "ascending",
               stream(lambda: env.stub.Get(pb.GetRequest(**base, layers=[2, 1]), timeout=10)))
    # A lease that is not held is no error: the Get loads what is stored, as without one.
    msgs = list(env.stub.Get(pb.GetRequest(**base, lease_id="no-such-lease"), timeout=10))
    assert msgs[-1].done and msgs[-1].pages == STORED


def parts_request(env: Env, parts: list[tuple[list[bytes], list[int], str]], **fields):
    req = pb.GetRequest(client_id=env.cid, **{"key_bytes": 16, **fields},
                        parts=[pb.GetPart(keys=packed(k), device_pages=list(map(int, d)), lease_id=lease)
                               for k, d, lease in parts])
    return stream(lambda: env.stub.Get(req, timeout=10))


def test_bad_get_with_parts(env: Env) -> None:
    """A Get of several parts is checked whole before any part is read: a bad part refuses all
    (the first parts' prefixes are not read, their leases not ended)."""
    half = STORED // 2
    good = (env.keys[:half], FREE[:half], "")
    env.reject(C.INVALID_ARGUMENT, "part 1: 48 bytes of 16-byte keys and 2 device pages",
               parts_request(env, [good, (env.keys[:3], FREE[half:half + 2], "")]))
    env.reject(C.INVALID_ARGUMENT, "more than once",
               parts_request(env, [good, (env.keys[:2], FREE[:2], env.lease)]))
    env.reject(C.OUT_OF_RANGE, f"{PAGES}", parts_request(env, [good, (env.keys[:1], [PAGES], "")]))
    env.reject(C.INVALID_ARGUMENT, "in its parts", parts_request(env, [good], keys=packed(env.keys[:1])))
    env.reject(C.INVALID_ARGUMENT, "in its parts", parts_request(env, [good], lease_id=env.lease))
    env.reject(C.INVALID_ARGUMENT, "at most 1024", parts_request(env, [([], [], "")] * 1025))
    env.reject(C.INVALID_ARGUMENT, "key_bytes", parts_request(env, [good], key_bytes=0))
    many = prompt_keys(np.arange((MAX_KEYS + 1) * PAGE))
    over = [(many[:MAX_KEYS], np.arange(MAX_KEYS) % PAGES, ""), (many[MAX_KEYS:], [0], "")]
    env.reject(C.RESOURCE_EXHAUSTED, str(MAX_KEYS), parts_request(env, over))
    env.reject(C.OUT_OF_RANGE, "[0, 4)", parts_request(env, [good], layers=[4]))


# ---- Release and OpenSpace -------------------------------------------------------------------------


def test_bad_release(env: Env) -> None:
    for req in (pb.ReleaseRequest(lease_ids=[env.lease]),
                pb.ReleaseRequest(client_id=env.cid, space_id=env.space_id, lease_ids=[env.lease])):
        env.reject(C.INVALID_ARGUMENT, "client_id", lambda req=req: env.stub.Release(req, timeout=10))
    env.reject(C.NOT_FOUND, "", lambda: env.stub.Release(
        pb.ReleaseRequest(client_id="no-such-client", lease_ids=[env.lease]), timeout=10))
    # An unknown lease is not an error: it is not counted, and the real one is still held.
    before = env.snapshot()
    assert env.eng.client.release(["no-such-lease", "0" * 32]) == 0
    assert env.snapshot() == before


def space(**change) -> pb.KVSpace:
    fields = {"model": MODEL, "layout": LAYOUT.to_wire(), "dtype": wire_dtype(DTYPE), "page_size": PAGE,
              "num_layers": 4, "tp_size": 1, "pp_size": 1, **change}
    return pb.KVSpace(**fields)


@pytest.mark.parametrize(("bad", "text"), [
    pytest.param(space(page_size=0), "page_size", id="page-size-0"),
    pytest.param(space(num_layers=0), "num_layers", id="no-layers"),
    pytest.param(space(dtype=pb.DTYPE_UNSPECIFIED), "dtype", id="no-dtype"),
    pytest.param(space(layout=pb.KVLayout()), "layout", id="no-layout"),
    pytest.param(space(model=""), "model", id="no-model"),
    pytest.param(space(weights="w" * 257), "space.weights is 257 characters", id="weights-too-long"),
])
def test_bad_open_space(env: Env, bad: pb.KVSpace, text: str) -> None:
    req = pb.OpenSpaceRequest(space=bad, peer_ticket=get_ticket(fd_socket_path(env.d.address), []))
    env.reject(C.INVALID_ARGUMENT, text, lambda: env.stub.OpenSpace(req, timeout=10))


# ---- through kvclient ------------------------------------------------------------------------------


def test_bad_calls_through_kvclient(env: Env) -> None:
    client = env.eng.client
    env.reject(C.INVALID_ARGUMENT, "16 keys but 15", lambda: client.put(env.keys, FREE[:-1]))
    env.reject(C.OUT_OF_RANGE, f"{PAGES}", lambda: client.put(env.keys, np.r_[FREE[:-1], PAGES]))
    env.reject(C.INVALID_ARGUMENT, "more than once",
               lambda: client.get(env.keys, np.r_[FREE[:-1], FREE[0]]).pages(timeout=10))
    env.reject(C.INVALID_ARGUMENT, "255 bytes of keys are not a whole number of 16-byte keys",
               lambda: client.lookup(packed(env.keys)[:-1]))
    env.reject(C.INVALID_ARGUMENT, "16 bytes", lambda: client.put([*env.keys[:-1], b"short"], FREE))
    env.reject(C.INVALID_ARGUMENT, "60000", lambda: client.lookup(env.keys, pin_ms=60_001))
    # The control: the same calls with good arguments succeed.
    assert client.lookup(env.keys).pages == STORED
