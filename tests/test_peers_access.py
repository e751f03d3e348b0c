"""Access control and limits against the real daemon.

- The Unix socket is owner-only (0600) unless group access is asked for (0660).
- TCP needs a token (or an explicit --insecure-tcp); with a token every KVServer call and server
  reflection need 'authorization: Bearer <token>', on TCP and on the Unix socket alike, while
  grpc.health.v1 stays open for probes. The same through the CLI (--token-file, KVSERVER_TOKEN).
- Limits: clients, indices per request, gRPC message size, the host memory budget. A refused
  request changes nothing: Stats, the device pools' bytes and the stored host bytes are the same.
- A client can only name its own host pages: another registration's indices carry another epoch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from checks import error_of as _error_of
from checks import mappings_of as _mappings_of
from checks import pool_sha as _pool_sha
from checks import sha_of as _sha
from conftest import DaemonThread
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_api_grpcurl import GRPCURL, GRPCURL_VERSION
from test_server_cli import STARTUP_TIMEOUT, DaemonProcess, clean_env

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvclient._messages import register_request
from kvclient._transport.fd_socket import fd_socket_path, get_ticket
from kvserver.config import ServerConfig
from kvserver.core.epochs import EPOCH_SHIFT, SLOT_MASK
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

C = grpc.StatusCode
TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
DENIED = "missing or wrong token"
TIMEOUT = 10.0
SERVICE = "kvserver.v1.KVServer"

LAYERS = 2  # every pool here holds global layers [0, 2) of a 2-layer model
PAGE = 16
POOL_TOKENS = 256
SCRATCH = 176  # device slots [176, 256) stay zero except while stored pages are loaded back

needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason=f"no runnable grpcurl binary: {GRPCURL_VERSION}")


# ---- helpers ------------------------------------------------------------------------------------------


def _new_pool(seed: int = 0, **kw) -> ShmKVPool:
    """Random KV in device slots [0, SCRATCH), zeros above."""
    kw.setdefault("layout", KVLayout.mha(2, 8))
    kw.setdefault("num_layers", LAYERS)
    kw.setdefault("num_tokens", POOL_TOKENS)
    pool = ShmKVPool(dtype=torch.bfloat16, **kw)
    g = torch.Generator().manual_seed(seed)
    for parts in pool.buffers:
        for buf in parts:
            buf.copy_(torch.randn(buf.shape, generator=g))
            buf[SCRATCH:].zero_()
    return pool


def _register_request(pool: ShmKVPool, host_tokens: int = 256, page_size: int = PAGE, model: str = "m",
                      fd_socket: str | None = None):
    """With ``fd_socket``, the request carries a fresh ticket for the pool's memfd."""
    ticket = get_ticket(fd_socket, pool.fds) if fd_socket else ""
    return register_request(model=model, pool=pool, start_layer=0, end_layer=pool.num_layers,
                            num_layers=pool.num_layers, host_tokens=host_tokens, page_size=page_size,
                            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, peer_ticket=ticket)


def _fd(d: DaemonThread) -> str:
    """The daemon's fd socket, beside its gRPC socket."""
    return d.config.socket + ".fd"


class Party:
    """One client registered through a raw stub (no Session: the 30 s lease outlives any test here),
    with what it stored on the host and the means to check it is still there."""

    def __init__(self, target: str, *, metadata=None, host_tokens: int = 256, min_host_tokens: int = 0,
                 seed: int = 0, fd_socket: str | None = None) -> None:
        self.md = metadata
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.KVServerStub(self.channel)
        self.pool = _new_pool(seed)
        try:
            req = _register_request(self.pool, host_tokens, fd_socket=fd_socket or fd_socket_path(target))
            req.min_host_tokens = min_host_tokens
            resp = self.call("Register", req)
        except BaseException:
            self.close()
            raise
        self.cid, self.epoch = resp.client_id, resp.epoch
        self.stored: list[tuple[list[int], list[int]]] = []  # (host, device) pairs written
        self.stored_sha = _sha([])

    def call(self, method: str, request):
        rpc = getattr(self.stub, method)
        if method == "Load":
            return list(rpc(request, timeout=TIMEOUT, metadata=self.md))
        return rpc(request, timeout=TIMEOUT, metadata=self.md)

    def alloc(self, n: int) -> list[int]:
        return list(self.call("Alloc", pb.AllocRequest(client_id=self.cid, num_tokens=n)).host_indices)

    def store(self, host: list[int], device: list[int]) -> None:
        """Writes device slots to host slots and remembers the source rows' hash."""
        self.call("Write", pb.WriteRequest(client_id=self.cid, host_indices=host, device_indices=device))
        self.stored.append((host, device))
        rows = [d for _, dev in self.stored for d in dev]
        self.stored_sha = _sha([p[rows] for layer in self.pool.buffers for p in layer])

    def device_sha(self) -> str:
        return _pool_sha(self.pool)

    def loaded_back_sha(self) -> str:
        """Loads every stored page into the zeroed scratch slots, hashes them, zeroes them again."""
        scratch = [p[SCRATCH:] for layer in self.pool.buffers for p in layer]
        assert all(not t.any() for t in scratch), "scratch slots were not zero"
        at = SCRATCH
        for host, _ in self.stored:
            dev = list(range(at, at + len(host)))
            req = pb.LoadRequest(client_id=self.cid, host_indices=host, device_indices=dev)
            steps = self.call("Load", req)
            assert steps and steps[-1].done
            at += len(host)
        sha = _sha([p[SCRATCH:at] for layer in self.pool.buffers for p in layer])
        for t in scratch:
            t.zero_()
        return sha

    def close(self) -> None:
        self.channel.close()
        self.pool.close()


