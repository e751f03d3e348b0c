"""Peer tickets: before every Register the client hands the pool's descriptors (none for a CUDA
pool) to the daemon's fd socket (the gRPC socket's path + ".fd") and puts the one-time ticket it
gets back into the request; a scheduler's OpenSpace carries one too. The ticket tells the daemon
the caller's uid, and so its tenant. The protocol is in kvserver/protocol/fd_socket.py.

Synchronous and short; the asyncio client runs it in a thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import grpc

from kvclient.errors import KVClientError
from kvserver.protocol.fd_socket import TicketRefused, request_lane_ticket, request_ticket
from kvserver.protocol.fd_socket import fd_socket_path as fd_socket_of
from kvserver.protocol.paths import default_socket, foreign_path
from kvserver.v1 import kvserver_pb2 as pb

if TYPE_CHECKING:
    from kvclient._transport.lane import ClientLane

T = TypeVar("T")


def fd_socket_path(target: str) -> str | None:
    """The fd socket of a ``unix://`` gRPC target. A TCP target has none, unless
    KVSERVER_FD_SOCKET names the daemon's (an engine on the daemon's host that talks TCP)."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix) :] + ".fd"
    return os.environ.get("KVSERVER_FD_SOCKET") or None


def get_ticket(path: str, fds: list[int], timeout: float = 5.0) -> str:
    return _asked(path, lambda: request_ticket(path, fds, timeout))


def _asked(path: str, ask: Callable[[], T]) -> T:
    if path == fd_socket_of(default_socket()):  # a path any user can make first (/tmp/kvserver-<uid>)
        why = foreign_path(os.path.dirname(path))
        if why is not None:
            raise KVClientError(grpc.StatusCode.PERMISSION_DENIED,
                                f"the pool is not sent to the default socket {path}: {why}; whoever "
                                "made it could read and write the pool (set XDG_RUNTIME_DIR or "
                                "KVSERVER_ADDRESS to a directory of your own)")
    try:
        return ask()
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


def lane_ticket_for(target: str, lane: ClientLane, timeout: float = 5.0) -> str:
    """A lane's ticket: ``lane``'s ring goes to the daemon, and its doorbells are connected to the
    fd socket, this process's ends attached to ``lane``. Raises KVClientError as ``get_ticket``, and
    UNAVAILABLE for a target without an fd socket (a lane needs one)."""
    path = fd_socket_path(target)
    if path is None:
        raise KVClientError(grpc.StatusCode.UNAVAILABLE, f"{target} has no fd socket: no lane")
    ticket, ends = _asked(path, lambda: request_lane_ticket(path, lane.ring_fds(), lane.doorbells, timeout))
    lane.attach(ends)
    return ticket


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
