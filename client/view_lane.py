"""A scheduler's fast lane for the Lookups of one KV space (docs/lane.md, "A space's lane").

``CacheView`` asks the daemon for a lane of its space on its first Lookup (a peer ticket carrying
the ring and doorbells, then ``OpenLane`` naming the space id) and sends every Lookup there: about
0.2 ms on the daemon's event loop where a gRPC call costs about 1 ms, most of that the scheduler's
own CPU. The lane belongs to the space id it was opened for: a view that opens its space again (the
daemon restarted and forgot the id) opens a lane for the new id. Where no lane can be had (a TCP
target, a daemon that does not know space lanes, too many of them for this uid) the Lookups take
gRPC, and the view asks again 30 s later. Events and Releases always take gRPC: so does the
Release of a lease that a pinning Lookup given up on the lane took after all (its answer came
after the view stopped waiting), which nobody else holds.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvclient._transport.fd_socket import fd_socket_path, lane_ticket_for
from kvclient._transport.lane import ClientLane, release_late
from kvclient.errors import KVClientError
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger("kvclient")

# A scheduler asks one Lookup at a time; the spare slot serves a call while an abandoned one (its
# deadline passed) is still the daemon's. The daemon takes at most 4 on a space's lane.
SLOTS = 2
# After a refusal (or a failed open) the view asks for a lane again only this much later.
RETRY_SECONDS = 30.0
# OpenLane's own bound: at most half the first Lookup's time, and never more than this.
OPEN_SECONDS = 1.0
# The daemon is told to end a Lookup this much before the view gives up on it (a quarter of the
# time at most), so that its answer, with or without a lease, comes before the view stops waiting:
# a lease the view never saw would pin its pages until pin_ms. The daemon's bound starts when its
# loop takes the request, which may be later by more than this (a long Put holds the loop): a
# pinning Lookup's answer that comes after the view gave up is watched for, and its lease released.
MARGIN_SECONDS = 0.02
# The bound of that Release.
RELEASE_SECONDS = 1.0
MAX_TIMEOUT_MS = 0xFFFFFFFF


def daemon_timeout_ms(left: float) -> int:
    """The ``timeout_ms`` to send with a Lookup the view waits ``left`` seconds for."""
    bound = left - min(MARGIN_SECONDS, left / 4)
    if not bound < MAX_TIMEOUT_MS / 1000:  # also inf and nan
        return MAX_TIMEOUT_MS
    return max(1, int(bound * 1000))


class ViewLane:
    """``current()`` is the view's space id now: a lane is opened only for it, so a thread holding
    an id the view has since replaced never closes the lane of the new one."""

    def __init__(self, target: str, metadata: Any, current: Callable[[], str], enabled: bool = True) -> None:
        self.enabled = enabled and target.startswith("unix") and fd_socket_path(target) is not None
        self._target = target
        self._metadata = metadata
        self._current = current
        # (lane or None, the space id it or its refusal is for, when it was refused): one
        # attribute, so that a reader without the lock sees one state, never half of two.
        self._held: tuple[ClientLane | None, str, float] = (None, "", -math.inf)
        self._lock = threading.Lock()
        self._opening = False
        self._closed = False
        self.refusals = 0

    @property
    def lane(self) -> ClientLane | None:
        return self._held[0]

    def lookup(self, stub, request: pb.LookupRequest, deadline: float) -> pb.LookupResponse | None:
        """``request`` (naming its space) answered on the space's lane; None: not sent, take gRPC.
        Raises KVClientError with the daemon's status (DEADLINE_EXCEEDED at ``deadline``)."""
        lane = self._for(stub, request.space_id, deadline)
        if lane is None:
            return None
        left = max(0.001, deadline - time.monotonic())
        request.timeout_ms = daemon_timeout_ms(left)  # no gRPC deadline ends a lane call
        late = functools.partial(self._release_late, stub, request.space_id) if request.pin_ms else None
        try:
            got = lane.unary("Lookup", request.SerializeToString(), left, late, request.pin_ms / 1000)
        except KVClientError as exc:
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED,
                                grpc.StatusCode.CANCELLED):
                raise
            # The daemon closed its end (it stopped), the lane is not this space's any more (the
            # view opened it again meanwhile), or another thread closed it: this call goes on
            # gRPC, which says how things stand; a later Lookup asks for a lane again.
            self._drop(lane)
            return None
        return None if got is None else pb.LookupResponse.FromString(got)

    def _release_late(self, stub, space_id: str, response: bytes) -> None:
        """A pinning Lookup's answer that came after the view gave up (on the lane's watching
        thread): the lease it took, which nobody holds, is released."""
        release_late(stub, response, RELEASE_SECONDS, self._metadata, space_id=space_id)

    def _for(self, stub, space_id: str, deadline: float) -> ClientLane | None:
        lane, space, refused_at = self._held
        if space == space_id:
            if lane is not None and not lane.closed:
                return lane
            if lane is None and time.monotonic() - refused_at < RETRY_SECONDS:
                return None  # refused for this space id a moment ago: gRPC
        if not self.enabled or self._closed:
            return None
        with self._lock:
            if self._opening or self._closed or space_id != self._current():
                return None  # another thread opens one, or the id is stale: this call takes gRPC
            self._opening = True
        new = old = None
        try:
            new = self._open(stub, space_id, deadline)
        finally:
            with self._lock:
                self._opening = False
                stale = self._closed or space_id != self._current()  # closed, or reopened meanwhile
                if not stale:
                    old = self._held[0]
                    self._held = (new, space_id, -math.inf if new is not None else time.monotonic())
            if stale and new is not None:
                new.close()
                new = None
            if old is not None and old is not new:
                old.close()
        return new

    def _open(self, stub, space_id: str, deadline: float) -> ClientLane | None:
        lane = None
        try:
            lane = ClientLane(SLOTS)
            # The ticket and OpenLane together: half the first Lookup's time at most.
            until = time.monotonic() + min(OPEN_SECONDS, max(0.001, (deadline - time.monotonic()) / 2))
            ticket = lane_ticket_for(self._target, lane, max(0.001, until - time.monotonic()))
            opened = lane.opened_by(lambda: stub.OpenLane(
                pb.OpenLaneRequest(space_id=space_id, peer_ticket=ticket),
                timeout=max(0.001, until - time.monotonic()), metadata=self._metadata))
        except (grpc.RpcError, KVClientError, OSError, ValueError) as exc:
            if lane is not None:
                lane.close()
            code = exc.code() if isinstance(exc, grpc.RpcError) else getattr(exc, "code", None)
            (logger.debug if self.refusals else logger.info)(
                "kvserver space lane not opened (%s): the view's Lookups take gRPC",
                code.name if isinstance(code, grpc.StatusCode) else exc)
            self.refusals += 1
            return None
        finally:
            if lane is not None:
                lane.handed_over()
        lane.rpc_mask = opened.rpc_mask
        if not lane.serves("Lookup"):  # a daemon that opened something else: not ours to use
            lane.close()
            self.refusals += 1
            return None
        return lane

    def _drop(self, lane: ClientLane) -> None:
        with self._lock:
            if self._held[0] is lane:
                self._held = (None, "", -math.inf)
        lane.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lane, self._held = self._held[0], (None, "", -math.inf)
        if lane is not None:
            lane.close()
