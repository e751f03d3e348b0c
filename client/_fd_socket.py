"""Peer tickets: before every Register of a shared-memory pool the client hands the pool's
descriptors to the daemon's fd socket (the gRPC socket's path + ".fd") and puts the one-time
ticket it gets back into the request. The protocol is in kvserver/peer_socket.py.

Synchronous and short; the asyncio client runs it in a thread.
"""

from __future__ import annotations

import os

import grpc

from kvclient.errors import KVClientError
from kvserver.peer_socket import TicketRefused, request_ticket
from kvserver.v1 import kvserver_pb2 as pb


def fd_socket_path(target: str) -> str | None:
    """The fd socket of a ``unix://`` gRPC target. A TCP target has none, unless
    KVSERVER_FD_SOCKET names the daemon's (an engine on the daemon's host that talks TCP)."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix) :] + ".fd"
    return os.environ.get("KVSERVER_FD_SOCKET") or None


def get_ticket(path: str, fds: list[int], timeout: float = 5.0) -> str:
    try:
        return request_ticket(path, fds, timeout)
    except OSError as exc:
        raise KVClientError(grpc.StatusCode.UNAVAILABLE,
                            f"cannot get a peer ticket from the daemon's fd socket {path}: {exc}") from None
    except TicketRefused as exc:
        code = grpc.StatusCode.__members__.get(exc.code, grpc.StatusCode.UNKNOWN)
        raise KVClientError(code, f"the daemon's fd socket refused the pool's descriptors: {exc.message}") \
            from None


def ticketed(target: str, pool, req: pb.RegisterRequest) -> pb.RegisterRequest:
    """``req`` with a fresh peer ticket for ``pool``'s descriptors, when the pool is in shared
    memory (a CUDA pool has none) and the daemon is reached over its Unix socket."""
    fds = getattr(pool, "fds", None)
    path = fd_socket_path(target)
    if fds is None or path is None:
        return req
    out = pb.RegisterRequest()
    out.CopyFrom(req)
    out.peer_ticket = get_ticket(path, list(fds))
    return out
