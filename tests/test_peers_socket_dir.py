"""The socket's directory: a daemon never listens, and a client never hands its pool over, in a
directory another user controls (one could swap the sockets in it: docs/security.md, "Who may
connect")."""

from __future__ import annotations

import array
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from kvserver.config import ServerConfig
from kvserver.server import Daemon, ListenError

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="another uid's directory needs root to make")


def _start(path: str, **kw) -> None:
    import asyncio

    async def run() -> None:
        daemon = Daemon(ServerConfig(socket=path, host_memory=16 << 20, **kw))
        try:
            await daemon.start()
        finally:
            await daemon.stop()

    asyncio.run(run())


@needs_root
def test_the_daemon_refuses_a_socket_directory_of_another_uid(socket_dir) -> None:
    """/tmp/kvserver-<uid> made first by another user: the daemon would make its own directory in
    it and listen there, where that user may rename it away and put its own sockets in its place."""
    squat = os.path.join(socket_dir, "kvserver-1000")
    os.mkdir(squat, 0o755)
    os.chown(squat, 4242, 4242)
    path = os.path.join(squat, "kvserver", "kvserver.sock")
    with pytest.raises(ListenError) as err:
        _start(path)
    assert f"{squat} belongs to uid 4242" in str(err.value), err.value
    assert not os.path.exists(os.path.dirname(path))  # nothing made there


def test_the_daemon_refuses_a_socket_directory_others_may_write(socket_dir) -> None:
    shared = os.path.join(socket_dir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # writable by everyone, not sticky
    with pytest.raises(ListenError) as err:
        _start(os.path.join(shared, "kv.sock"))
    assert f"{shared} is writable by other users and not sticky" in str(err.value), err.value


def test_a_shared_socket_dir_is_used_when_asked_with_a_warning(socket_dir, caplog) -> None:
    """--shared-socket-dir: a Kubernetes emptyDir (0777, not sticky) that a pod's containers share."""
    shared = os.path.join(socket_dir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with caplog.at_level("WARNING", logger="kvserver.server"):
        _start(os.path.join(shared, "kv.sock"), shared_socket_dir=True)
    assert f"{shared} is writable by other users and not sticky (--shared-socket-dir)" in caplog.text


def test_socket_group_access_makes_a_directory_the_group_may_enter(socket_dir) -> None:
    """--socket-group-access: the socket is 0660, and a directory the daemon makes for it 0750
    (0700 would keep the group out whatever the socket's mode)."""
    path = os.path.join(socket_dir, "made", "kv.sock")
    _start(path, socket_group_access=True)
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o750
    private = os.path.join(socket_dir, "private", "kv.sock")
    _start(private)
    assert os.stat(os.path.dirname(private)).st_mode & 0o777 == 0o700


CLIENT = r"""
import os, sys
import torch
from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))  # (its imports made as root)
with ShmKVPool(KVLayout.mha(1, 8), torch.float16, 1, 64) as pool:
    try:
        with KVClient(resilient=False) as c:
            c.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=64,
                       page_size=16)
        print("REGISTERED")
    except KVClientError as exc:
        print("REFUSED", exc.code.name, exc.message)
"""


@needs_root
def test_a_client_never_sends_its_pool_to_a_default_socket_another_user_made() -> None:
    """Without XDG_RUNTIME_DIR, an engine's default socket is /tmp/kvserver-<uid>/kvserver/
    kvserver.sock; another user who makes that directory first and listens there would receive
    the engine's pool (read and write). The client checks the directory and sends nothing."""
    victim, squatter = 54321, 54322
    top = f"/tmp/kvserver-{victim}"
    shutil.rmtree(top, ignore_errors=True)
    os.makedirs(os.path.join(top, "kvserver"))
    for d in (top, os.path.join(top, "kvserver")):
        os.chown(d, squatter, squatter)
        os.chmod(d, 0o755)
    fd_path = os.path.join(top, "kvserver", "kvserver.sock.fd")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(fd_path)
    os.chmod(fd_path, 0o777)
    listener.listen(4)
    listener.settimeout(0.2)
    got: list[int] = []
    stop = threading.Event()

    def squat() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                fds = array.array("i")
                _, anc, _, _ = conn.recvmsg(64, socket.CMSG_SPACE(64 * fds.itemsize))
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                got.extend(fds)
                for fd in fds:
                    os.close(fd)

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "KVSERVER_ADDRESS")}
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT, str(victim)], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        shutil.rmtree(top, ignore_errors=True)
    assert got == [], f"the squatter received {len(got)} descriptors of the engine's pool"
    assert "REFUSED PERMISSION_DENIED" in out.stdout, out.stdout + out.stderr
    assert f"{top}/kvserver belongs to uid {squatter}" in out.stdout, out.stdout