class World:
    """Parties on one daemon, and the check around a refused request: same status, nothing changed."""

    def __init__(self, parties: list[Party]) -> None:
        self.parties = parties

    def snapshot(self) -> tuple:
        p0 = self.parties[0]
        return (
            p0.call("Stats", pb.StatsRequest()),
            [p.call("Stats", pb.StatsRequest(client_id=p.cid)) for p in self.parties],
            [p.device_sha() for p in self.parties],
        )

    def assert_unchanged(self, before: tuple) -> None:
        after = self.snapshot()
        assert after[0] == before[0], "daemon-wide Stats changed"
        assert after[1] == before[1], "a client's Stats changed"
        assert after[2] == before[2], "a device pool changed"
        for p in self.parties:
            assert p.loaded_back_sha() == p.stored_sha, f"stored host bytes of {p.cid[:8]} changed"

    def reject(self, code: grpc.StatusCode, text: str, call: Callable[[], object]) -> str:
        before = self.snapshot()
        got, message = _error_of(call)
        assert got == code, f"{got.name}: {message}"
        assert text in message, message
        self.assert_unchanged(before)
        return message


@pytest.fixture
def make_daemon(socket_dir: str) -> Iterator[Callable[..., DaemonThread]]:
    made: list[DaemonThread] = []

    def make(**kw) -> DaemonThread:
        kw.setdefault("host_memory", 64 << 20)
        d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, f"kv{len(made)}.sock"), **kw))
        made.append(d)
        return d

    yield make
    for d in reversed(made):
        d.stop()


@pytest.fixture
def unmapped() -> Iterator[Callable[..., ShmKVPool]]:
    """Pools whose memfd is open but that this process does not map, so a mapping of one in
    /proc/self/maps is the (in-process) daemon's. ``descriptor()`` and ``fds`` still work on them."""
    pools: list[ShmKVPool] = []

    def make(seed: int = 0, **kw) -> ShmKVPool:
        pool = _new_pool(seed, **kw)
        pool.unmap()
        pools.append(pool)
        assert _mappings_of(pool.name) == []
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def parties() -> Iterator[list[Party]]:
    made: list[Party] = []
    yield made
    for p in made:
        p.close()


def tcp_of(d: DaemonThread) -> str:
    """The daemon listens on 127.0.0.1:0; ports[-1] is the port the kernel picked."""
    return f"127.0.0.1:{d.daemon.ports[-1]}"


def _stub_call(target: str, method: str, request, metadata=None):
    with grpc.insecure_channel(target) as ch:
        rpc = getattr(pb_grpc.KVServerStub(ch), method)
        if method in ("Load", "Session"):
            stream = rpc(request, timeout=TIMEOUT, metadata=metadata)
            return next(iter(stream)) if method == "Session" else list(stream)
        return rpc(request, timeout=TIMEOUT, metadata=metadata)


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=TIMEOUT).status


# ---- the Unix socket's mode ---------------------------------------------------------------------------


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def test_socket_is_owner_only_by_default(daemon) -> None:
    st = os.stat(daemon.config.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)


def test_socket_group_access_makes_it_0660(make_daemon) -> None:
    umask = _umask()
    d = make_daemon(socket_group_access=True)
    assert stat.S_IMODE(os.stat(d.config.socket).st_mode) == 0o660
    assert _umask() == umask, "starting the daemon left the process umask changed"
    assert health(d.address) == health_pb2.HealthCheckResponse.SERVING


# ---- TCP needs a token ---------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, ""], ids=["none", "empty"])
def test_config_refuses_tcp_without_token(token) -> None:
    with pytest.raises(ValueError, match="--insecure-tcp"):
        ServerConfig(listen="127.0.0.1:0", token=token)
    assert ServerConfig(listen="127.0.0.1:0", insecure_tcp=True).addresses == ["127.0.0.1:0"]
    assert ServerConfig(listen="127.0.0.1:0", token=TOKEN).token == TOKEN


@pytest.fixture
def secured(make_daemon) -> DaemonThread:
    return make_daemon(listen="127.0.0.1:0", token=TOKEN)


def _target(d: DaemonThread, via: str) -> str:
    return tcp_of(d) if via == "tcp" else d.address


