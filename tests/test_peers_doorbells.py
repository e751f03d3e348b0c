"""A lane's doorbells are connections to the fd socket (the lane ticket, ``KVF2``, then one ``KVB1``
connection per doorbell): the daemon keeps the connections it accepted as its ends, which no peer
ever holds (a copy of one could hold its read lock, or take descriptors down it again, and so
hold whichever of the loop and the data plane's thread reads it), and it never hands a peer a
descriptor of its own. Against the in-process daemon (conftest's ``daemon``): what the ticket
holds is read on its loop."""

from __future__ import annotations

import array
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from checks import wait_until
from test_lane import passrights_supported, raw_ring_fd

from kvclient import KVClient, KVLayout, ShmKVPool
from kvserver.protocol.fd_socket import (
    BELL_HEADER,
    BELL_MAGIC,
    MAX_DOORBELLS,
    TicketRefused,
    fd_socket_path,
    request_lane_ticket,
    request_ticket,
)
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc


def fd_path(d) -> str:
    return fd_socket_path(d.config.socket)


def ring_memfd() -> int:
    return os.memfd_create("kvtest-bells-ring", os.MFD_CLOEXEC)


def ask_lane(daemon, doorbells: int, ring: int | None = None) -> tuple[bytes, list]:
    """The daemon's answer to a lane ticket's request of ``doorbells`` (for ``ring``, else a bare
    memfd), and the control messages that came with it (room for as many descriptors as a lane
    has doorbells at most)."""
    fd = ring_memfd() if ring is None else ring
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(fd_path(daemon))
            s.sendmsg([b"KVF2" + struct.pack("<II", 1, doorbells)], _rights([fd]))
            reply, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(4 * MAX_DOORBELLS))
    finally:
        if ring is None:
            os.close(fd)
    return reply, anc


def lane_ticket(daemon, doorbells: int, ring: int | None = None) -> str:
    """A lane ticket (of ``ring``, else of a bare memfd) whose doorbells are left to connect."""
    reply, anc = ask_lane(daemon, doorbells, ring)
    assert reply[:1] == b"T" and anc == [], (reply, anc)
    return reply[1:].decode()


def _rights(fds: list[int]) -> list:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def bell(daemon, ticket: str, index: int, then: tuple[bytes, list[int]] | None = None,
         fds: list[int] = ()) -> tuple[socket.socket, bytes]:
    """Connects doorbell ``index`` of ``ticket`` (with ``fds`` on its first message, and the
    message and descriptors ``then`` sent right after it); returns the connection and the
    daemon's answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(fd_path(daemon))
    s.sendmsg([BELL_HEADER.pack(BELL_MAGIC, index) + ticket.encode()], _rights(list(fds)))
    if then is not None:
        s.sendmsg([then[0]], _rights(then[1]))
    return s, s.recv(2048)


# Doorbell argv[3] of ticket argv[2] at fd socket argv[1], from another process: prints the answer.
OTHER_BELL = """import socket, sys
from kvserver.protocol.fd_socket import BELL_HEADER, BELL_MAGIC
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(10)
s.connect(sys.argv[1])
s.sendmsg([BELL_HEADER.pack(BELL_MAGIC, int(sys.argv[3])) + sys.argv[2].encode()])
sys.stdout.write(s.recv(2048).decode(errors="replace"))
"""


def held(daemon, ticket: str) -> list[int]:
    return daemon.run(lambda: list(daemon.core.tickets._tickets[ticket].doorbells))


def test_a_lane_tickets_doorbells_are_the_connections_the_daemon_accepted(daemon) -> None:
    fd = ring_memfd()
    try:
        ticket, ends = request_lane_ticket(fd_path(daemon), [fd], 3)
    finally:
        os.close(fd)
    try:
        assert len(ends) == 3
        book = daemon.run(lambda: daemon.core.tickets._tickets[ticket])
        assert len(book.fds) == 1 and len(book.doorbells) == 3 and min(book.doorbells) >= 0
        assert daemon.run(lambda: book.held) >= 4  # its ring and doorbells (and its pidfd) counted
        ours = [socket.socket(fileno=os.dup(b)) for b in book.doorbells]
        try:
            for i, (end, mine) in enumerate(zip(ends, ours, strict=True)):  # each pair, in order
                assert mine.getpeername() == "" and end.getpeername() == fd_path(daemon)
                end.send(b"%d" % i)
                assert mine.recv(8, socket.MSG_DONTWAIT) == b"%d" % i
                mine.send(b"back")
                assert end.recv(8) == b"back"
                if passrights_supported():  # the daemon's ends take no descriptor
                    r, w = os.pipe()
                    try:
                        with pytest.raises(PermissionError):
                            end.sendmsg([b"x"], _rights([r]))
                    finally:
                        os.close(r)
                        os.close(w)
        finally:
            for s in ours:
                s.close()
    finally:
        for e in ends:
            e.close()


def test_the_daemon_hands_a_peer_no_descriptor_of_its_own(daemon) -> None:
    """A lane ticket's answer carries no descriptor: sockets the daemon made and sent would stay
    in flight, charged to the daemon's user, in the queue of a peer that never reads them (one
    that kept doing so grew the kernel's memory by 11 MiB a ticket's life, ran a daemon limited by
    RLIMIT_NOFILE into ETOOMANYREFS for every engine's lane, and made each of its sends of
    descriptors wait for the kernel's collector of sockets in flight)."""
    ticket = lane_ticket(daemon, MAX_DOORBELLS)  # (its answer: checked to carry none)
    assert held(daemon, ticket) == [-1] * MAX_DOORBELLS  # none connected yet


