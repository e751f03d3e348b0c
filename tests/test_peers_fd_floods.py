"""Floods of the fd socket by one peer: descriptors queued past a refusal are taken only up to one
ticket's worth, a uid whose descriptors wait on its closer gets no new connection, connections
are accepted a bounded number per turn of the loop, and an engine whose connect finds the queue
full tries again within its timeout. Real daemons on temp Unix sockets, real descriptors."""

from __future__ import annotations

import array
import math
import os
import socket
import threading
import time

from kvserver.peers import fd_socket as fd_socket_mod
from kvserver.peers import tickets
from kvserver.protocol.fd_socket import (
    FDS_PER_MESSAGE,
    HEADER,
    MAGIC,
    MAX_FDS,
    fd_socket_path,
    request_ticket,
)


def _rights(fds: list[int]) -> list:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def _ask(path: str, fds: list[int], announced: int | None = None) -> bytes:
    """One connection: the header with ``fds``; the daemon's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(path)
        try:
            s.sendmsg([HEADER.pack(MAGIC, len(fds) if announced is None else announced)], _rights(fds))
        except BrokenPipeError:  # refused at its accept, before the message went
            pass
        try:
            return s.recv(2048)
        except ConnectionResetError:  # (refused at its accept with the message unread: the reset
            return s.recv(2048)  # comes before the answer, still queued)


def _left(sock: socket.socket) -> int:
    """Messages still queued on ``sock`` (read now, their descriptors closed)."""
    n = 0
    while True:
        try:
            data, anc, _, _ = sock.recvmsg(64, tickets.RIGHTS_SPACE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return n
        for fd in tickets.fds_of(anc):
            os.close(fd)
        n += 1


def test_what_a_refused_connection_holds_is_read_up_to_one_tickets_worth_of_descriptors() -> None:
    """A refused connection's leftovers were read up to 64 messages of 253 descriptors each: 16 k
    descriptors a connection, which a peer sent again at once and the uid's closer fell behind
    on until the daemon had none left. What is read now is at most a ticket's worth (as many as
    an engine sends); the rest goes, unread, with the connection on the closer."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        for _ in range(16):
            a.sendmsg([b"+"], _rights([r] * FDS_PER_MESSAGE))
        tickets.drain(b, 54331)
        read = 16 - _left(b)
        assert read <= math.ceil(MAX_FDS / FDS_PER_MESSAGE), f"{read} messages of {FDS_PER_MESSAGE} read"
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_a_uid_whose_descriptors_wait_on_its_closer_gets_no_new_connection(daemon, monkeypatch) -> None:
    """Each refused descriptor goes to its uid's closer thread; nothing bounded how many waited
    there. Past ``MAX_PENDING_CLOSES`` the uid's connections are refused at once, taking nothing,
    until its closer catches up."""
    monkeypatch.setattr(fd_socket_mod, "STUCK_SECONDS", 60.0)  # (the wait, not its length, is tested)
    gate = threading.Event()
    real = tickets.close_peer_fd

    def slow(fd: int) -> None:  # a closer behind (a file whose close waits on its server)
        gate.wait(30)
        real(fd)

    monkeypatch.setattr(tickets, "close_peer_fd", slow)
    path = fd_socket_path(daemon.config.socket)
    r, w = os.pipe()
    uid = os.geteuid()
    try:
        answers = [_ask(path, [r] * FDS_PER_MESSAGE) for _ in range(12)]
        heard = math.ceil(fd_socket_mod.MAX_PENDING_CLOSES / FDS_PER_MESSAGE)  # (a pipe: refused)
        assert all(a.startswith(b"EINVALID_ARGUMENT") for a in answers[:heard]), answers
        refused = answers[-1]
        assert refused.startswith(b"ERESOURCE_EXHAUSTED") and b"waiting to be closed" in refused, refused
        assert tickets.pending_for(uid) <= fd_socket_mod.MAX_PENDING_CLOSES + MAX_FDS + FDS_PER_MESSAGE
        gate.set()
        deadline = time.monotonic() + 10
        while tickets.pending_for(uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tickets.pending_for(uid) == 0
        assert _ask(path, [r]).startswith(b"EINVALID_ARGUMENT")  # heard again (a pipe: refused as ever)
    finally:
        gate.set()
        os.close(r)
        os.close(w)


def test_connections_are_accepted_a_bounded_number_a_turn_of_the_loop(daemon, monkeypatch) -> None:
    """One peer's connect-and-close flood held the loop in one accept callback for 217 ms: it
    accepted while any connection waited. Now a callback accepts at most ``ACCEPTS_PER_TURN``, and
    the loop's other work runs between two."""
    loop = daemon.loop
    accepted: list[int] = []
    seen: list[int] = []
    real = socket.socket.accept

    def counting(self):
        got = real(self)
        if threading.current_thread() is not threading.main_thread() and self.fileno() == listening:
            accepted.append(1)
            if len(accepted) == 1:
                loop.call_soon(lambda: seen.append(len(accepted)))
        return got

    listening = daemon.run(lambda: daemon.daemon.peer_socket._sock.fileno())
    monkeypatch.setattr(socket.socket, "accept", counting)
    path = fd_socket_path(daemon.config.socket)
    held = threading.Event()
    loop.call_soon_threadsafe(lambda: held.set() or time.sleep(0.5))  # the loop busy: they queue
    held.wait(5)
    conns = []
    try:
        for _ in range(100):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(path)
            conns.append(c)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fd_socket_mod.ACCEPTS_PER_TURN <= 32 and seen and seen[0] <= fd_socket_mod.ACCEPTS_PER_TURN, \
            (seen, len(accepted))
    finally:
        for c in conns:
            c.close()


def test_an_engine_whose_connect_finds_the_queue_full_tries_again_within_its_timeout(tmp_path) -> None:
    """A Unix socket's connect with a timeout fails at once (EAGAIN) while the listener's queue is
    full: an engine registering while another peer flooded the fd socket got UNAVAILABLE at once,
    with 5 s to go. It now tries again until its timeout."""
    path = str(tmp_path / "fd")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(0)
    fillers = []
    try:
        while True:  # fill the queue
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            fillers.append(c)
            assert len(fillers) < 64

        def serve() -> None:  # a while later, the queue is worked off and the engine answered
            time.sleep(0.3)
            for _ in range(len(fillers)):
                listener.accept()[0].close()
            conn, _ = listener.accept()
            conn.recv(64)
            conn.send(b"Tticket-after-a-full-queue")
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        assert request_ticket(path, [], timeout=5) == "ticket-after-a-full-queue"
        t.join(5)
    finally:
        for c in fillers:
            c.close()
        listener.close()



def test_a_uid_whose_shared_memory_waits_to_be_closed_gets_no_new_connection(daemon, monkeypatch) -> None:
    """What a uid sends past a refusal is closed off the loop; shared memory on the shared closer
    threads, which counted no uid's: a peer sending the same memfd over and over outpaced them,
    and the daemon held 3.5 k to 13 k of its descriptors waiting (at times all it may open). A
    uid with MAX_PENDING_CLOSES of its descriptors waiting there gets no connection either, until
    they are closed, and an engine asking meanwhile tries again until its timeout. (Here the
    shared closers are held until the uid has that many waiting.)"""
    held = threading.Event()
    close = tickets.close_peer_fd

    def held_close(fd: int) -> None:
        if threading.current_thread().name == "kvpeer-close":
            held.wait(30)
        close(fd)

    monkeypatch.setattr(tickets, "close_peer_fd", held_close)
    path = fd_socket_path(daemon.config.socket)
    fd = os.memfd_create("kvtest-flood", os.MFD_CLOEXEC)
    try:
        sent = 0
        while sent < fd_socket_mod.MAX_PENDING_CLOSES:  # each refused: more sent than announced
            assert _ask(path, [fd] * FDS_PER_MESSAGE, announced=1).startswith(b"EINVALID_ARGUMENT ")
            sent += FDS_PER_MESSAGE
        assert tickets.pending_for(os.getuid()) >= fd_socket_mod.MAX_PENDING_CLOSES
        reply = _ask(path, [])
        assert reply.startswith(b"ERESOURCE_EXHAUSTED ") and b"waiting to be closed" in reply, reply
        # An engine asking meanwhile waits (it tries again) until they are closed, within its timeout.
        threading.Timer(0.3, held.set).start()
        t0 = time.monotonic()
        assert request_ticket(path, [], timeout=5)
        assert 0.25 < time.monotonic() - t0 < 5
    finally:
        held.set()
        os.close(fd)