BAD_METADATA = {
    "none": None,
    "wrong": (("authorization", "Bearer wrong"),),
    "no-scheme": (("authorization", TOKEN),),
    "lowercase-scheme": (("authorization", f"bearer {TOKEN}"),),
    "prefix": (("authorization", f"Bearer {TOKEN[:-1]}"),),
    "longer": (("authorization", f"Bearer {TOKEN}2"),),
    "trailing-space": (("authorization", f"Bearer {TOKEN} "),),
    "empty": (("authorization", ""),),
    "other-key": (("x-authorization", f"Bearer {TOKEN}"),),
}


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_stats_needs_the_token(secured, via: str) -> None:
    target = _target(secured, via)
    for name, md in BAD_METADATA.items():
        code, message = _error_of(lambda md=md: _stub_call(target, "Stats", pb.StatsRequest(), md))
        assert code == C.UNAUTHENTICATED, f"{name}: {code.name}: {message}"
        assert DENIED in message and TOKEN not in message, f"{name}: {message}"
    stats = _stub_call(target, "Stats", pb.StatsRequest(), AUTH)
    assert stats.capacity_bytes == 64 << 20 and stats.num_clients == 0


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_every_kvserver_call_needs_the_token(secured, unmapped, via: str) -> None:
    """Register without the token must not even open the pool; the rest are refused before any
    lookup, so a real client id does not help either."""
    target = _target(secured, via)
    owner = Party(target, metadata=AUTH, fd_socket=_fd(secured))
    try:
        host = owner.alloc(PAGE)
        owner.store(host, list(range(PAGE)))
        world = World([owner])
        pool = unmapped(seed=1)
        cid, dev = owner.cid, range(PAGE, 2 * PAGE)
        calls = {
            "Register": _register_request(pool, fd_socket=_fd(secured)),
            "Unregister": pb.UnregisterRequest(client_id=cid),
            "Alloc": pb.AllocRequest(client_id=cid, num_tokens=PAGE),
            "Free": pb.FreeRequest(client_id=cid, host_indices=host),
            "Write": pb.WriteRequest(client_id=cid, host_indices=host, device_indices=dev),
            "Load": pb.LoadRequest(client_id=cid, host_indices=host, device_indices=dev),
            "Stats": pb.StatsRequest(client_id=cid),
            "Session": pb.SessionRequest(client_id=cid),
        }
        for method, request in calls.items():
            for md in (None, (("authorization", "Bearer nope"),)):
                world.reject(C.UNAUTHENTICATED, DENIED,
                             lambda m=method, r=request, md=md: _stub_call(target, m, r, md))
            assert _mappings_of(pool.name) == [], f"{method}: the daemon mapped the pool"
        assert owner.call("Stats", pb.StatsRequest()).num_clients == 1
        assert owner.call("Stats", pb.StatsRequest(client_id=cid)).clients[0].sessions == 0
    finally:
        owner.close()


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_health_needs_no_token(secured, via: str) -> None:
    target = _target(secured, via)
    for service in ("", SERVICE):
        assert health(target, service) == health_pb2.HealthCheckResponse.SERVING


def _grpcurl_tcp(address: str, headers: list[str], *args: str, data: str | None = None):
    """The real grpcurl over plaintext TCP; ``headers`` are grpcurl flags (-H, -reflect-header...)."""
    cmd = [GRPCURL, "-plaintext", "-max-time", "10", *headers]
    if data is not None:
        cmd += ["-d", data]
    return subprocess.run([*cmd, address, *args], capture_output=True, text=True, timeout=30)


@needs_grpcurl
def test_grpcurl_reflection_needs_the_token(secured) -> None:
    tcp = tcp_of(secured)
    auth = f"authorization: Bearer {TOKEN}"
    for headers in ([], ["-H", "authorization: Bearer wrong"], ["-H", f"authorization: {TOKEN}"]):
        res = _grpcurl_tcp(tcp, headers, "list")
        assert res.returncode != 0, res.stdout
        assert "Unauthenticated" in res.stderr and DENIED in res.stderr, res.stderr
        assert SERVICE not in res.stdout

    res = _grpcurl_tcp(tcp, ["-H", auth], "list")
    assert res.returncode == 0, res.stderr
    services = res.stdout.split()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    res = _grpcurl_tcp(tcp, ["-H", auth], "describe", SERVICE)
    assert res.returncode == 0 and "rpc Register (" in res.stdout, res.stderr

    stats = _grpcurl_tcp(tcp, ["-H", auth], f"{SERVICE}/Stats", data="{}")
    assert stats.returncode == 0, stats.stderr
    assert str(64 << 20) in stats.stdout

    # Reflection with the token but the call without it: the call itself is refused...
    res = _grpcurl_tcp(tcp, ["-reflect-header", auth], f"{SERVICE}/Stats", data="{}")
    assert res.returncode == 64 + C.UNAUTHENTICATED.value[0], res.stderr
    assert "Code: Unauthenticated" in res.stderr and DENIED in res.stderr
    # ...and the call with it but reflection without it fails at reflection.
    res = _grpcurl_tcp(tcp, ["-rpc-header", auth], f"{SERVICE}/Stats", data="{}")
    assert res.returncode != 0 and DENIED in res.stderr, res.stderr
    # Health itself is open: only grpcurl's reflection lookup needs the token.
    res = _grpcurl_tcp(tcp, ["-reflect-header", auth], "grpc.health.v1.Health/Check")
    assert res.returncode == 0 and '"status": "SERVING"' in res.stdout, res.stderr


