"""Shared-memory pools reach the daemon as sealed memfds over the fd socket, never by a name the
daemon opens for its caller.

- Confused deputy: a process of another uid, let in through a 0660 socket, cannot make the
  (root) daemon read or write a root-owned 0600 object, with or without --allow-named-shm, and
  cannot name descriptors it did not send.
- SIGBUS: an engine cannot truncate its pool (sealed), so the daemon survives and serves others;
  an unsealed (or otherwise unfit) descriptor is refused at Register.
- Leaks: a SIGKILLed engine leaves nothing in /dev/shm, and nothing mapped in the daemon.
- Tickets: one use, expiry closes their descriptors, one peer's ticket names only its own
  descriptors, per-uid caps, and malformed fd-socket traffic is answered or dropped without
  disturbing the daemon.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from checks import error_of, mappings_of
from daemon_proc import DaemonProcess
from light_engine import LightEngine, killed_mid_load

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvclient._messages import register_request
from kvclient._transport.fd_socket import get_ticket
from kvserver.__main__ import build_parser, config_from_args
from kvserver.config import ServerConfig
from kvserver.peers.fd_socket import MAX_CONNS_PER_UID
from kvserver.protocol import shared_memory
from kvserver.protocol.fd_socket import MAX_FDS, fd_socket_path
from kvserver.protocol.shared_memory import SHM_DIR, create_memfd, create_shm, unlink_shm
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

C = grpc.StatusCode
NOBODY = 65534
TIMEOUT = 10.0
LAYOUT = KVLayout.mha(2, 8)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.01)


def fds_to(label: str, pid: int | None = None) -> int:
    """Descriptors of process ``pid`` (default this one) open on the memfd labelled ``label``."""
    base = f"/proc/{pid or os.getpid()}/fd"
    n = 0
    for fd in os.listdir(base):
        try:
            n += os.readlink(os.path.join(base, fd)) == f"/memfd:{label} (deleted)"
        except OSError:
            pass
    return n


def stub_of(d) -> pb_grpc.KVServerStub:
    return pb_grpc.KVServerStub(grpc.insecure_channel(d.address))


def pool_request(pool: ShmKVPool, ticket: str = "") -> pb.RegisterRequest:
    return register_request(model="m", pool=pool, start_layer=0, end_layer=pool.num_layers,
                            num_layers=pool.num_layers, host_tokens=64, page_size=16, tp_rank=0, tp_size=1,
                            pp_rank=0, pp_size=1, peer_ticket=ticket)


def fd_path(d) -> str:
    return fd_socket_path(d.config.socket)


def num_clients(d) -> int:
    return d.run(lambda: len(d.core.clients))


def replacing(d, pool: ShmKVPool, client_id: str) -> pb.RegisterRequest:
    """A Register of ``pool`` naming ``client_id`` as the registration it replaces."""
    request = pool_request(pool, get_ticket(fd_path(d), pool.fds))
    request.replaces_client_id = client_id
    return request


def registered_at_once(d, requests: list[pb.RegisterRequest]) -> tuple[list, list[str], int]:
    """The Registers sent at once: their answers, then the registrations and region bytes the
    daemon holds."""
    with ThreadPoolExecutor(len(requests)) as ex:
        answers = list(ex.map(lambda r: stub_of(d).Register(r, timeout=TIMEOUT), requests))
    clients, reserved = d.run(lambda: (list(d.core.clients), d.core.arena.reserved))
    return answers, clients, reserved


# ---- confused deputy ---------------------------------------------------------------------------


@pytest.mark.parametrize("allow_named", [False, True], ids=["default", "allow-named-shm"])
def test_another_uid_cannot_make_the_daemon_touch_what_it_cannot_open(daemon_factory, socket_dir,
                                                                     allow_named) -> None:
    os.chmod(socket_dir, 0o755)
    d = daemon_factory(socket_group_access=True, allow_named_shm=allow_named)
    name = f"kvtest-root-{os.urandom(4).hex()}"
    size = 2 * 64 * 32
    root = create_shm(name, size)  # mode 0600, owned by root
    try:
        root.mm[:] = os.urandom(size)
        before = hashlib.sha256(root.mm).hexdigest()
        root.close()
        peer = os.path.join(os.path.dirname(__file__), "fd_peer.py")
        res = subprocess.run([sys.executable, peer, str(NOBODY), d.config.socket, name],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got["uid"] == NOBODY and got["can_open"] is False
        if allow_named:
            assert got["named"][0] == "PERMISSION_DENIED", got["named"]
            assert f"is owned by uid 0, not by the caller (uid {NOBODY})" in got["named"][1]
        else:
            assert got["named"][0] == "PERMISSION_DENIED", got["named"]
            assert "--allow-named-shm" in got["named"][1]
        assert got["named-no-ticket"][0] == "UNAUTHENTICATED", got  # never anonymous on the Unix socket
        assert got["fd-not-sent"] == ["INVALID_ARGUMENT", "device_pool buffer 0 names fd 0 but the peer "
                                      "ticket carries 0 descriptor(s)"]
        assert got["fd-not-sent-no-ticket"][0] == "UNAUTHENTICATED"
        assert "needs a peer ticket" in got["fd-not-sent-no-ticket"][1]
        assert got["fd-past-own"][0] == "INVALID_ARGUMENT" and "names fd 1" in got["fd-past-own"][1]
        # The control: the same process may register memory it owns, and the daemon knows who it is.
        assert got["own-memfd"][0] == "OK", got["own-memfd"]
        peer = d.run(lambda: d.core.clients[got["own-memfd"][1]].peer)
        assert (peer.uid, peer.gid) == (NOBODY, NOBODY)
        assert num_clients(d) == 1
        assert mappings_of(name) == [], "the daemon mapped root's object"
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == before
    finally:
        unlink_shm(name)


def test_named_objects_need_the_flag_and_a_ticket(daemon_factory) -> None:
    off = daemon_factory()
    on = daemon_factory(allow_named_shm=True)
    pool = ShmKVPool(LAYOUT, torch.float16, 1, 64, name=f"kvtest-named-{os.urandom(4).hex()}")
    try:
        pool.unmap()
        code, message = error_of(lambda: stub_of(off).Register(
            pool_request(pool, get_ticket(fd_path(off), [])), timeout=TIMEOUT))
        assert code == C.PERMISSION_DENIED and "--allow-named-shm" in message
        code, message = error_of(lambda: stub_of(on).Register(pool_request(pool), timeout=TIMEOUT))
        assert code == C.UNAUTHENTICATED and "needs a peer ticket" in message
        assert mappings_of(pool.name) == []
        resp = stub_of(on).Register(pool_request(pool, get_ticket(fd_path(on), [])), timeout=TIMEOUT)
        assert mappings_of(pool.name) != []
        stub_of(on).Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)
        assert mappings_of(pool.name) == []
    finally:
        pool.close()


def test_flag_and_variable_turn_named_shm_on() -> None:
    assert config_from_args(build_parser().parse_args(["--allow-named-shm"])).allow_named_shm
    assert not config_from_args(build_parser().parse_args([])).allow_named_shm
    os.environ["KVSERVER_ALLOW_NAMED_SHM"] = "1"
    try:
        assert config_from_args(build_parser().parse_args([])).allow_named_shm
    finally:
        del os.environ["KVSERVER_ALLOW_NAMED_SHM"]


def test_a_daemon_without_a_unix_socket_refuses_shm_pools() -> None:
    d = _tcp_only_daemon()
    try:
        with ShmKVPool(LAYOUT, torch.float16, 1, 64) as pool, KVClient(f"127.0.0.1:{d.daemon.ports[0]}",
                                                                      resilient=False) as c:
            with pytest.raises(KVClientError) as err:
                c.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=64)
            assert err.value.code == C.FAILED_PRECONDITION
            assert "need the daemon's Unix socket" in err.value.message
    finally:
        d.stop()


def _tcp_only_daemon():
    from conftest import DaemonThread

    return DaemonThread(ServerConfig(socket=None, listen="127.0.0.1:0", insecure_tcp=True,
                                     host_memory=64 << 20))


# ---- the fd socket ----------------------------------------------------------------------------


@pytest.mark.parametrize("group", [False, True], ids=["0600", "0660"])
def test_fd_socket_sits_beside_the_grpc_socket_with_its_mode(daemon_factory, group) -> None:
    d = daemon_factory(socket_group_access=group)
    st = os.stat(fd_path(d))
    assert st.st_mode & 0o777 == (0o660 if group else 0o600)
    d.stop()
    assert not os.path.exists(fd_path(d)) and not os.path.exists(d.config.socket)


def test_the_fd_socket_is_there_before_the_grpc_socket(daemon_factory, monkeypatch) -> None:
    """A client that finds the gRPC socket (a supervisor polling for it, a test helper) can
    register at once: the fd socket its Register needs was bound before it."""
    from kvserver.peers.fd_socket import PeerSocket

    seen: list[bool] = []
    start = PeerSocket.start

    def observed(self) -> None:
        seen.append(os.path.exists(self.path[: -len(".fd")]))
        start(self)

    monkeypatch.setattr(PeerSocket, "start", observed)
    d = daemon_factory()
    assert seen == [False], "the gRPC socket was bound before the fd socket"
    assert os.path.exists(fd_path(d))


# ---- SIGBUS: seals ------------------------------------------------------------------------------


def test_an_engine_cannot_truncate_its_pool_and_the_daemon_keeps_serving(socket_dir) -> None:
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--progress-interval-ms", "0")
    layers, tokens = 32, 4096
    try:
        with ShmKVPool(KVLayout.mha(4, 64), torch.float16, layers, tokens) as pool, \
                KVClient(d.address, resilient=False, timeout=30) as client:
            client.register(model="big", pool=pool, start_layer=0, end_layer=layers, num_layers=layers,
                            host_tokens=tokens, page_size=16)
            host = client.alloc(tokens)
            dev = torch.arange(tokens)
            assert client.write(host_indices=host, device_indices=dev) > 0
            handle = client.load(host_indices=host, device_indices=dev)
            assert handle.wait_layer(0, 30)
            with pytest.raises(PermissionError):
                os.ftruncate(pool.fds[0], 0)  # mid-load: F_SEAL_SHRINK says no
            with pytest.raises(PermissionError):
                os.ftruncate(pool.fds[0], pool.buffer_bytes * layers * 4)  # F_SEAL_GROW
            assert handle.wait(30) > 0
            assert d.proc.poll() is None, "the daemon died"
            # Another engine is served as before.
            other = LightEngine(d.address, f"kvtest-other-{os.urandom(4).hex()}")
            try:
                rng = np.random.default_rng(0)
                h, s = other.alloc(64), np.arange(64, dtype=np.int64)
                other.fill(s, rng)
                want = other.digest(s)
                other.write(h, s)
                other.kv[:] = 0
                other.load(h, s)
                assert other.digest(s) == want
            finally:
                other.close()
            client.unregister()
    finally:
        assert d.stop() == 0


def _unsealed() -> int:
    fd = os.memfd_create("kvtest-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 20)
    return fd


def _grow_sealed() -> int:
    fd = os.memfd_create("kvtest-grow", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    return fd


def _read_only() -> int:
    fd, mapping = create_memfd("kvtest-ro", 1 << 20)
    mapping.close()
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return ro


def _write_sealed() -> int:
    fd = os.memfd_create("kvtest-wseal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    return fd


def _pipe() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def _disk_file() -> int:
    with tempfile.TemporaryFile() as f:
        f.truncate(1 << 20)
        return os.dup(f.fileno())


def _huge_pages() -> int:
    """hugetlbfs, sealed against shrinking: copying into it faults once huge pages run out."""
    fd = os.memfd_create("kvtest-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _small() -> int:
    fd, mapping = create_memfd("kvtest-small", 1000)
    mapping.close()
    return fd


BAD_FDS = [
    pytest.param(_unsealed, C.FAILED_PRECONDITION, "is not sealed against shrinking", id="unsealed"),
    pytest.param(_grow_sealed, C.FAILED_PRECONDITION, "is not sealed against shrinking", id="grow-seal-only"),
    pytest.param(_read_only, C.INVALID_ARGUMENT, "fd 0 is not open read-write", id="read-only"),
    pytest.param(_write_sealed, C.INVALID_ARGUMENT, "cannot be mapped read-write", id="write-sealed"),
    pytest.param(_small, C.INVALID_ARGUMENT, "fd 0 is 1000 bytes but the buffer at offset", id="too-small"),
    pytest.param(_huge_pages, C.INVALID_ARGUMENT, "fd 0 is huge-page memory", id="hugetlb"),
]


@pytest.mark.parametrize(("make", "code", "text"), BAD_FDS)
def test_an_unfit_fd_is_refused_at_register(daemon, make, code, text) -> None:
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)  # its descriptor() names fd 0 of the ticket
    fd = make()
    try:
        req = pool_request(pool, get_ticket(fd_path(daemon), [fd]))
        got, message = error_of(lambda: stub_of(daemon).Register(req, timeout=TIMEOUT))
        assert got == code and text in message, (got, message)
        assert num_clients(daemon) == 0
        assert daemon.run(lambda: daemon.core.arena.reserved) == 0
    finally:
        os.close(fd)
        pool.close()


def test_a_pool_shrunk_and_sealed_while_the_daemon_checks_it_is_mapped_at_its_sealed_size(
        daemon, monkeypatch) -> None:
    """A peer that sends an unsealed memfd and, as the daemon asks for its seals, truncates it and
    seals it there: the size the daemon maps and bounds the pool by is the one the seal fixes, so
    the pool is refused as too small (mapped at its old size, the first copy past the new end would
    be SIGBUS in the daemon)."""
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    fd = os.memfd_create("kvtest-shrunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    real = fcntl.fcntl

    def peer_at_the_seal_check(f: int, cmd: int, *arg):  # the peer's timing, which cannot be forced
        if cmd == fcntl.F_GET_SEALS and sys._getframe(1).f_code is shared_memory.map_sealed_fd.__code__:
            os.ftruncate(fd, 4096)
            real(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return real(f, cmd, *arg)

    monkeypatch.setattr(shared_memory.fcntl, "fcntl", peer_at_the_seal_check)
    try:
        req = pool_request(pool, get_ticket(fd_path(daemon), [fd]))
        got, message = error_of(lambda: stub_of(daemon).Register(req, timeout=TIMEOUT))
        assert got == C.INVALID_ARGUMENT and "fd 0 is 4096 bytes but the buffer at offset" in message, \
            (got, message)
        assert num_clients(daemon) == 0
    finally:
        monkeypatch.undo()
        os.close(fd)
        pool.close()


def _lingering_tcp_socket(seconds: int = 10) -> int:
    """A TCP socket whose last close() waits ``seconds`` for data its peer never reads (SO_LINGER):
    the descriptor a hostile engine sends to stall whoever closes it."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sender = socket.socket()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender.connect(listener.getsockname())
    receiver, _ = listener.accept()  # never reads
    sender.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            sender.send(b"x" * 65536)
    sender.setblocking(True)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, seconds))
    _LINGERING.extend([listener, receiver])  # kept open so that the data stays unread
    return sender.detach()


