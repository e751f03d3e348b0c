"""The fd socket: where an engine hands the daemon its pool's descriptors (SCM_RIGHTS) and gets
back a one-time ticket for its Register call. gRPC cannot carry descriptors, so this Unix socket
sits beside the gRPC one, at its path + ".fd", with the same mode.

Protocol (SOCK_SEQPACKET, so every message keeps its bounds and its own descriptors):

- the engine sends ``b"KVF1"`` + the number n of descriptors (uint32, little endian), with up to
  253 of them (SCM_MAX_FD) attached; while fewer than n have come, each further message is
  ``b"+"`` with the next ones attached. n is at most ``MAX_FDS``.
- or, for a lane, ``b"KVF2"`` + n + d (two uint32): the same (its ring), and the ticket holds
  d doorbells (1 to ``MAX_DOORBELLS``), which the engine then connects: d more connections to
  this socket, each sending ``b"KVB1"`` + its index (uint32) + the ticket as its first message,
  without descriptors, and nothing more until the daemon answers ``b"B"``; the daemon keeps the
  connection it accepted as its end of that doorbell (it is not closed). So the daemon's ends of
  a lane's doorbells are made by its own accepts and no one else holds them (a peer with a copy of
  one could hold its read lock, or turn SO_PASSRIGHTS on again and send descriptors down it), and
  no descriptor of the daemon's is ever handed to a peer. OpenLane takes no doorbell a peer sent.
- the daemon answers ``b"T" + ticket``, or ``b"E" + <status code name> + b" " + message``
  (``kvserver.peers.fd_socket`` is its half), then closes the connection.

``request_ticket`` and ``request_lane_ticket`` are the engine's half (torch-free: kvclient and the
test engines use them).
"""

from __future__ import annotations

import array
import random
import socket
import struct
import time

MAGIC = b"KVF1"
HEADER = struct.Struct("<4sI")
LANE_MAGIC = b"KVF2"
LANE_HEADER = struct.Struct("<4sII")
BELL_MAGIC = b"KVB1"
BELL_HEADER = struct.Struct("<4sI")
TICKET_CHARS = 32  # a ticket: 16 random bytes, in hex
# The daemon's refusal of a connection while it serves too many of its uid's (or in all) at once:
# an engine tries again until its timeout (its other processes, TP ranks, ask at the same time).
TOO_MANY_CONNS = "too many fd socket connections at once; try again"
# The end of its refusal while the descriptors the uid sent before wait to be closed (a moment's
# work, unless the uid sent a flood): an engine tries again too.
CLOSES_BEHIND = "no more are taken from it until they are"
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
    return _exchange(path, HEADER.pack(MAGIC, len(fds)), fds, timeout)


def request_lane_ticket(path: str, fds: list[int], doorbells: int,
                        timeout: float = 5.0) -> tuple[str, list[socket.socket]]:
    """A lane's ticket: sends ``fds`` (its ring), then connects the ticket's ``doorbells`` (all at
    once, each first message sent right after its connect, then their answers read: a queue of
    connections ahead at the daemon is waited out once); returns the ticket and this process's
    ends of them (the submit doorbell's first). Raises as ``request_ticket`` does."""
    if not 1 <= doorbells <= MAX_DOORBELLS:
        raise ValueError(f"a lane takes 1 to {MAX_DOORBELLS} doorbells, not {doorbells}")
    deadline = time.monotonic() + timeout
    ticket = _exchange(path, LANE_HEADER.pack(LANE_MAGIC, len(fds), doorbells), fds, timeout)
    ends: list[socket.socket] = []
    try:
        for i in range(doorbells):
            ends.append(_ring_up(path, ticket, i, deadline))
        for i in range(doorbells):
            while True:
                ends[i].settimeout(max(0.001, deadline - time.monotonic()))
                reply = _answer(ends[i])
                if reply == b"B":
                    break
                code, _, message = reply[1:].decode(errors="replace").partition(" ")
                if not _try_again(reply, deadline):
                    raise TicketRefused(code or "UNKNOWN", message or "the doorbell's connection closed "
                                        "without an answer")
                ends[i].close()
                ends[i] = _ring_up(path, ticket, i, deadline)
            ends[i].settimeout(None)
    except BaseException:
        for each in ends:
            each.close()
        raise
    return ticket, ends


def _ring_up(path: str, ticket: str, index: int, deadline: float) -> socket.socket:
    """A new connection to ``path`` that has sent doorbell ``index`` of ``ticket``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        _connect(s, path, deadline)
        try:
            s.send(BELL_HEADER.pack(BELL_MAGIC, index) + ticket.encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at its accept, before its first message came: its answer says why
    except BaseException:
        s.close()
        raise
    return s


def _answer(s: socket.socket) -> bytes:
    """The daemon's answer on ``s``; a reset (the daemon closed it with our message unread, as
    when it refused the connection at its accept) is reported before the answer, still queued."""
    try:
        return s.recv(2048)
    except ConnectionResetError:
        return s.recv(2048)


def _try_again(reply: bytes, deadline: float) -> bool:
    """Whether ``reply`` refused a connection for too many of its uid's at once (other processes
    of the engine's uid asking too), or while what its uid sent before waits to be closed, with
    time left before ``deadline``: then after a pause."""
    if not (reply.startswith(b"ERESOURCE_EXHAUSTED " + TOO_MANY_CONNS.encode())
            or reply.startswith(b"ERESOURCE_EXHAUSTED ") and reply.endswith(CLOSES_BEHIND.encode())):
        return False
    left = deadline - time.monotonic()
    if left <= 0.002:
        return False
    time.sleep(min(0.002 + 0.008 * random.random(), left / 2))
    return True


def _connect(s: socket.socket, path: str, deadline: float) -> None:
    """Connects ``s`` to ``path`` by ``deadline`` (its timeout set to what is left)."""
    s.settimeout(max(0.001, deadline - time.monotonic()))
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


def _exchange(path: str, header: bytes, fds: list[int], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        reply = _exchange_once(path, header, fds, deadline)
        if not _try_again(reply, deadline):
            break
    if reply[:1] == b"T":
        return reply[1:].decode()
    code, _, message = reply[1:].decode(errors="replace").partition(" ")
    raise TicketRefused(code or "UNKNOWN", message or "the connection closed without an answer")


def _exchange_once(path: str, header: bytes, fds: list[int], deadline: float) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        _connect(s, path, deadline)
        chunks = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)] or [[]]
        try:
            for i, chunk in enumerate(chunks):
                data = header if i == 0 else MORE
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk))] if chunk else []
                s.sendmsg([data], anc)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read anything (too many connections): its answer says why
        return _answer(s)  # (read without room for descriptors: a daemon sends none)