def test_an_unredeemed_lane_tickets_doorbells_close_at_its_expiry(daemon) -> None:
    daemon.run(lambda: setattr(daemon.core.tickets, "ttl", 0.5))
    fd = ring_memfd()
    try:
        _, ends = request_lane_ticket(fd_path(daemon), [fd], 2)
    finally:
        os.close(fd)
    try:
        for end in ends:  # the daemon's end closed: end of file
            poller = select.poll()
            poller.register(end.fileno(), select.POLLIN | select.POLLRDHUP)
            assert poller.poll(10_000), "the expired ticket's doorbell never closed"
            assert end.recv(8) == b""
        assert daemon.run(lambda: (len(daemon.core.tickets), daemon.core.tickets.num_fds)) == (0, 0)
    finally:
        for e in ends:
            e.close()


@pytest.mark.parametrize("bells", [0, MAX_DOORBELLS + 1, 1 << 31])
def test_a_lane_ticket_of_no_doorbell_or_too_many_is_refused(daemon, bells) -> None:
    reply, anc = ask_lane(daemon, bells)
    assert reply.startswith(b"EINVALID_ARGUMENT ") and b"doorbells asked for" in reply and anc == [], reply
    assert daemon.run(lambda: len(daemon.core.tickets)) == 0


def test_a_lane_tickets_doorbells_count_in_its_uids_budget(daemon) -> None:
    daemon.run(lambda: setattr(daemon.core.tickets, "max_fds_per_uid", 16))
    fd = ring_memfd()
    try:
        with pytest.raises(TicketRefused) as err:
            request_lane_ticket(fd_path(daemon), [fd], MAX_DOORBELLS)
        assert err.value.code == "RESOURCE_EXHAUSTED" and "too many descriptors" in err.value.message
        assert daemon.run(lambda: daemon.core.tickets.num_fds) == 0
        _, ends = request_lane_ticket(fd_path(daemon), [fd], 9)  # within it
        assert len(ends) == 9
        for e in ends:
            e.close()
    finally:
        os.close(fd)