_LINGERING: list[socket.socket] = []


@pytest.fixture(autouse=True, scope="module")
def _lingering_closed() -> Iterator[None]:
    """The ends ``_lingering_tcp_socket`` keeps open, closed once the module's tests are over."""
    yield
    while _LINGERING:
        _LINGERING.pop().close()


def _seqpacket_pair_end() -> int:
    """One end of a Unix SOCK_SEQPACKET pair, the other closed (what a lane's doorbells were, when
    the engine made them)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.close()
    return a.detach()


def _dev_null() -> int:
    return os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)


def _directory() -> int:
    return os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


NOT_SHARED_MEMORY = [
    pytest.param(_pipe, "a pipe", id="pipe"),
    pytest.param(_disk_file, "a file outside shared memory", id="disk-file"),
    pytest.param(_lingering_tcp_socket, "a socket", id="tcp-socket"),
    pytest.param(_seqpacket_pair_end, "a socket", id="unix-seqpacket-socket"),
    pytest.param(_dev_null, "a file outside shared memory", id="char-device"),
    pytest.param(_directory, "a file outside shared memory", id="directory"),
]


@pytest.mark.parametrize(("make", "kind"), NOT_SHARED_MEMORY)
def test_a_descriptor_that_is_not_shared_memory_is_refused_at_the_fd_socket(daemon, make, kind) -> None:
    """Only what a pool or a lane can use is kept under a ticket: any other descriptor (one that
    could block whoever closes it) is refused, with its index and kind, and closed off the loop."""
    good, mapping = create_memfd("kvtest-good", 4096)
    mapping.close()
    bad = make()
    try:
        with pytest.raises(KVClientError) as err:
            get_ticket(fd_path(daemon), [good, bad])
        assert err.value.code == C.INVALID_ARGUMENT, err.value
        assert f"descriptor 1 is {kind}" in err.value.message, err.value.message
        assert daemon.run(lambda: daemon.core.tickets.num_fds) == 0
    finally:
        os.close(good)
        os.close(bad)
    wait_until(lambda: fds_to("kvtest-good") == 0, what="the refused peer's descriptors closed")
    _still_serves(daemon)


def test_sockets_set_to_linger_never_hold_the_daemon(daemon) -> None:
    """Eight peers each send a memfd and a TCP socket set to linger 10 s over unread data, then
    close their own ends, so the daemon's copy is the last: every one is refused, closed at once,
    and another engine's Register and calls go through as on an idle daemon."""
    good, mapping = create_memfd("kvtest-linger", 4096)
    mapping.close()
    try:
        for _ in range(8):
            sock = _lingering_tcp_socket(10)
            try:
                with pytest.raises(KVClientError) as err:
                    get_ticket(fd_path(daemon), [good, sock])
                assert err.value.code == C.INVALID_ARGUMENT
            finally:
                os.close(sock)  # the daemon's copy is now the last reference
    finally:
        os.close(good)
    started = time.monotonic()
    _still_serves(daemon)
    assert time.monotonic() - started < 3.0


