"""Peer tickets: before every Register the client hands the pool's descriptors (none for a CUDA
pool) to the daemon's fd socket (the gRPC socket's path + ".fd") and puts the one-time ticket it
gets back into the request; a scheduler's OpenSpace carries one too. The ticket tells the daemon
the caller's uid, and so its tenant. The protocol is in kvserver/protocol/fd_socket.py.

Synchronous and short; the asyncio client runs it in a thread.
"""

from __future__ import annotations

import os

import grpc

from kvclient.errors import KVClientError
from kvserver.protocol.fd_socket import TicketRefused, request_ticket
from kvserver.protocol.fd_socket import fd_socket_path as fd_socket_of
from kvserver.protocol.paths import default_socket, foreign_path
from kvserver.v1 import kvserver_pb2 as pb


def fd_socket_path(target: str) -> str | None:
    """The fd socket of a ``unix://`` gRPC target. A TCP target has none, unless
    KVSERVER_FD_SOCKET names the daemon's (an engine on the daemon's host that talks TCP)."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix) :] + ".fd"
    return os.environ.get("KVSERVER_FD_SOCKET") or None


def get_ticket(path: str, fds: list[int], timeout: float = 5.0) -> str:
    if path == fd_socket_of(default_socket()):  # a path any user can make first (/tmp/kvserver-<uid>)
        why = foreign_path(os.path.dirname(path))
        if why is not None:
            raise KVClientError(grpc.StatusCode.PERMISSION_DENIED,
                                f"the pool is not sent to the default socket {path}: {why}; whoever "
                                "made it could read and write the pool (set XDG_RUNTIME_DIR or "
                                "KVSERVER_ADDRESS to a directory of your own)")
    try:
        return request_ticket(path, fds, timeout)
    except OSError as exc:
        raise KVClientError(grpc.StatusCode.UNAVAILABLE,
                            f"cannot get a peer ticket from the daemon's fd socket {path}: {exc}") from None
    except TicketRefused as exc:
        code = grpc.StatusCode.__members__.get(exc.code, grpc.StatusCode.UNKNOWN)
        raise KVClientError(code, f"the daemon's fd socket refused the pool's descriptors: {exc.message}") \
            from None


def ticket_for(target: str, fds: list[int] | tuple[int, ...] = (), timeout: float = 5.0) -> str:
    """A fresh peer ticket carrying ``fds`` when the daemon has an fd socket for ``target``;
    "" when it has none (TCP). It waits at most ``timeout`` (the caller's own call bound)."""
    path = fd_socket_path(target)
    return "" if path is None else get_ticket(path, list(fds), timeout)


def ticketed(target: str, pool, req: pb.RegisterRequest, timeout: float = 5.0) -> pb.RegisterRequest:
    """``req`` with a fresh peer ticket carrying ``pool``'s descriptors (a shared-memory pool's;
    a CUDA pool has none), when the daemon has an fd socket for ``target``."""
    ticket = ticket_for(target, tuple(getattr(pool, "fds", None) or ()), timeout)
    if not ticket:
        return req
    out = pb.RegisterRequest()
    out.CopyFrom(req)
    out.peer_ticket = ticket
    return out
