"""A peer that sends a descriptor of a file on its own FUSE file system, whose server never
answers: neither the daemon's event loop nor the closing of other peers' descriptors may wait for
it (docs/security.md, "Descriptors a peer sends"). Needs root and /dev/fuse (a FUSE mount made
with mount(2), as fusermount does for any user)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

import pytest
from daemon_proc import DaemonProcess

from kvserver.peers.fd_socket import STUCK_SECONDS
from kvserver.protocol.fd_socket import TicketRefused, fd_socket_path, request_ticket
from kvserver.protocol.shared_memory import create_memfd

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse")
NOBODY = 65534
HERE = os.path.dirname(__file__)

PEER = r"""
import json, os, sys
from kvserver.protocol.fd_socket import TicketRefused, request_ticket
path, mnt, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgroups([0]); os.setgid(65534); os.setuid(65534)  # in group 0: the 0660 socket lets it in
out = []
for _ in range(times):
    f = os.open(os.path.join(mnt, "f"), os.O_RDWR)
    try:
        request_ticket(path, [f], 10)
        out.append("ticket")
    except TicketRefused as exc:
        out.append(f"{exc.code} {exc.message}")
    os.close(f)
print(json.dumps(out))
"""


def _fds_to(label: str, pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == f"/memfd:{label} (deleted)"
        except OSError:
            pass
    return n


@pytest.fixture(params=["flush", "allow_other"])
def fuse_mount(request, socket_dir):
    """A mount of tests/fuse_stall.py owned by uid 65534; its server holds root's FLUSHes (and,
    with allow_other, root's GETATTRs) until the test ends."""
    os.chmod(socket_dir, 0o755)  # (uid 65534 reaches the mount and the daemon's sockets)
    mnt = os.path.join(socket_dir, "mnt")
    os.mkdir(mnt, 0o755)
    args = [sys.executable, os.path.join(HERE, "fuse_stall.py"), str(mnt), str(NOBODY)]
    server = subprocess.Popen(args + (["allow_other"] if request.param == "allow_other" else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if line.strip() != "mounted":
            pytest.skip(f"no FUSE mount here: {line or server.stderr.read()}")
        yield str(mnt)
    finally:
        server.kill()  # the connection ends: what waited on it goes on
        server.wait()
        ctypes.CDLL(None, use_errno=True).umount2(mnt.encode(), 2)  # MNT_DETACH


@pytest.fixture
def daemon_process(socket_dir):
    """A daemon process of its own (its unclosed FUSE descriptors stay out of the test's process,
    whose children would close them at their exec), its sockets 0660 for uid 65534 in group 0."""
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--socket-group-access", host_memory="64MiB")
    yield d
    d.proc.kill()  # (its exit waits for the FUSE server, which the mount's fixture kills after)


def test_a_descriptor_on_a_stalled_fuse_file_system_holds_nothing_but_itself(fuse_mount,
                                                                              daemon_process) -> None:
    d = daemon_process
    path = fd_socket_path(d.socket)
    peer = subprocess.run([sys.executable, "-c", PEER, path, fuse_mount, "4"], capture_output=True,
                          text=True, timeout=60)
    assert peer.returncode == 0, peer.stderr
    refused = "INVALID_ARGUMENT descriptor 0 is a file outside shared memory"
    assert [a[:len(refused)] for a in json.loads(peer.stdout)] == [refused] * 4, peer.stdout
    # The event loop answers at once (no fstat of the peer's file ever waits for its server) ...
    started = time.monotonic()
    d.stats()
    assert time.monotonic() - started < 2
    # ... and another peer's refused descriptors are closed, whatever the closes of the FUSE
    # file's descriptors wait for.
    good, mapping = create_memfd("kvtest-fuse-good", 1 << 20)
    mapping.close()
    r, w = os.pipe()
    try:
        with pytest.raises(TicketRefused):
            request_ticket(path, [good, r], 5)
    finally:
        for fd in (good, r, w):
            os.close(fd)
    deadline = time.monotonic() + 5
    while _fds_to("kvtest-fuse-good", d.pid):
        assert time.monotonic() < deadline, "a refused peer's memfd is still open in the daemon"
        time.sleep(0.01)
    # The peer's uid, whose closer has been in one close for STUCK_SECONDS, gets no connection.
    time.sleep(STUCK_SECONDS)
    peer = subprocess.run([sys.executable, "-c", PEER, path, fuse_mount, "1"], capture_output=True,
                          text=True, timeout=60)
    answer = json.loads(peer.stdout)[0]
    assert answer.startswith("RESOURCE_EXHAUSTED") and "to close so far" in answer, answer