def test_a_daemon_out_of_descriptors_says_so(socket_dir) -> None:
    """A daemon at its descriptor limit answers RESOURCE_EXHAUSTED naming it, not 'too many
    descriptors in one message' (the kernel truncates the descriptors it cannot install)."""
    path = os.path.join(socket_dir, "kv.sock")
    log = open(os.path.join(socket_dir, "daemon.log"), "wb")  # noqa: SIM115 (closed below)
    # The limit is set by a shell the daemon then replaces, not by a preexec_fn: Python code run in
    # a child forked from this multithreaded process (gRPC's threads) can hang on a lock held at
    # the fork, and the daemon then never starts.
    proc = subprocess.Popen(["bash", "-c", 'ulimit -n 128 && exec "$0" "$@"', sys.executable,
                             "-m", "kvserver", "--socket", path, "--host-memory", "64MiB"], stderr=log)
    fd, mapping = create_memfd("kvtest-exhaust", 4096)
    mapping.close()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"the daemon did not start (exit {proc.poll()}): "
                + open(os.path.join(socket_dir, "daemon.log"), errors="replace").read()[-2000:])
            time.sleep(0.02)
        with pytest.raises(KVClientError) as err:
            get_ticket(fd_socket_path(path), [fd] * 250)  # one message: more than it can install
        assert err.value.code == C.RESOURCE_EXHAUSTED, err.value
        assert "the daemon is out of descriptors (its limit is 128)" in err.value.message

        def small_ticket() -> bool:  # goes through once the refused descriptors are closed
            try:
                return bool(get_ticket(fd_socket_path(path), [fd]))
            except KVClientError as exc:
                assert exc.code == C.RESOURCE_EXHAUSTED, exc
                return False

        wait_until(small_ticket, what="a one-descriptor ticket")
    finally:
        os.close(fd)
        proc.terminate()
        proc.wait(30)
        log.close()