def _round_trip(client: KVClient, pool: ShmKVPool) -> None:
    """Registers, writes device slots [8, 56) to host, zeroes them, loads them back bit-exactly."""
    ref = [[b.clone() for b in parts] for parts in pool.buffers]
    reg = client.register(model="auth", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                          host_tokens=64, page_size=PAGE)
    host = client.alloc(48)
    device = torch.arange(8, 56)
    assert client.write(host_indices=host, device_indices=device) == 48 * reg.host_bytes_per_token
    for parts in pool.buffers:
        for buf in parts:
            buf[8:56].zero_()
    assert client.load(host_indices=host, device_indices=device).wait(timeout=TIMEOUT) == \
        48 * reg.host_bytes_per_token
    for parts, want in zip(pool.buffers, ref, strict=True):
        for buf, ref_buf in zip(parts, want, strict=True):
            assert torch.equal(buf.view(torch.int16), ref_buf.view(torch.int16))
    # The Session stream carries the token too: the daemon counts it.
    deadline = time.monotonic() + TIMEOUT
    while client.stats().clients[0].sessions != 1:
        assert time.monotonic() < deadline, "the session never opened"
        time.sleep(0.01)
    assert client.free(host) == 48
    client.unregister()


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_kvclient_with_token(secured, monkeypatch, via: str) -> None:
    monkeypatch.delenv("KVSERVER_TOKEN", raising=False)
    monkeypatch.setenv("KVSERVER_FD_SOCKET", _fd(secured))  # how a TCP client finds the fd socket
    with _new_pool() as pool, KVClient(_target(secured, via), token=TOKEN, timeout=TIMEOUT,
                                       resilient=False) as client:
        _round_trip(client, pool)
    assert _stub_call(tcp_of(secured), "Stats", pb.StatsRequest(), AUTH).num_clients == 0


@pytest.mark.parametrize("token", [None, "wrong"], ids=["no-token", "wrong-token"])
def test_kvclient_without_the_token_is_unauthenticated(secured, unmapped, monkeypatch, token) -> None:
    monkeypatch.delenv("KVSERVER_TOKEN", raising=False)
    pool = unmapped()
    with KVClient(tcp_of(secured), token=token, timeout=TIMEOUT) as client:
        with pytest.raises(KVClientError) as err:
            client.register(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                            host_tokens=64, page_size=PAGE)
        assert err.value.code == C.UNAUTHENTICATED and DENIED in err.value.message
        assert client.registration is None
        assert _mappings_of(pool.name) == []
    assert _stub_call(tcp_of(secured), "Stats", pb.StatsRequest(), AUTH).num_clients == 0


def test_kvclient_reads_token_from_env(secured, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVER_TOKEN", TOKEN)
    monkeypatch.setenv("KVSERVER_FD_SOCKET", _fd(secured))
    with _new_pool() as pool, KVClient(tcp_of(secured), timeout=TIMEOUT, resilient=False) as client:
        _round_trip(client, pool)
    # An explicit token wins over the environment.
    monkeypatch.setenv("KVSERVER_TOKEN", "wrong")
    with _new_pool() as pool, KVClient(tcp_of(secured), token=TOKEN, timeout=TIMEOUT,
                                       resilient=False) as client:
        _round_trip(client, pool)


# ---- the CLI: tokens from a file or the environment -----------------------------------------------------


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> Iterator[dict[str, tuple[DaemonProcess, str]]]:
    """Every CLI case starts at once (each process pays the torch import): name -> (process, socket)."""
    tmp = tmp_path_factory.mktemp("cli")
    token_file, empty_file = tmp / "token", tmp / "empty"
    token_file.write_text(f"{TOKEN}\n")
    empty_file.write_text("")
    tcp = ["--listen", "127.0.0.1:0", "--host-memory", "16MiB"]
    cases = {
        "no-token": (tcp, {}),
        "empty-token-file": ([*tcp, "--token-file", str(empty_file)], {}),
        "insecure-tcp": ([*tcp, "--insecure-tcp"], {}),
        "token-file": ([*tcp, "--token-file", str(token_file)], {"KVSERVER_TOKEN": "not-this-one"}),
        "token-env": (tcp, {"KVSERVER_TOKEN": TOKEN}),
    }
    runs = {}
    for name, (args, env) in cases.items():
        sock = str(tmp / name / "kv.sock")
        runs[name] = (DaemonProcess(["--socket", sock, *args], clean_env(**env), tmp / f"{name}.log"), sock)
    yield runs
    for proc, _ in runs.values():
        proc.close()


def _exit_code(proc: DaemonProcess) -> int:
    try:
        return proc.proc.wait(timeout=STARTUP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {STARTUP_TIMEOUT} s; it should have refused to start:\n{proc.log}")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-token", "kvserver: listening on TCP needs a token (--token-file or KVSERVER_TOKEN); "
                     "--insecure-tcp runs without one"),
        ("empty-token-file", "is empty"),
    ],
)
def test_cli_refuses_to_start(cli, case: str, message: str) -> None:
    proc, sock = cli[case]
    assert _exit_code(proc) == 2, proc.log
    assert message in proc.log and "Traceback" not in proc.log, proc.log
    assert not os.path.exists(sock)


