"""A scheduler's fast lane for the Lookups of one KV space (docs/lane.md, "A space's lane").

``CacheView`` asks the daemon for a lane of its space on its first Lookup (a peer ticket carrying
the ring and doorbells, then ``OpenLane`` naming the space id) and sends every Lookup there: about
0.2 ms on the daemon's event loop where a gRPC call costs about 1 ms, most of that the scheduler's
own CPU. The lane belongs to the space id it was opened for: a view that opens its space again (the
daemon restarted and forgot the id) opens a lane for the new id. Where no lane can be had (a TCP
target, a daemon that does not know space lanes, too many of them for this uid) the Lookups stay on
gRPC until the space is opened again. Events and Releases always take gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from kvclient._transport.fd_socket import fd_socket_path, ticket_for
from kvclient._transport.lane import ClientLane
from kvclient.errors import KVClientError
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger("kvclient")

# A scheduler asks one Lookup at a time; the spare slot serves a call while an abandoned one (its
# deadline passed) is still the daemon's.
SLOTS = 2


class ViewLane:
    def __init__(self, target: str, metadata: Any, enabled: bool = True) -> None:
        self.enabled = enabled and target.startswith("unix") and fd_socket_path(target) is not None
        self._target = target
        self._metadata = metadata
        self._lane: ClientLane | None = None
        self._space = ""  # the space id the lane, or the refusal of one, is for
        self._lock = threading.Lock()
        self._closed = False
        self.refusals = 0

    @property
    def lane(self) -> ClientLane | None:
        return self._lane

    def lookup(self, stub, request: pb.LookupRequest, deadline: float) -> pb.LookupResponse | None:
        """``request`` (naming its space) answered on the space's lane; None: not sent, take gRPC.
        Raises KVClientError with the daemon's status (DEADLINE_EXCEEDED at ``deadline``)."""
        lane = self._for(stub, request.space_id, deadline)
        if lane is None:
            return None
        left = max(0.001, deadline - time.monotonic())
        request.timeout_ms = max(1, int(left * 1000))  # no gRPC deadline ends a lane call: the daemon ends it
        try:
            got = lane.unary("Lookup", request.SerializeToString(), left)
        except KVClientError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            # The daemon closed its end (it stopped): this call goes on gRPC, which says whether
            # another daemon answers now; the next Lookup asks for a lane again.
            self._drop(lane)
            return None
        return None if got is None else pb.LookupResponse.FromString(got)

    def _for(self, stub, space_id: str, deadline: float) -> ClientLane | None:
        lane = self._lane
        if lane is not None and self._space == space_id and not lane.closed:
            return lane
        if not self.enabled or self._closed or (lane is None and self._space == space_id):
            return None  # refused for this space id: gRPC until the space is opened again
        with self._lock:
            if self._closed:
                return None
            if self._space != space_id or (self._lane is not None and self._lane.closed):
                self._replace(None, "")
                self._replace(self._open(stub, space_id, deadline), space_id)
            return self._lane

    def _open(self, stub, space_id: str, deadline: float) -> ClientLane | None:
        lane = ClientLane(SLOTS)
        try:
            ticket = ticket_for(self._target, lane.daemon_fds(), max(0.001, deadline - time.monotonic()))
            opened = stub.OpenLane(pb.OpenLaneRequest(space_id=space_id, peer_ticket=ticket),
                                   timeout=max(0.001, deadline - time.monotonic()), metadata=self._metadata)
        except (grpc.RpcError, KVClientError, OSError, ValueError) as exc:
            lane.close()
            code = exc.code() if isinstance(exc, grpc.RpcError) else getattr(exc, "code", None)
            (logger.debug if self.refusals else logger.info)(
                "kvserver space lane not opened (%s): the view's Lookups stay on gRPC",
                code.name if code is not None else exc)
            self.refusals += 1
            return None
        finally:
            lane.handed_over()
        lane.rpc_mask = opened.rpc_mask
        if not lane.serves("Lookup"):  # a daemon that opened something else: not ours to use
            lane.close()
            self.refusals += 1
            return None
        return lane

    def _replace(self, lane: ClientLane | None, space_id: str) -> None:
        old, self._lane, self._space = self._lane, lane, space_id
        if old is not None:
            old.close()

    def _drop(self, lane: ClientLane) -> None:
        with self._lock:
            if self._lane is lane:
                self._lane, self._space = None, ""
        lane.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._replace(None, "")