# ---- leaks --------------------------------------------------------------------------------------


def test_a_killed_engine_leaves_nothing_in_dev_shm_nor_in_the_daemon(socket_dir) -> None:
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--progress-interval-ms", "0",
                      "--reclaim-grace-seconds", "0.2")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["light_engine"])
    name = f"kvtest-leak-{os.urandom(4).hex()}"
    try:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=killed_mid_load, args=(d.address, name, child))
        proc.start()
        assert parent.poll(60) and parent.recv() == b"loading"
        assert not [n for n in os.listdir(SHM_DIR) if name in n], "the pool has a name in /dev/shm"
        assert [m for m in d.shm_maps() if name in m], "the daemon does not map the pool"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        d.wait_for(lambda s: s.num_clients == 0 and s.reserved_bytes == 0, timeout=5)
        assert not [n for n in os.listdir(SHM_DIR) if name in n], "the dead engine left its pool in /dev/shm"
        assert not [m for m in d.shm_maps() if name in m], "the daemon still maps the dead engine's pool"
        assert fds_to(name, d.pid) == 0, "the daemon still holds a descriptor of the pool"
    finally:
        assert d.stop() == 0


def test_closing_a_pool_leaves_nothing_behind(daemon) -> None:
    before = set(os.listdir(SHM_DIR))
    with ShmKVPool(LAYOUT, torch.float16, 2, 256) as pool, KVClient(daemon.address) as c:
        c.register(model="m", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=64)
        name = pool.name
        # The pool's own, its mapping's (Python's mmap keeps a duplicate), the daemon's mapping's.
        assert fds_to(name) == 3
        c.unregister()
        assert fds_to(name) == 2
    assert fds_to(name) == 0 and not mappings_of(name)
    assert not [n for n in set(os.listdir(SHM_DIR)) - before if name in n]


# ---- tickets ------------------------------------------------------------------------------------


def test_a_ticket_is_good_for_one_register(daemon) -> None:
    with ShmKVPool(LAYOUT, torch.float16, 2, 256) as pool:
        req = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        resp = stub_of(daemon).Register(req, timeout=TIMEOUT)
        assert daemon.run(lambda: daemon.core.clients[resp.client_id].peer.pid) == os.getpid()
        code, message = error_of(lambda: stub_of(daemon).Register(req, timeout=TIMEOUT))
        assert code == C.PERMISSION_DENIED and "unknown, expired or already used" in message
        assert num_clients(daemon) == 1
        # A Register that fails still spends its ticket.
        bad = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        bad.device_pool.num_tokens = 10**6  # more than the memfd holds
        assert error_of(lambda: stub_of(daemon).Register(bad, timeout=TIMEOUT))[0] == C.INVALID_ARGUMENT
        bad.device_pool.num_tokens = 256
        assert error_of(lambda: stub_of(daemon).Register(bad, timeout=TIMEOUT))[0] == C.PERMISSION_DENIED
        assert daemon.run(lambda: len(daemon.core.tickets)) == 0
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)


def test_an_unredeemed_ticket_expires_and_its_fds_are_closed(daemon) -> None:
    daemon.run(lambda: setattr(daemon.core.tickets, "ttl", 0.3))
    with ShmKVPool(LAYOUT, torch.float16, 2, 256) as pool:
        pool.unmap()
        ticket = get_ticket(fd_path(daemon), pool.fds)
        assert fds_to(pool.name) == 2  # ours and the ticket's
        wait_until(lambda: fds_to(pool.name) == 1, what="the expired ticket's fd closed")
        req = pool_request(pool, ticket)
        code, message = error_of(lambda: stub_of(daemon).Register(req, timeout=TIMEOUT))
        assert code == C.PERMISSION_DENIED and "expired" in message
        assert num_clients(daemon) == 0 and mappings_of(pool.name) == []


def test_the_ticket_of_a_process_that_exits_before_its_register_goes_with_it(daemon) -> None:
    """An engine that got its ticket and died before its Register left its pool's memfd open in
    the daemon until the ticket's expiry (30 s): a pool of gigabytes, held well past the 2 s a dead
    engine's memory has. The ticket now watches the pidfd it took of its process and expires when
    that process exits."""
    code = (
        "import sys, torch\n"
        "from kvclient import KVLayout, ShmKVPool\n"
        "from kvclient._transport.fd_socket import get_ticket\n"
        "pool = ShmKVPool(KVLayout.mha(2, 8), torch.float16, 2, 256)\n"
        "get_ticket(sys.argv[1], pool.fds)\n"
        "print(pool.name, flush=True)\n"
    )
    assert daemon.run(lambda: daemon.core.tickets.ttl) >= 10  # (its expiry is not what ends it)
    out = subprocess.run([sys.executable, "-c", code, fd_path(daemon)], capture_output=True, text=True,
                         timeout=60, check=True)
    exited = time.monotonic()
    name = out.stdout.strip()
    wait_until(lambda: fds_to(name) == 0, timeout=5, what="the dead process's ticket closed")
    assert time.monotonic() - exited < 2
    assert daemon.run(lambda: len(daemon.core.tickets)) == 0