def _tcp_port(proc: DaemonProcess) -> int:
    """The port the kernel picked for 127.0.0.1:0, from the 'listening on' log line."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        m = re.search(r"kvserver listening on \S+, 127\.0\.0\.1:(\d+) with", proc.log)
        if m:
            return int(m.group(1))
        assert time.monotonic() < deadline, proc.log
        time.sleep(0.05)


def _serving(cli, case: str) -> tuple[DaemonProcess, str, str]:
    proc, sock = cli[case]
    proc.wait_serving(f"unix://{sock}", sock)
    return proc, f"unix://{sock}", f"127.0.0.1:{_tcp_port(proc)}"


def _stop(proc: DaemonProcess) -> None:
    rc, _ = proc.stop(signal.SIGTERM)
    assert rc == 0, proc.log
    assert "Traceback" not in proc.log


def test_cli_insecure_tcp_starts_and_warns(cli) -> None:
    proc, unix, tcp = _serving(cli, "insecure-tcp")
    assert re.search(r"WARNING kvserver\.server: listening on TCP 127\.0\.0\.1:0 without a token "
                     r"\(--insecure-tcp\)", proc.log), proc.log
    for target in (unix, tcp):
        assert _stub_call(target, "Stats", pb.StatsRequest()).capacity_bytes == 16 << 20
    _stop(proc)


@pytest.mark.parametrize("case", ["token-file", "token-env"])
def test_cli_token(cli, monkeypatch, case: str) -> None:
    monkeypatch.delenv("KVSERVER_TOKEN", raising=False)
    proc, unix, tcp = _serving(cli, case)
    assert "--insecure-tcp" not in proc.log
    for target in (unix, tcp):
        for md in (None, (("authorization", "Bearer not-this-one"),)):
            code, message = _error_of(lambda t=target, md=md: _stub_call(t, "Stats", pb.StatsRequest(), md))
            assert code == C.UNAUTHENTICATED and DENIED in message, f"{target}: {code.name}: {message}"
        assert _stub_call(target, "Stats", pb.StatsRequest(), AUTH).capacity_bytes == 16 << 20
        assert health(target, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    monkeypatch.setenv("KVSERVER_FD_SOCKET", unix.removeprefix("unix://") + ".fd")
    with _new_pool() as pool, KVClient(tcp, token=TOKEN, timeout=TIMEOUT, resilient=False) as client:
        _round_trip(client, pool)
    _stop(proc)


# The rest of the token sources run main() / config_from_args() in this process (no torch import each).


def _main(monkeypatch, capsys, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    import kvserver.__main__ as cli_main

    def must_not_serve(*_):
        raise AssertionError("main() went on to serve")

    monkeypatch.setattr(cli_main.uvloop, "run", must_not_serve)
    for key in [k for k in os.environ if k.startswith("KVSERVER_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        rc = cli_main.main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("setup", "env", "message"),
    [
        pytest.param("  \n\t", {}, "is empty", id="blank-token-file"),
        pytest.param(None, {}, "cannot read token file", id="missing-token-file"),
        pytest.param(False, {"KVSERVER_TOKEN": ""}, "listening on TCP needs a token", id="empty-env-token"),
    ],
)
def test_cli_bad_token_sources(monkeypatch, capsys, tmp_path: Path, setup, env, message) -> None:
    argv = ["--socket", str(tmp_path / "never.sock"), "--listen", "127.0.0.1:0"]
    if setup is not False:
        path = tmp_path / "token"
        if setup is not None:
            path.write_text(setup)
        argv += ["--token-file", str(path)]
    rc, err = _main(monkeypatch, capsys, argv, env)
    assert rc == 2, err
    assert message in err, err


def test_token_file_from_env_and_precedence(monkeypatch, tmp_path: Path) -> None:
    from kvserver.__main__ import build_parser, config_from_args

    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    argv = ["--socket", str(tmp_path / "kv.sock"), "--listen", "127.0.0.1:0"]
    for key in [k for k in os.environ if k.startswith("KVSERVER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KVSERVER_TOKEN_FILE", str(path))
    monkeypatch.setenv("KVSERVER_TOKEN", "from-env")
    assert config_from_args(build_parser().parse_args(argv)).token == TOKEN  # the file wins, stripped
    monkeypatch.delenv("KVSERVER_TOKEN_FILE")
    assert config_from_args(build_parser().parse_args(argv)).token == "from-env"


# ---- limits --------------------------------------------------------------------------------------------


def test_client_limit(make_daemon, parties, unmapped) -> None:
    d = make_daemon(max_clients=2)
    for seed in range(2):
        p = Party(d.address, seed=seed)
        parties.append(p)
        p.store(p.alloc(32), list(range(32)))
    world = World(parties)
    third = unmapped(seed=3)
    world.reject(C.RESOURCE_EXHAUSTED, "client limit reached: 2 clients are registered",
                 lambda: parties[0].call("Register", _register_request(third, fd_socket=_fd(d))))
    assert _mappings_of(third.name) == []
    # Positive control: once a client leaves, the same request registers.
    parties[1].call("Unregister", pb.UnregisterRequest(client_id=parties[1].cid))
    resp = parties[0].call("Register", _register_request(third, fd_socket=_fd(d)))
    assert resp.host_tokens == 256 and _mappings_of(third.name) != []
    parties[0].call("Unregister", pb.UnregisterRequest(client_id=resp.client_id))
    assert _mappings_of(third.name) == []


def test_one_tenant_cannot_take_every_client_slot(make_daemon, parties, unmapped, tmp_path) -> None:
    """Registrations are capped per tenant (--max-clients-per-tenant) as well as in all: a caller
    past its tenant's cap is refused, naming the cap, and another tenant still registers."""
    tokens = tmp_path / "tenants"
    tokens.write_text("other other-tenant-token\n")
    d = make_daemon(max_clients=8, max_clients_per_tenant=2, tenant_tokens=str(tokens))
    for seed in range(2):  # this process's uid: tenant uid:<uid>
        p = Party(d.address, seed=seed)
        parties.append(p)
    world = World(parties)
    third = unmapped(seed=3)
    world.reject(C.RESOURCE_EXHAUSTED, f"tenant uid:{os.getuid()} holds 2 registrations, its limit",
                 lambda: parties[0].call("Register", _register_request(third, fd_socket=_fd(d))))
    assert _mappings_of(third.name) == []
    other = Party(d.address, seed=4, metadata=(("x-kvserver-tenant", "other-tenant-token"),))
    parties.append(other)
    assert other.cid
    # A registration replacing one of the tenant's own takes no new place.
    req = _register_request(third, fd_socket=_fd(d))
    req.replaces_client_id = parties[1].cid
    resp = parties[0].call("Register", req)
    parties[0].call("Unregister", pb.UnregisterRequest(client_id=resp.client_id))


