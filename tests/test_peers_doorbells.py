"""A lane's doorbells are made by the daemon (the fd socket's lane ticket, ``KVF2``): it keeps one
end of each socket pair under the ticket and hands the engine the others, so no peer ever holds a
copy of the daemon's end (which could hold the end's read lock, or take descriptors down it again,
and so hold whichever of the loop and the data plane's thread reads it). Against the in-process
daemon (conftest's ``daemon``): what the ticket holds is read on its loop."""

from __future__ import annotations

import array
import errno
import os
import select
import socket
import struct
import time

import grpc
import pytest

from kvserver.peers import fd_socket as fd_socket_mod
from kvserver.protocol.fd_socket import MAX_DOORBELLS, TicketRefused, fd_socket_path, request_lane_ticket

C = grpc.StatusCode


def fd_path(d) -> str:
    return fd_socket_path(d.config.socket)


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.01)


def ring_memfd() -> int:
    return os.memfd_create("kvtest-bells-ring", os.MFD_CLOEXEC)


def sockets_open() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def passrights_supported() -> bool:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        try:
            a.setsockopt(socket.SOL_SOCKET, 83, 0)  # SO_PASSRIGHTS (Linux 6.16)
        except OSError:
            return False
    return True


def test_a_lane_ticket_hands_over_the_engines_ends_of_doorbells_the_daemon_made(daemon) -> None:
    fd = ring_memfd()
    try:
        ticket, ends = request_lane_ticket(fd_path(daemon), [fd], 3)
    finally:
        os.close(fd)
    try:
        assert len(ends) == 3
        assert all((e.family, e.type) == (socket.AF_UNIX, socket.SOCK_SEQPACKET) for e in ends)
        held = daemon.run(lambda: daemon.core.tickets._tickets[ticket])
        assert len(held.fds) == 1 and len(held.doorbells) == 3
        ours = [socket.socket(fileno=os.dup(b)) for b in held.doorbells]
        try:
            for i, (end, mine) in enumerate(zip(ends, ours, strict=True)):  # each pair, in order
                end.send(b"%d" % i)
                assert mine.recv(8, socket.MSG_DONTWAIT) == b"%d" % i
                mine.send(b"back")
                assert end.recv(8) == b"back"
                if passrights_supported():  # the daemon's ends take no descriptor, from the first
                    r, w = os.pipe()
                    try:
                        with pytest.raises(PermissionError):
                            end.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                  array.array("i", [r]))])
                    finally:
                        os.close(r)
                        os.close(w)
        finally:
            for s in ours:
                s.close()
        # The ticket counts its doorbells against the uid's descriptor budget (and its ring, pidfd).
        assert daemon.run(lambda: held.held) >= 4
    finally:
        for e in ends:
            e.close()


def test_an_unredeemed_lane_tickets_doorbells_close_at_its_expiry(daemon) -> None:
    daemon.run(lambda: setattr(daemon.core.tickets, "ttl", 0.3))
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


def _refused(daemon, header: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(fd_path(daemon))
        s.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
        reply, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(4 * MAX_DOORBELLS))
        assert anc == []  # no doorbell handed over
        return reply


@pytest.mark.parametrize("bells", [0, MAX_DOORBELLS + 1, 1 << 31])
def test_a_lane_ticket_asking_for_no_doorbell_or_too_many_is_refused_before_any_is_made(daemon,
                                                                                        bells) -> None:
    fd = ring_memfd()
    try:
        before = sockets_open()
        reply = _refused(daemon, b"KVF2" + struct.pack("<II", 1, bells), [fd])
        assert reply.startswith(b"EINVALID_ARGUMENT ") and b"doorbells asked for" in reply, reply
        assert daemon.run(lambda: len(daemon.core.tickets)) == 0
        wait_until(lambda: sockets_open() <= before, what="the connection closed, no doorbell left")
    finally:
        os.close(fd)


def test_a_lane_ticket_past_its_uids_budget_is_refused_before_any_doorbell_is_made(daemon,
                                                                                   monkeypatch) -> None:
    daemon.run(lambda: setattr(daemon.core.tickets, "max_fds_per_uid", 16))
    made: list[int] = []
    real = fd_socket_mod.make_doorbells
    monkeypatch.setattr(fd_socket_mod, "make_doorbells", lambda n: (made.append(n), real(n))[1])
    fd = ring_memfd()
    try:
        with pytest.raises(TicketRefused) as err:
            request_lane_ticket(fd_path(daemon), [fd], MAX_DOORBELLS)
        assert err.value.code == "RESOURCE_EXHAUSTED" and "too many descriptors" in err.value.message
        assert made == [] and daemon.run(lambda: daemon.core.tickets.num_fds) == 0
        _, ends = request_lane_ticket(fd_path(daemon), [fd], 9)  # within it: made
        assert made == [9] and len(ends) == 9
        for e in ends:
            e.close()
    finally:
        os.close(fd)


def test_a_daemon_out_of_descriptors_midway_through_the_doorbells_says_so_and_keeps_none(daemon,
                                                                                        monkeypatch) -> None:
    real = socket.socketpair
    calls = [0]

    def socketpair(*args):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(*args)

    fd = ring_memfd()
    try:
        before = sockets_open()
        monkeypatch.setattr(fd_socket_mod.socket, "socketpair", socketpair)
        with pytest.raises(TicketRefused) as err:
            request_lane_ticket(fd_path(daemon), [fd], 9)
        monkeypatch.setattr(fd_socket_mod.socket, "socketpair", real)
        assert err.value.code == "RESOURCE_EXHAUSTED" and "doorbells" in err.value.message, err.value
        assert calls[0] == 4 and daemon.run(lambda: len(daemon.core.tickets)) == 0
        wait_until(lambda: sockets_open() <= before, what="the three pairs made closed")
    finally:
        os.close(fd)