def test_a_ticket_names_only_its_own_peers_fds(daemon) -> None:
    with ShmKVPool(LAYOUT, torch.float16, 2, 256) as a, ShmKVPool(LAYOUT, torch.float16, 2, 256) as b:
        a.unmap()
        b.unmap()  # any mapping of them is now the (in-process) daemon's
        ta = get_ticket(fd_path(daemon), a.fds)
        tb = get_ticket(fd_path(daemon), b.fds)
        req = pool_request(b, tb)
        for layer in req.device_pool.layers:
            for part in layer.parts:
                part.fd.index = 1  # as if the daemon pooled every peer's fds
        code, message = error_of(lambda: stub_of(daemon).Register(req, timeout=TIMEOUT))
        assert code == C.INVALID_ARGUMENT and "names fd 1 but the peer ticket carries 1" in message
        assert mappings_of(a.name) == [] and mappings_of(b.name) == []
        resp = stub_of(daemon).Register(pool_request(b, get_ticket(fd_path(daemon), b.fds)), timeout=TIMEOUT)
        assert mappings_of(b.name) != [] and mappings_of(a.name) == []
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)
        resp = stub_of(daemon).Register(pool_request(a, ta), timeout=TIMEOUT)  # A's ticket is still good
        assert mappings_of(a.name) != [] and mappings_of(b.name) == []
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)


def test_outstanding_tickets_per_uid_are_capped(daemon) -> None:
    daemon.run(lambda: setattr(daemon.core.tickets, "max_per_uid", 3))
    tickets = [get_ticket(fd_path(daemon), []) for _ in range(3)]
    fd, mapping = create_memfd("kvtest-capped", 4096)
    mapping.close()
    try:
        with pytest.raises(KVClientError) as err:
            get_ticket(fd_path(daemon), [fd])
        assert err.value.code == C.RESOURCE_EXHAUSTED and "3 unredeemed tickets" in err.value.message
        wait_until(lambda: fds_to("kvtest-capped") == 1, what="the refused descriptor closed")
    finally:
        os.close(fd)
    with ShmKVPool(LAYOUT, torch.float16, 2, 256, name=f"kvtest-cap-{os.urandom(4).hex()}") as pool:
        # Redeeming one (here by a refused Register) makes room again.
        error_of(lambda: stub_of(daemon).Register(pool_request(pool, tickets[0]), timeout=TIMEOUT))
    assert get_ticket(fd_path(daemon), [])


def test_descriptors_held_by_one_uids_tickets_are_capped(daemon) -> None:
    """One peer sending the same descriptor over and over cannot run the daemon out of
    descriptors: what its unredeemed tickets hold together is capped, per uid and in all."""
    per_uid = daemon.run(lambda: daemon.core.tickets.max_fds_per_uid)
    fd, mapping = create_memfd("kvtest-fdcap", 4096)
    mapping.close()
    try:
        held: list[str] = []
        with pytest.raises(KVClientError) as err:  # tickets of MAX_FDS until the budget refuses one
            while len(held) <= per_uid // MAX_FDS:
                held.append(get_ticket(fd_path(daemon), [fd] * MAX_FDS))
        assert err.value.code == C.RESOURCE_EXHAUSTED and "too many descriptors" in err.value.message
        # Each ticket counts its descriptors and the pidfd of its process (where the kernel has one).
        assert per_uid - (MAX_FDS + 1) < daemon.run(lambda: daemon.core.tickets.num_fds) <= per_uid
        assert len(held) >= per_uid // (MAX_FDS + 1)
        assert daemon.run(lambda: daemon.core.tickets.max_fds) >= per_uid  # the daemon-wide budget
        with ShmKVPool(LAYOUT, torch.float16, 2, 256) as pool:  # redeemed (here refused): room again
            error_of(lambda: stub_of(daemon).Register(pool_request(pool, held[0]), timeout=TIMEOUT))
        assert get_ticket(fd_path(daemon), [fd])
    finally:
        os.close(fd)
    _still_serves(daemon)


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s


def _send(s: socket.socket, data: bytes, fds: list[int] = ()) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    s.sendmsg([data], anc)


def _header(n: int) -> bytes:
    return b"KVF1" + struct.pack("<I", n)


MALFORMED = {
    "garbage": lambda s, fd: _send(s, b"hello world", [fd]),
    "short-header": lambda s, fd: _send(s, b"KVF1", [fd]),
    "wrong-magic": lambda s, fd: _send(s, b"KVF2" + struct.pack("<I", 1), [fd]),
    "too-many-announced": lambda s, fd: _send(s, _header(MAX_FDS + 1), [fd]),
    "more-than-announced": lambda s, fd: _send(s, _header(1), [fd, fd]),
    "fds-without-header": lambda s, fd: _send(s, b"+", [fd]),
    "bad-continuation": lambda s, fd: (_send(s, _header(3), [fd]), _send(s, b"-", [fd])),
    "long-message": lambda s, fd: _send(s, _header(1) + b"x" * 1000, [fd]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_fd_socket_messages_get_an_error_and_hold_nothing(daemon, case) -> None:
    fd, mapping = create_memfd("kvtest-malformed", 4096)
    mapping.close()
    try:
        with _raw(fd_path(daemon)) as s:
            MALFORMED[case](s, fd)
            reply = s.recv(2048)
            assert reply.startswith(b"EINVALID_ARGUMENT "), reply
            assert s.recv(2048) == b""  # then the daemon closes
        wait_until(lambda: fds_to("kvtest-malformed") == 1, what="the daemon closed the fds it got")
        assert daemon.run(lambda: len(daemon.core.tickets)) == 0
        _still_serves(daemon)
    finally:
        os.close(fd)


def test_a_peer_that_leaves_midway_or_says_nothing_holds_nothing(daemon) -> None:
    daemon.run(lambda: setattr(daemon.daemon.peer_socket, "conn_seconds", 0.3))
    fd, mapping = create_memfd("kvtest-midway", 4096)
    mapping.close()
    try:
        with _raw(fd_path(daemon)) as s:  # announces 2, sends 1, goes away
            _send(s, _header(2), [fd])
        silent = _raw(fd_path(daemon))  # says nothing: dropped after conn_seconds
        slow = _raw(fd_path(daemon))
        _send(slow, _header(2), [fd])  # never sends the rest
        assert silent.recv(2048).startswith(b"EINVALID_ARGUMENT the message did not arrive within")
        assert slow.recv(2048).startswith(b"EINVALID_ARGUMENT")
        silent.close()
        slow.close()
        wait_until(lambda: fds_to("kvtest-midway") == 1, what="the daemon closed the fds it got")
        _still_serves(daemon)
    finally:
        os.close(fd)


def test_idle_connections_of_one_uid_are_capped(daemon) -> None:
    """A uid holding its share of idle connections is refused more (answered, not left hanging),
    and served again once they go. (Connections that stay silent time out: see above.)"""
    daemon.run(lambda: setattr(daemon.daemon.peer_socket, "conn_seconds", 60.0))
    idle = [_raw(fd_path(daemon)) for _ in range(MAX_CONNS_PER_UID)]
    try:
        wait_until(lambda: daemon.run(lambda: len(daemon.daemon.peer_socket._serving)) == MAX_CONNS_PER_UID)
        with pytest.raises(KVClientError) as err:
            get_ticket(fd_path(daemon), [])
        assert err.value.code == C.RESOURCE_EXHAUSTED
        assert "too many fd socket connections" in err.value.message
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: daemon.run(lambda: len(daemon.daemon.peer_socket._serving)) == 0)
    assert get_ticket(fd_path(daemon), [])


def test_many_fds_in_one_ticket(daemon) -> None:
    """More than one SCM_RIGHTS message's worth (253): the pool names the last one."""
    fd, mapping = create_memfd("kvtest-many", 2 * 256 * 32 * 2)
    mapping.close()
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    try:
        fds = [fd] * 600
        req = pool_request(pool, get_ticket(fd_path(daemon), fds))
        for layer in req.device_pool.layers:
            for part in layer.parts:
                part.fd.index = 599
        resp = stub_of(daemon).Register(req, timeout=TIMEOUT)
        # Ours and the daemon's mapping: the other 599 are closed, off the loop (one descriptor the
        # pool does not map may hold the last reference to a large memfd).
        wait_until(lambda: fds_to("kvtest-many") == 2, what="the ticket's other descriptors closed")
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=resp.client_id), timeout=TIMEOUT)
    finally:
        os.close(fd)
        pool.close()


