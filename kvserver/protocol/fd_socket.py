"""The fd socket: where an engine hands the daemon its pool's descriptors (SCM_RIGHTS) and gets
back a one-time ticket for its Register call. gRPC cannot carry descriptors, so this Unix socket
sits beside the gRPC one, at its path + ".fd", with the same mode.

Protocol (SOCK_SEQPACKET, so every message keeps its bounds and its own descriptors):

- the engine sends ``b"KVF1"`` + the number n of descriptors (uint32, little endian), with up to
  253 of them (SCM_MAX_FD) attached; while fewer than n have come, each further message is
  ``b"+"`` with the next ones attached. n is at most ``MAX_FDS``.
- or, for a lane, ``b"KVF2"`` + n + d (two uint32): the same, and the daemon makes d doorbells
  (SOCK_SEQPACKET socket pairs, d at most ``MAX_DOORBELLS``), keeps one end of each under the
  ticket and hands the engine the others with its answer. A lane's doorbells are made so: the
  daemon's ends are then held by no one else (a copy of one in a peer could hold its read lock, or
  take descriptors again), and OpenLane takes no doorbell a peer sent.
- the daemon answers ``b"T" + ticket`` (for ``KVF2``, with the engine's d ends attached, in order),
  or ``b"E" + <status code name> + b" " + message`` (``kvserver.peers.fd_socket`` is its half), then
  closes the connection.

``request_ticket`` and ``request_lane_ticket`` are the engine's half (torch-free: kvclient and the
test engines use them).
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time

MAGIC = b"KVF1"
HEADER = struct.Struct("<4sI")
LANE_MAGIC = b"KVF2"
LANE_HEADER = struct.Struct("<4sII")
MORE = b"+"
MAX_FDS = 1024  # descriptors one ticket may carry (a pool needs one per object: usually one)
FDS_PER_MESSAGE = 253  # Linux's SCM_MAX_FD
MAX_DOORBELLS = 65  # a lane's submit doorbell and one per slot (kvserver.protocol.ring.MAX_SLOTS)


def fd_socket_path(grpc_socket: str) -> str:
    return grpc_socket + ".fd"


class TicketRefused(Exception):
    """The daemon answered with an error: ``code`` is a gRPC status code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def request_ticket(path: str, fds: list[int], timeout: float = 5.0) -> str:
    """The engine's half: sends ``fds`` (the caller keeps its own) and returns the ticket.
    Raises OSError when the socket cannot be reached, TicketRefused when the daemon says no."""
    ticket, _ = _exchange(path, HEADER.pack(MAGIC, len(fds)), fds, 0, timeout)
    return ticket


def request_lane_ticket(path: str, fds: list[int], doorbells: int,
                        timeout: float = 5.0) -> tuple[str, list[socket.socket]]:
    """A lane's ticket: sends ``fds`` (its ring) and returns the ticket and the engine's ends of
    the ``doorbells`` socket pairs the daemon made (the submit doorbell's first). Raises as
    ``request_ticket`` does."""
    if not 1 <= doorbells <= MAX_DOORBELLS:
        raise ValueError(f"a lane takes 1 to {MAX_DOORBELLS} doorbells, not {doorbells}")
    return _exchange(path, LANE_HEADER.pack(LANE_MAGIC, len(fds), doorbells), fds, doorbells, timeout)


def _exchange(path: str, header: bytes, fds: list[int], want: int,
              timeout: float) -> tuple[str, list[socket.socket]]:
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        pause = 0.001
        while True:  # a Unix socket's connect fails at once (EAGAIN) while the daemon's queue is full
            try:
                s.connect(path)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        chunks = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)] or [[]]
        try:
            for i, chunk in enumerate(chunks):
                data = header if i == 0 else MORE
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk))] if chunk else []
                s.sendmsg([data], anc)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read anything (too many connections): its answer says why
        reply, anc, flags, _ = s.recvmsg(2048, socket.CMSG_SPACE(max(want, 1) * 4), socket.MSG_CMSG_CLOEXEC)
    got = _fds_of(anc)
    if reply[:1] == b"T" and len(got) == want and not flags & socket.MSG_CTRUNC:
        ends: list[socket.socket] = []
        try:
            for fd in got:
                ends.append(socket.socket(fileno=fd))
        except OSError:  # not a socket: not a daemon's answer
            for each in ends:
                each.close()
            for fd in got[len(ends):]:
                os.close(fd)
            raise
        return reply[1:].decode(), ends
    for fd in got:
        os.close(fd)
    if reply[:1] == b"T":  # (its ticket expires unused)
        raise OSError(f"the daemon answered with {len(got)} doorbells, not {want}")
    code, _, message = reply[1:].decode(errors="replace").partition(" ")
    raise TicketRefused(code or "UNKNOWN", message or "the connection closed without an answer")


def _fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            out.extend(got)
    return out