def _quota_register(client: KVClient, pool: ShmKVPool, tokens: int, least: int | None = None):
    return client.register(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=tokens, page_size=PAGE, min_host_tokens=least)


def test_one_tenants_regions_stay_under_its_region_quota(make_daemon, tmp_path) -> None:
    """The host memory one tenant's registrations take together is capped (--tenant-region-quota):
    without it one uid's registrations could take the whole budget (and evict every tenant's
    cache for it). Past the quota a registration is granted what is left, down to the least it
    accepts, else refused naming the quota; another tenant is not held to the first's use, and an
    Unregister gives its region's share back. A region counts as the arena takes it: whole 2 MiB
    units, however few pages it holds."""
    tokens = tmp_path / "tenants"
    tokens.write_text("other other-tenant-token\n")
    quota = 8 << 20
    d = make_daemon(host_memory=64 << 20, tenant_region_quota="8MiB", tenant_tokens=str(tokens))
    with contextlib.ExitStack() as stack:
        pools = [stack.enter_context(_new_pool(seed=seed)) for seed in range(4)]
        a, b, c = (stack.enter_context(KVClient(d.address, lane="grpc", resilient=False)) for _ in range(3))
        other = stack.enter_context(KVClient(d.address, lane="grpc", tenant_token="other-tenant-token"))
        token_bytes = _quota_register(other, pools[3], PAGE).host_bytes_per_token  # (K and V, every layer)
        other.unregister()
        unit = (2 << 20) // token_bytes  # the tokens of one 2 MiB unit
        assert _quota_register(a, pools[0], 3 * unit).host_tokens == 3 * unit
        with pytest.raises(KVClientError) as err:
            _quota_register(b, pools[1], 3 * unit)
        assert err.value.code == C.RESOURCE_EXHAUSTED, err.value
        assert f"tenant uid:{os.getuid()}'s registrations hold {6 << 20} bytes" in err.value.message \
            and "--tenant-region-quota" in err.value.message, err.value.message
        # What is left, to one that accepts that little.
        assert _quota_register(c, pools[2], 3 * unit, least=PAGE).host_tokens == unit
        assert _quota_register(other, pools[3], 3 * unit).host_tokens == 3 * unit  # its own quota
        c.unregister()
        # A one-page region takes a whole unit of the arena, and of the quota.
        assert _quota_register(b, pools[1], PAGE).host_tokens == PAGE
        with pytest.raises(KVClientError) as err:
            _quota_register(c, pools[2], PAGE)
        assert err.value.code == C.RESOURCE_EXHAUSTED and "--tenant-region-quota" in err.value.message
        assert d.run(lambda: dict(d.core._region_bytes_by_tenant)) == {f"uid:{os.getuid()}": quota,
                                                                        "other": 6 << 20}
        # A registration replacing its own gets the old one's share back; one that could not fit
        # even so is refused before anything changes: the registration it names stays.
        old = b.registration.client_id
        assert _quota_register(b, pools[1], unit, least=unit).host_tokens == unit
        assert b.registration.client_id != old
        old = b.registration.client_id
        with pytest.raises(KVClientError) as err:
            _quota_register(b, pools[1], 2 * unit)
        assert err.value.code == C.RESOURCE_EXHAUSTED, err.value
        assert "the registration it names stays" in err.value.message, err.value.message
        assert d.run(lambda: old in d.core.clients)
        for client in (a, b, other):
            client.unregister()
        assert d.run(lambda: dict(d.core._region_bytes_by_tenant)) == {}  # every region given back


LIMIT = 64  # max_request_indices


@pytest.fixture
def limited(make_daemon, parties) -> tuple[DaemonThread, Party, list[int]]:
    """A daemon with a 64-index request limit and a 1 MiB message limit; one client that stored
    pages 0..4 (80 host slots, all allocated: 64 + 16, since one Alloc of 80 is over the limit)."""
    d = make_daemon(max_request_indices=LIMIT, max_message_bytes=1 << 20)
    p = Party(d.address)
    parties.append(p)
    first = p.alloc(LIMIT)  # exactly at the limit: allowed
    second = p.alloc(PAGE)
    p.store(first, list(range(LIMIT)))  # a Write of exactly 64 indices is allowed too
    p.store(second, list(range(LIMIT, LIMIT + PAGE)))
    assert p.loaded_back_sha() == p.stored_sha
    return d, p, first + second


@pytest.mark.parametrize("method", ["Write", "Load", "Free"])
def test_request_index_limit(limited, method: str) -> None:
    _, p, host = limited
    assert len(host) == 80
    device = list(range(96, 176))
    request = {
        "Write": pb.WriteRequest(client_id=p.cid, host_indices=host, device_indices=device),
        "Load": pb.LoadRequest(client_id=p.cid, host_indices=host, device_indices=device),
        "Free": pb.FreeRequest(client_id=p.cid, host_indices=host),
    }[method]
    World([p]).reject(C.RESOURCE_EXHAUSTED, f"80 indices in one request; the limit is {LIMIT}",
                      lambda: p.call(method, request))