def test_a_doorbell_is_connected_only_once_by_its_tickets_own_process_and_comes_empty(daemon) -> None:
    """Each doorbell's connection is checked on its first message: the ticket's own process, one
    of its doorbells not connected yet, no descriptor on it and nothing queued after it (what came
    with descriptors before SO_PASSRIGHTS went off is never read); refused ones hold nothing."""
    ticket = lane_ticket(daemon, 2)
    r, w = os.pipe()
    conns: list[socket.socket] = []
    try:
        s, reply = bell(daemon, "f" * 32, 0)
        conns.append(s)
        assert reply.startswith(b"EPERMISSION_DENIED "), reply
        s, reply = bell(daemon, ticket, 2)
        conns.append(s)
        assert reply.startswith(b"EINVALID_ARGUMENT ") and b"doorbell 2 of a ticket of 2" in reply, reply
        s, reply = bell(daemon, ticket, 0, fds=[r])
        conns.append(s)
        assert reply.startswith(b"EINVALID_ARGUMENT ") and b"descriptor 0 is a pipe" in reply, reply
        # A second message (here with a descriptor) queued behind the first: the loop is held
        # while both are sent, so that the daemon reads the first with the second there.
        busy = threading.Thread(target=daemon.run, args=(lambda: time.sleep(0.5),))
        busy.start()
        time.sleep(0.1)
        s, reply = bell(daemon, ticket, 0, then=(b"ring", [r]))
        busy.join()
        conns.append(s)
        assert reply.startswith(b"EINVALID_ARGUMENT ") and b"holds messages" in reply, reply
        assert held(daemon, ticket) == [-1, -1]
        s, reply = bell(daemon, ticket, 0)
        conns.append(s)
        assert reply == b"B"
        s, reply = bell(daemon, ticket, 0)
        conns.append(s)
        assert reply.startswith(b"EINVALID_ARGUMENT ") and b"connected already" in reply, reply
        # Another process's doorbell for this ticket (a new interpreter: a fork of this process,
        # the daemon's threads in it, could hang on a lock one of them held).
        other = subprocess.run([sys.executable, "-c", OTHER_BELL, fd_path(daemon), ticket, "1"],
                               capture_output=True, text=True, timeout=60)
        assert other.stdout.startswith("EPERMISSION_DENIED "), (other.stdout, other.stderr[-1000:])
        assert held(daemon, ticket)[1] == -1
        s, reply = bell(daemon, ticket, 1)
        conns.append(s)
        assert reply == b"B" and min(held(daemon, ticket)) >= 0
    finally:
        os.close(r)
        os.close(w)
        for s in conns:
            s.close()