def _still_serves(daemon) -> None:
    with ShmKVPool(LAYOUT, torch.float16, 2, 256) as pool, KVClient(daemon.address, resilient=False) as c:
        c.register(model="m", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=64,
                   page_size=16)
        pool.buffers[0][0][:16] = 1.5
        host = c.alloc(16)
        assert c.write(host_indices=host, device_indices=torch.arange(16)) > 0
        pool.buffers[0][0][:16] = 0
        assert c.load(host_indices=host, device_indices=torch.arange(16)).wait(10) > 0
        assert bool((pool.buffers[0][0][:16] == 1.5).all())
        c.unregister()


def test_a_uids_closer_thread_ends_once_idle_and_a_new_one_closes_what_comes_later(monkeypatch) -> None:
    """Each uid that sent a descriptor other than shared memory got a closer thread of its own,
    kept for the daemon's life: one thread per uid ever seen. It now ends after a while with
    nothing to close, and the next descriptor of that uid starts another."""
    import threading

    from kvserver.peers import tickets

    monkeypatch.setattr(tickets, "CLOSER_IDLE_SECONDS", 0.2)
    uid = 54329

    def closers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == f"kvpeer-close-{uid}"]

    for _ in range(2):
        r, w = os.pipe()
        tickets.close_off_loop([r, w], uid)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_fd_open(fd) for fd in (r, w)):
            time.sleep(0.01)
        assert not any(_fd_open(fd) for fd in (r, w)), "the uid's closer did not close its pipe"
        assert closers(), "no closer of the uid's own"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (closers() or uid in tickets._RISKY):
            time.sleep(0.02)
        assert not closers() and uid not in tickets._RISKY, "the idle closer thread stayed"


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_daemon_out_of_descriptors_does_not_spin_on_a_pending_fd_socket_connection(socket_dir) -> None:
    """The daemon's descriptors all taken (here idle connections to its gRPC socket under a low
    limit), and one connection left pending on its fd socket: each accept failed with EMFILE, the
    connection stayed queued, and the loop was called at once to accept it again, a core's worth
    of CPU and tens of thousands of warnings a second for as long as it stayed. The daemon now
    waits a while before it accepts again, and says so once."""
    import resource

    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), host_memory="64MiB")
    conns: list[socket.socket] = []
    try:
        open_now = len(os.listdir(f"/proc/{d.pid}/fd"))
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (open_now + 24, open_now + 24))
        for _ in range(40):  # more than it has left: the gRPC server takes them until EMFILE
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.socket)
            conns.append(s)
        time.sleep(1.0)
        pending = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pending.connect(fd_socket_path(d.socket))  # queued: the daemon has no descriptor to accept it
        conns.append(pending)
        time.sleep(0.5)
        before = _cpu_ticks(d.pid)
        time.sleep(2.0)
        used = (_cpu_ticks(d.pid) - before) / os.sysconf("SC_CLK_TCK")
        assert used < 0.5, f"the daemon used {used:.2f} s of CPU in 2 s with one connection pending"
        for s in conns[:-1]:
            s.close()
        time.sleep(1.5)
        assert d.stats().num_clients == 0  # it serves again
    finally:
        for s in conns:
            s.close()
        d.stop()


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))


@pytest.mark.parametrize("far", [0, (16 << 40) - (1 << 20)], ids=["at-its-start", "at-its-end"])
def test_a_huge_sparse_memfd_maps_only_the_pools_pages(daemon, far) -> None:
    """A pool's memfd sealed at 16 TiB, sparse (its maker pays nothing for it), its buffers at its
    start or at its end: the daemon maps the pages its buffers reach, not 16 TiB of address space
    (eight such Registers filled a 48-bit address space: no other engine could register, nor the
    daemon start a thread; mapped from the object's start, buffers at its end did the same)."""
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)  # its descriptor() names fd 0 of the ticket
    fd = os.memfd_create("kvtest-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 16 << 40)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        before = _vm_size()
        req = pool_request(pool, get_ticket(fd_path(daemon), [fd]))
        for layer in req.device_pool.layers:
            for ref in layer.parts:
                ref.offset += far
        reg = stub_of(daemon).Register(req, timeout=TIMEOUT)
        grown = _vm_size() - before
        assert grown < 1 << 30, f"the daemon's address space grew {grown >> 30} GiB"
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=TIMEOUT)
    finally:
        os.close(fd)
        pool.close()