@pytest.mark.parametrize("num_tokens", [80, LIMIT + 1], ids=["80", "65-rounds-to-80"])
def test_alloc_over_the_request_limit(limited, num_tokens: int) -> None:
    _, p, _ = limited
    stats = p.call("Stats", pb.StatsRequest(client_id=p.cid)).clients[0]
    assert stats.capacity_tokens - stats.used_tokens >= 80  # the region has room: the limit refuses it
    World([p]).reject(C.RESOURCE_EXHAUSTED, f"80 indices in one request; the limit is {LIMIT}",
                      lambda: p.call("Alloc", pb.AllocRequest(client_id=p.cid, num_tokens=num_tokens)))


def test_message_size_limit(limited) -> None:
    d, p, host = limited
    n = 200_000
    req = pb.WriteRequest(client_id=p.cid, host_indices=(host * (n // len(host) + 1))[:n],
                          device_indices=[i % 96 for i in range(n)])
    assert req.ByteSize() > 1 << 20
    world = World([p])
    message = world.reject(C.RESOURCE_EXHAUSTED, "", lambda: p.call("Write", req))
    assert "larger than max" in message and str(1 << 20) in message, message
    # The daemon is still healthy and serving this client.
    assert health(d.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert p.call("Free", pb.FreeRequest(client_id=p.cid, host_indices=host[:PAGE])).freed_tokens == PAGE


@pytest.mark.parametrize("method", ["Write", "Load"])
def test_layer_list_longer_than_the_range_is_refused_before_per_id_work(limited, monkeypatch, method) -> None:
    """No valid layers list is longer than the client's range (ascending, no repeats), so a longer one
    must be refused up front, not after a Python call per id (here 100k ids; 64M fit in a message)."""
    from kvserver.protocol.layout import LayerRange

    calls = 0
    to_local = LayerRange.to_local

    def counting(self, layer_id):
        nonlocal calls
        calls += 1
        return to_local(self, layer_id)

    monkeypatch.setattr(LayerRange, "to_local", counting)
    _, p, host = limited
    cls = pb.WriteRequest if method == "Write" else pb.LoadRequest
    req = cls(client_id=p.cid, host_indices=host[:PAGE], device_indices=range(96, 112), layers=[0] * 100_000)
    World([p]).reject(C.INVALID_ARGUMENT, "layer", lambda: p.call(method, req))
    assert calls <= LAYERS, f"{calls} per-id calls for a list that could be refused by its length"


def test_host_memory_budget(make_daemon, parties, unmapped) -> None:
    d = make_daemon(host_memory=4 << 20)
    p = Party(d.address)
    parties.append(p)
    p.store(p.alloc(32), list(range(32)))
    world = World(parties)
    # One page of this pool (1 layer x K,V x 4096 tokens x 16 heads x 128 dims x bf16) is 32 MiB.
    big = unmapped(layout=KVLayout.mha(16, 128), num_layers=1, num_tokens=1)
    req = _register_request(big, host_tokens=1, page_size=4096, fd_socket=_fd(d))
    world.reject(C.RESOURCE_EXHAUSTED, f"no host memory left for one page of {32 << 20} bytes",
                 lambda: p.call("Register", req))
    assert _mappings_of(big.name) == []
    # Take the rest of the budget; then even the smallest registration is refused.
    greedy = Party(d.address, host_tokens=10**12, min_host_tokens=PAGE, seed=1)
    parties.append(greedy)
    stats = p.call("Stats", pb.StatsRequest())
    assert stats.reserved_bytes == stats.capacity_bytes == 4 << 20
    small = unmapped(seed=2)
    world.reject(C.RESOURCE_EXHAUSTED, "no host memory left for one page of 2048 bytes (0 of",
                 lambda: p.call("Register", _register_request(small, host_tokens=PAGE, fd_socket=_fd(d))))
    assert _mappings_of(small.name) == []


# ---- a client can only name its own pages ---------------------------------------------------------------


def test_other_clients_pages_are_refused(make_daemon, parties) -> None:
    d = make_daemon()
    a, b = Party(d.address, seed=1), Party(d.address, seed=2)
    parties += [a, b]
    a_host, b_host = a.alloc(32), b.alloc(32)
    assert a.epoch != b.epoch
    # Both regions start at slot 0: without the epoch the indices would name the same slots.
    assert [h & SLOT_MASK for h in a_host] == [h & SLOT_MASK for h in b_host] == list(range(32))
    a.store(a_host, list(range(32)))
    b.store(b_host, list(range(32, 64)))
    world = World([a, b])
    other = f"belongs to registration epoch {b.epoch}, not this client's epoch {a.epoch}"
    dev = list(range(96, 128))

    def attempts(cid: str, host: list[int]) -> dict[str, object]:
        return {
            "Write": pb.WriteRequest(client_id=cid, host_indices=host, device_indices=dev),
            "Load": pb.LoadRequest(client_id=cid, host_indices=host, device_indices=dev),
            "Free": pb.FreeRequest(client_id=cid, host_indices=host),
        }

    for method, req in attempts(a.cid, b_host).items():
        world.reject(C.FAILED_PRECONDITION, other, lambda m=method, r=req: a.call(m, r))
    # One of A's own pages and one of B's: all or nothing.
    mixed = a_host[:PAGE] + b_host[PAGE:]
    for method, req in attempts(a.cid, mixed).items():
        world.reject(C.FAILED_PRECONDITION, other, lambda m=method, r=req: a.call(m, r))
    # A's indices under B's client id.
    theirs = f"belongs to registration epoch {a.epoch}, not this client's epoch {b.epoch}"
    for method, req in attempts(b.cid, a_host).items():
        world.reject(C.FAILED_PRECONDITION, theirs, lambda m=method, r=req: b.call(m, r))
    # B's epoch on a slot B never allocated is refused by B's allocator, not mistaken for A's page.
    forged = [(b.epoch << EPOCH_SHIFT) | s for s in range(32, 48)]
    world.reject(C.FAILED_PRECONDITION, "host page 2 is not allocated to this client",
                 lambda: b.call("Free", pb.FreeRequest(client_id=b.cid, host_indices=forged)))


def test_stats_show_a_peer_its_own_clients_and_everything_only_to_the_admin(make_daemon, parties) -> None:
    d = make_daemon(admin_token="the-admin-token")
    a, b = Party(d.address, seed=1), Party(d.address, seed=2)
    parties += [a, b]
    # Without the admin token: totals only, no other client's model, ranks or epoch.
    anyone = a.call("Stats", pb.StatsRequest())
    assert anyone.num_clients == 2 and list(anyone.clients) == []
    for wrong in ("", "the-admin-toke", "the-admin-token-"):
        got = _stub_call(d.address, "Stats", pb.StatsRequest(), (("x-kvserver-admin", wrong),))
        assert list(got.clients) == []
    # Its own client, by the id it holds.
    own = a.call("Stats", pb.StatsRequest(client_id=a.cid)).clients
    assert [c.client_id for c in own] == [a.cid]
    # The admin sees every client, each id shortened: an id is its client's bearer capability.
    admin = _stub_call(d.address, "Stats", pb.StatsRequest(), (("x-kvserver-admin", "the-admin-token"),))
    assert {c.client_id for c in admin.clients} == {a.cid[:8] + "...", b.cid[:8] + "..."}
    code, _ = _error_of(lambda: a.call("Alloc", pb.AllocRequest(client_id=b.cid[:8] + "...", num_tokens=1)))
    assert code == C.NOT_FOUND


def test_the_daemon_never_logs_a_client_id(make_daemon, parties, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    d = make_daemon(lease=0.3)  # a party holds no session: reclaimed once its lease is over
    a = Party(d.address, seed=1)
    parties.append(a)
    a.call("Unregister", pb.UnregisterRequest(client_id=a.cid))
    b = Party(d.address, seed=2)
    parties.append(b)
    # A space id is one too: opened, asked, its events read and a lease released.
    space = pb.KVSpace(model="m", layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=8)),
                       dtype=pb.DTYPE_FLOAT16, page_size=PAGE, num_layers=LAYERS)
    sid = b.call("OpenSpace", pb.OpenSpaceRequest(space=space, peer_ticket=get_ticket(
        fd_socket_path(d.address), []))).space_id
    found = b.call("Lookup", pb.LookupRequest(space_id=sid, keys=b"k" * 16, key_bytes=16, pin_ms=1000))
    b.call("Events", pb.EventsRequest(space_id=sid))
    b.call("Release", pb.ReleaseRequest(space_id=sid, lease_ids=[found.lease_id] if found.lease_id else []))
    deadline = time.monotonic() + 10
    while d.run(lambda: len(d.core.clients)):
        assert time.monotonic() < deadline, "the lease did not run out"
        time.sleep(0.02)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "registered" in text and "reclaiming" in text and a.cid[:8] in text and b.cid[:8] in text
    for cid in (a.cid, b.cid, sid):
        assert cid not in text, "a client or space id (a bearer capability) was logged whole"


def test_socket_directory_created_owner_only_and_traversable(socket_dir) -> None:
    """A socket directory the daemon creates is 0700: private, but usable by its owner."""
    path = os.path.join(socket_dir, "fresh", "nested", "kv.sock")
    d = DaemonThread(ServerConfig(socket=path, host_memory=8 << 20))
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        d.stop()


def test_the_unix_socket_is_never_anonymous(daemon) -> None:
    """Every caller on the Unix socket is a process of the node with a uid: an OpenSpace or a
    Register there names it with a peer ticket (or a tenant token), else it is refused; it never
    lands in the anonymous tenant, whose pages a TCP caller without a token would share."""
    space = pb.KVSpace(model="m", layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=8)),
                       dtype=pb.DTYPE_FLOAT16, page_size=PAGE, num_layers=LAYERS)
    fds = fd_socket_path(daemon.address)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.KVServerStub(channel)
        code, message = _error_of(lambda: stub.OpenSpace(pb.OpenSpaceRequest(space=space), timeout=TIMEOUT))
        assert code == C.UNAUTHENTICATED and "peer ticket" in message, message
        named = pb.RegisterRequest(model="m", tp_size=1, pp_size=1, start_layer=0, end_layer=LAYERS,
                                   num_layers=LAYERS, layout=space.layout, dtype=pb.DTYPE_FLOAT16,
                                   page_size=PAGE, host_tokens=0)
        code, message = _error_of(lambda: stub.Register(named, timeout=TIMEOUT))
        assert code == C.UNAUTHENTICATED and "peer ticket" in message, message
        opened = stub.OpenSpace(pb.OpenSpaceRequest(space=space, peer_ticket=get_ticket(fds, [])),
                                timeout=TIMEOUT)
        assert opened.tenant == f"uid:{os.getuid()}"
    assert daemon.core.clients == {}
