"""The fd socket: where an engine hands the daemon its pool's descriptors (SCM_RIGHTS) and gets
back a one-time ticket for its Register call. gRPC cannot carry descriptors, so this Unix socket
sits beside the gRPC one, at its path + ".fd", with the same mode.

Protocol (SOCK_SEQPACKET, so every message keeps its bounds and its own descriptors):

- the engine sends ``b"KVF1"`` + the number n of descriptors (uint32, little endian), with up to
  253 of them (SCM_MAX_FD) attached; while fewer than n have come, each further message is
  ``b"+"`` with the next ones attached. n is at most ``MAX_FDS``.
- the daemon answers ``b"T" + ticket``, or ``b"E" + <status code name> + b" " + message``
  (``kvserver.peers.fd_socket`` is its half), then closes the connection.

``request_ticket`` is the engine's half (torch-free: kvclient and the test engines use it).
"""

from __future__ import annotations

import array
import socket
import struct
import time

MAGIC = b"KVF1"
HEADER = struct.Struct("<4sI")
MORE = b"+"
MAX_FDS = 1024  # descriptors one ticket may carry (a pool needs one per object: usually one)
FDS_PER_MESSAGE = 253  # Linux's SCM_MAX_FD


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
                data = HEADER.pack(MAGIC, len(fds)) if i == 0 else MORE
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk))] if chunk else []
                s.sendmsg([data], anc)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read anything (too many connections): its answer says why
        reply = s.recv(2048)
    if reply[:1] == b"T":
        return reply[1:].decode()
    code, _, message = reply[1:].decode(errors="replace").partition(" ")
    raise TicketRefused(code or "UNKNOWN", message or "the connection closed without an answer")