def test_buffers_past_an_objects_first_pages_copy_exactly(daemon) -> None:
    """Buffers 64 MiB, three pages and 64 bytes into their memfd (mapped from the page holding
    their first byte): a Write then a Load moves every byte of the tokens named, and nothing else."""
    import mmap

    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    far = (64 << 20) + 3 * 4096 + 64
    fd = os.memfd_create("kvtest-far", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        req = pool_request(pool, get_ticket(fd_path(daemon), [fd]))
        refs = [ref for layer in req.device_pool.layers for ref in layer.parts]
        end = max(ref.offset + 256 * ref.token_stride for ref in refs)
        os.ftruncate(fd, far + end + 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        mem = mmap.mmap(fd, far + end + 4096)
        view = np.frombuffer(mem, dtype=np.uint8)
        want = np.random.default_rng(5).integers(0, 256, end, dtype=np.uint8)
        view[far:far + end] = want
        for ref in refs:
            ref.offset += far
        stub = stub_of(daemon)
        reg = stub.Register(req, timeout=TIMEOUT)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64),
                               timeout=TIMEOUT).host_indices)
        dev = list(range(64, 128))
        stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host, device_indices=dev),
                   timeout=TIMEOUT)
        view[far:far + end] = 0
        list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host, device_indices=dev),
                       timeout=TIMEOUT))
        got = view[far:far + end].copy()
        for ref in refs:  # the tokens named came back; every other byte of the pool stayed 0
            lo, hi = ref.offset - far + 64 * ref.token_stride, ref.offset - far + 128 * ref.token_stride
            assert np.array_equal(got[lo:hi], want[lo:hi])
            got[lo:hi] = 0
        assert not got.any() and not view[:far].any() and not view[far + end:].any()
        stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=TIMEOUT)
        del view
        mem.close()
    finally:
        os.close(fd)
        pool.close()


def test_a_lane_ring_past_the_largest_is_refused_unmapped() -> None:
    """A lane's ring memfd sealed at 16 TiB is refused before it is mapped."""
    from kvserver.errors import InvalidArgument
    from kvserver.lane.server import open_ring

    fd = os.memfd_create("kvtest-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.ftruncate(fd, 16 << 40)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        before = _vm_size()
        with pytest.raises(InvalidArgument, match="the lane's ring is 17592186044416 bytes"):
            open_ring([fd], [a.fileno(), b.fileno()])
        assert _vm_size() - before < 1 << 30
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_the_descriptors_one_uids_pools_hold_are_capped(daemon) -> None:
    """Each memfd of a registered pool keeps one of the daemon's descriptors open (its mapping's
    copy), for as long as the registration lives; the engine closes its own at once, so it paid
    nothing for them. One uid's 32 registrations of 623 memfds each took 19,940 of a daemon's 20,000
    descriptors: no other tenant could register, and the registered engines' Loads failed. One
    uid's pools now hold at most a quarter of the daemon's limit; the rest is refused, and an
    Unregister gives them back."""
    from kvserver.media import pool_descriptors

    pools = [ShmKVPool(LAYOUT, torch.float16, 2, 256) for _ in range(2)]
    try:
        requests = [pool_request(p, get_ticket(fd_path(daemon), p.fds)) for p in pools]
        each = pool_descriptors(requests[0].device_pool)[0]
        assert each >= 1
        daemon.run(lambda: setattr(daemon.core, "max_pool_fds_per_uid", each))
        first = stub_of(daemon).Register(requests[0], timeout=TIMEOUT)
        got, message = error_of(lambda: stub_of(daemon).Register(requests[1], timeout=TIMEOUT))
        assert got == C.RESOURCE_EXHAUSTED, message
        assert f"the pools registered by uid {os.getuid()}" in message, message
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=first.client_id), timeout=TIMEOUT)
        again = pool_request(pools[1], get_ticket(fd_path(daemon), pools[1].fds))
        second = stub_of(daemon).Register(again, timeout=TIMEOUT)
        assert daemon.run(lambda: dict(daemon.core._pool_fds)) == {os.getuid(): each}
        # The same engine registering again in place of its registration: its old pool's
        # descriptors are not counted against its new one (they go with the old registration).
        third = stub_of(daemon).Register(replacing(daemon, pools[1], second.client_id), timeout=TIMEOUT)
        assert daemon.run(lambda: dict(daemon.core._pool_fds)) == {os.getuid(): each}
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=third.client_id), timeout=TIMEOUT)
        assert daemon.run(lambda: dict(daemon.core._pool_fds)) == {}
    finally:
        for p in pools:
            p.close()


def test_a_registration_replacing_its_own_is_not_charged_the_old_ones_mappings(daemon) -> None:
    """A uid's pools map at most so much of the daemon's address space; the same engine
    registering again in place of its registration is not charged the old pool's mappings, which
    go with it (as its descriptors are not), so a uid near its budget can still re-register."""
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 4096)
    try:
        request = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        first = stub_of(daemon).Register(request, timeout=TIMEOUT)
        mapped = daemon.run(lambda: daemon.core._mapped[os.getuid()])
        assert mapped > 0
        daemon.run(lambda: setattr(daemon.core, "max_mapped_bytes_per_uid", mapped + mapped // 2))
        second = stub_of(daemon).Register(replacing(daemon, pool, first.client_id), timeout=TIMEOUT)
        assert daemon.run(lambda: (list(daemon.core.clients), daemon.core._mapped[os.getuid()])) == (
            [second.client_id], mapped)
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=second.client_id), timeout=TIMEOUT)
    finally:
        pool.close()


def test_a_register_given_up_while_its_region_is_taken_gives_it_back_off_the_loop(daemon,
                                                                                  monkeypatch) -> None:
    """The engine gives up its Register (its deadline) while the region's memory is being taken
    (a kept arena's fallocate, a CUDA region's pinning: seconds for a large one): the region goes
    back, its memory to the kernel in a worker thread, never on the event loop (a 4 GiB kept
    region's held it 0.55 s in a review's run)."""
    import threading

    arena = daemon.core.arena
    commit, punch = arena.commit, arena._punch
    loop_thread = daemon.run(threading.get_ident)
    punched: list[int] = []

    def slow_commit(start: int, nbytes: int) -> None:
        commit(start, nbytes)
        time.sleep(0.5)  # longer than the engine waits

    def recorded_punch(start: int, size: int) -> None:
        punched.append(threading.get_ident())
        punch(start, size)

    monkeypatch.setattr(arena, "commit", slow_commit)
    monkeypatch.setattr(arena, "_punch", recorded_punch)
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    try:
        request = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        got, _ = error_of(lambda: stub_of(daemon).Register(request, timeout=0.2))
        assert got == C.DEADLINE_EXCEEDED
        wait_until(lambda: daemon.run(lambda: (arena.reserved, len(daemon.core.clients))) == (0, 0), 10,
                   "the region given back")
        assert punched and loop_thread not in punched, "the region's memory went back on the loop"
    finally:
        pool.close()