def test_a_lane_ticket_whose_doorbells_were_not_all_connected_opens_no_lane(daemon) -> None:
    """The lane's ticket with its submit doorbell alone connected: OpenLane refuses it, and the
    connected one goes with it."""
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, 2, 256) as pool, \
            KVClient(daemon.address, lane="grpc") as client:
        reg = client.register(model="m", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=64,
                              page_size=16)
        ring = raw_ring_fd(1)
        try:
            ticket = lane_ticket(daemon, 2, ring)
        finally:
            os.close(ring)
        s, reply = bell(daemon, ticket, 0)
        try:
            assert reply == b"B"
            with grpc.insecure_channel(daemon.address) as ch, pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVServerStub(ch).OpenLane(pb.OpenLaneRequest(client_id=reg.client_id,
                                                                     peer_ticket=ticket), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "doorbell 1 of the lane's ticket was never connected" in err.value.details()
            assert s.recv(8) == b""  # its connected doorbell went with it
        finally:
            s.close()
        assert request_ticket(fd_path(daemon), [])  # (the fd socket serves on)


# One engine process of several (an 8-GPU node's tensor-parallel ranks, one uid) asking for its
# lane's ticket at a set moment (argv: fd socket path, CLOCK_MONOTONIC start); prints OK or why not.
RANK = """
import os, sys, time
from kvserver.protocol.fd_socket import TicketRefused, request_lane_ticket
path, start = sys.argv[1], float(sys.argv[2])
fd = os.memfd_create("rank-ring", os.MFD_CLOEXEC)
time.sleep(max(0.0, start - time.monotonic()))
try:
    _, ends = request_lane_ticket(path, [fd], 9, 10.0)
    print("OK", len(ends))
except TicketRefused as exc:
    print(exc.code, exc.message)
"""


def test_engines_of_one_uid_opening_their_lanes_at_once_all_get_them(daemon) -> None:
    """Eight processes of one uid asking for lane tickets at the same moment: each ticket's
    doorbells are connections too, and the uid's connections were given back a loop turn after
    their answers, so a process connecting its next doorbell at once was counted twice, and six
    processes out of eight were refused (RESOURCE_EXHAUSTED) and stayed on gRPC. A doorbell whose
    first message has come is served at its accept, uncounted; a connection is given back as it
    is answered; and an engine refused for too many connections at once tries again until its
    timeout."""
    start = time.monotonic() + 1.5  # (the processes' start, torch-free, well within it)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, fd_path(daemon), repr(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [o.split() for o, _ in outs] == [["OK", "9"]] * 8, outs


def test_a_lane_ticket_gives_up_at_its_timeout_while_its_doorbells_wait_for_answers(daemon,
                                                                                   monkeypatch) -> None:
    """The doorbells' answers were each read with the time left at its connect: a daemon whose
    loop answered each 0.25 s after the last kept the engine 2.3 s in a call given a 1 s timeout
    (16 s with 65 doorbells). Each answer is now waited for until the call's deadline only."""
    book = daemon.core.tickets
    check = book.check_doorbell

    def slow_check(*args, **kw):  # a loop that takes its time (here: held in each check)
        time.sleep(0.25)
        return check(*args, **kw)

    monkeypatch.setattr(book, "check_doorbell", slow_check)
    fd = ring_memfd()
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError):  # (TimeoutError)
            request_lane_ticket(fd_path(daemon), [fd], 9, timeout=1.0)
        assert time.monotonic() - t0 < 1.5
    finally:
        os.close(fd)


def test_a_doorbell_refused_at_its_accept_for_too_many_connections_is_connected_again(daemon,
                                                                                    monkeypatch) -> None:
    """An engine paused between a doorbell's connect and its first message, while its uid's other
    processes held all its connections: the daemon refused the connection at its accept, and the
    engine's late send (EPIPE) or its read (ECONNRESET, reported before the answer) failed the
    whole lane. The answer is read all the same, and the doorbell connected again once there is
    room (here: once the idle connections are dropped)."""
    import kvserver.protocol.fd_socket as proto

    daemon.run(lambda: setattr(daemon.daemon.peer_socket, "conn_seconds", 0.3))
    idle: list[socket.socket] = []
    connect = proto._connect

    def paused_connect(s: socket.socket, path: str, deadline: float) -> None:
        connect(s, path, deadline)
        if not idle:  # the ticket's: then the uid's other processes take its every connection
            return
        time.sleep(0.02)  # the engine paused between a doorbell's connect and its first message

    monkeypatch.setattr(proto, "_connect", paused_connect)
    fd = ring_memfd()
    try:
        ticket = proto._exchange(fd_path(daemon), proto.LANE_HEADER.pack(proto.LANE_MAGIC, 1, 2), [fd], 5.0)
        for _ in range(8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(fd_path(daemon))
            idle.append(s)
        wait_until(lambda: daemon.run(lambda: dict(daemon.daemon.peer_socket._per_uid)).get(os.getuid()) == 8,
                   10, "the uid's eight idle connections")
        monkeypatch.setattr(proto, "_exchange", lambda *args: ticket)  # (the ticket is taken)
        _, ends = proto.request_lane_ticket(fd_path(daemon), [fd], 2, timeout=10.0)
        assert len(ends) == 2 and min(held(daemon, ticket)) >= 0
        for e in ends:
            e.close()
    finally:
        os.close(fd)
        for s in idle:
            s.close()