def test_two_registers_replacing_one_registration_leave_one(daemon) -> None:
    """An engine's Register in place of its registration, sent twice at once (a retry beside the
    first, its probe's beside its client's): the daemon ends up holding one registration and one
    region for it, the later one's, never two."""
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    try:
        request = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        first = stub_of(daemon).Register(request, timeout=TIMEOUT)
        region = daemon.run(lambda: daemon.core.arena.reserved)
        answers, held, reserved = registered_at_once(daemon, [replacing(daemon, pool, first.client_id)
                                                              for _ in range(2)])
        assert len(held) == 1 and held[0] in {a.client_id for a in answers}, held
        assert reserved == region
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=held[0]), timeout=TIMEOUT)
    finally:
        pool.close()


def test_registers_naming_a_registration_and_its_successor_leave_one(daemon, monkeypatch) -> None:
    """X was replaced by Y; a late Register still naming X (a retry that outlived its first
    answer) and the engine's own naming Y, both at once: they replace the same registration one
    after the other, and the daemon ends up holding one registration and one region."""
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    try:
        request = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        x = stub_of(daemon).Register(request, timeout=TIMEOUT)
        region = daemon.run(lambda: daemon.core.arena.reserved)
        y = stub_of(daemon).Register(replacing(daemon, pool, x.client_id), timeout=TIMEOUT)
        core = daemon.core
        real = core._register_call

        async def slow(req, tenant=None):  # both in flight at once (a slow pool, a pinning)
            await asyncio.sleep(0.3)
            return await real(req, tenant)

        monkeypatch.setattr(core, "_register_call", slow)
        _, held, reserved = registered_at_once(daemon, [replacing(daemon, pool, named)
                                                        for named in (x.client_id, y.client_id)])
        assert len(held) == 1 and reserved == region, (held, reserved)
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=held[0]), timeout=TIMEOUT)
        # A registration the daemon no longer holds (it restarted, or reclaimed it), named by the
        # engine's Register and by its retry at once: one registration is left too.
        gone = "0123456789abcdef" * 2  # (an id of the daemon's form)
        _, held, reserved = registered_at_once(daemon, [replacing(daemon, pool, gone) for _ in range(2)])
        assert len(held) == 1 and reserved == region, (held, reserved)
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=held[0]), timeout=TIMEOUT)
        # A line of replacements is remembered up to MAX_SUCCESSORS links, the oldest going first.
        monkeypatch.setattr("kvserver.core.kvcore.MAX_SUCCESSORS", 2)
        monkeypatch.setattr(core, "_register_call", real)
        current = ""
        for _ in range(4):
            current = stub_of(daemon).Register(replacing(daemon, pool, current), timeout=TIMEOUT).client_id
        assert daemon.run(lambda: (len(core._successors), list(core.clients))) == (2, [current])
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=current), timeout=TIMEOUT)
        # An id of the peer's own making (not of the daemon's form) is not kept by the daemon.
        made = stub_of(daemon).Register(replacing(daemon, pool, "f" * 100_000), timeout=TIMEOUT)
        assert daemon.run(lambda: "f" * 100_000 not in core._successors)
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=made.client_id), timeout=TIMEOUT)
    finally:
        pool.close()


def test_a_registrations_per_layer_work_runs_off_the_event_loop(daemon, monkeypatch) -> None:
    """The region's views (one a layer and part) and the walk of every buffer the pool names are
    made in a worker thread: for 65536 layers, once a legal request, each held the loop 0.17-0.34 s."""
    import threading

    from kvserver.core import kvcore

    loop_thread = daemon.run(threading.get_ident)
    seen: dict[str, int] = {}
    views, walk = kvcore.KVCore._host_views, kvcore.pool_descriptors

    def traced_views(self, *args):
        seen["views"] = threading.get_ident()
        return views(self, *args)

    def traced_walk(pool):
        seen["walk"] = threading.get_ident()
        return walk(pool)

    monkeypatch.setattr(kvcore.KVCore, "_host_views", traced_views)
    monkeypatch.setattr(kvcore, "pool_descriptors", traced_walk)
    with ShmKVPool(LAYOUT, torch.float16, 2, 256) as pool:
        req = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        reg = stub_of(daemon).Register(req, timeout=TIMEOUT)
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=TIMEOUT)
    assert set(seen) == {"views", "walk"}
    assert loop_thread not in seen.values(), "per-layer work of a Register ran on the event loop"


def test_buffers_far_apart_in_one_object_are_held_to_the_uids_address_space(daemon) -> None:
    """Layer 0 at a sealed sparse memfd's start, the last layer at its 16 TiB end: mapped from the
    first buffer's page to the last's, that was 16 TiB of the daemon's address space again (and a
    pool of 2^40 tokens spans as much with its buffers side by side). One uid's pools may take at
    most the node's memory of it: this one is refused before anything is mapped, and a pool that
    fits is still taken, its bytes counted until its Unregister."""
    pool = ShmKVPool(LAYOUT, torch.float16, 2, 256)
    fd = os.memfd_create("kvtest-split", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 16 << 40)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        req = pool_request(pool, get_ticket(fd_path(daemon), [fd]))
        req.device_pool.layers[-1].parts[-1].offset = (16 << 40) - (1 << 20)
        before = _vm_size()
        got, message = error_of(lambda: stub_of(daemon).Register(req, timeout=TIMEOUT))
        assert got == C.RESOURCE_EXHAUSTED and "of the daemon's address space" in message, (got, message)
        assert _vm_size() - before < 1 << 30
        fitting = pool_request(pool, get_ticket(fd_path(daemon), pool.fds))
        reg = stub_of(daemon).Register(fitting, timeout=TIMEOUT)
        pool_bytes = 2 * 256 * LAYOUT.token_bytes(torch.float16)
        assert daemon.run(lambda: daemon.core._mapped[os.getuid()]) >= pool_bytes
        stub_of(daemon).Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=TIMEOUT)
        assert daemon.run(lambda: dict(daemon.core._mapped)) == {}
    finally:
        os.close(fd)
        pool.close()
