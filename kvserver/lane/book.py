"""Opening lanes (the OpenLane RPC's checks): a lane belongs to one registration, and only the
process that registered it may open it. Its release (Unregister, reclaim, replacement, daemon
stop) closes the lane: ``KVCore._release`` awaits ``ClientState.lane.close()``."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from kvserver.core.client_state import public_id
from kvserver.core.kvcore import KVCore
from kvserver.errors import FailedPrecondition, NoCapacity, PermissionDenied
from kvserver.lane.plane import DataPlane
from kvserver.lane.server import Lane, open_ring
from kvserver.peers.tenants import tenant_of

logger = logging.getLogger(__name__)


# Descriptors (doorbell sockets: 1 + one per slot) the open lanes of one uid hold together.
MAX_LANE_FDS_PER_UID = 4096


class LaneBook:
    def __init__(self, core: KVCore,
                 run: Callable[[str, str, bytes, Callable[[Any], None]], Awaitable[bytes]],
                 plane: DataPlane | None = None) -> None:
        self.core = core
        self.run = run
        self.plane = plane  # the compiled data plane (kvserver.lane.plane), if it runs
        self.lanes: set[Lane] = set()
        self.max_fds_per_uid = MAX_LANE_FDS_PER_UID
        self._fds_per_uid: Counter[int] = Counter()

    async def drain(self, grace: float) -> None:
        """At shutdown: every lane finishes what it runs within ``grace`` and takes nothing new."""
        if self.plane is not None:
            # First no new request, and what the plane handed over until now taken: the lanes'
            # drains below then wait for all of it.
            self.plane.unwatch_all()
            self.plane.take_handoffs()
        waits = [lane.drain(grace) for lane in list(self.lanes)]
        if self.plane is not None:
            waits.append(self.plane.drain(grace))
        if waits:
            await asyncio.gather(*waits)

    async def open(self, client_id: str, peer_ticket: str, named_tenant: str | None) -> Lane:
        tickets = self.core.tickets
        if tickets is None:
            raise FailedPrecondition("this daemon has no Unix socket: lanes need its fd socket")
        ticket = tickets.redeem(peer_ticket)  # spent whatever happens next
        try:
            client = self.core.client(client_id)
            peer = client.peer
            if peer is None or (peer.uid, peer.pid) != (ticket.peer.uid, ticket.peer.pid):
                raise PermissionDenied("only the process that registered a client may open its lane")
            if tenant_of(named_tenant, ticket.peer) != client.tenant:
                raise PermissionDenied("a lane is opened with the tenant of its registration")
            if client.lane is not None:
                raise FailedPrecondition("this registration has a lane open already")
            uid, held = ticket.peer.uid, self._fds_per_uid[ticket.peer.uid]
            if held + len(ticket.fds) - 1 > self.max_fds_per_uid:  # the ring's own fd is closed
                raise NoCapacity(
                    f"uid {uid}'s lanes hold {held} descriptors; this one would pass the most one uid's "
                    f"lanes may hold ({self.max_fds_per_uid}): its calls go over gRPC"
                )
            ring, submit, done = open_ring(ticket.fds)
        except BaseException:
            ticket.close_off_loop()  # a peer's memfd may be the last reference to many pages
            raise
        ticket.fds = []  # the lane owns them now
        gate = None
        # With copies of the client already running on the loop (a concurrent gRPC call), they hold
        # no turn the plane would see: its lane is served on the loop, which orders them all.
        if self.plane is not None and not client.inflight:
            try:
                gate = self.plane.gate_for(client, self.core.max_request_indices)
            except Exception:  # its lane is served on the loop, as without a plane
                logger.exception("the data plane cannot serve %s's lane", public_id(client_id))
        on_served = gate.py_exit if gate is not None else None
        lane = Lane(client_id, ring, submit, done, functools.partial(self.run, client_id), on_served)
        try:
            lane.start(self.plane, gate)
        except BaseException:
            ring.close()
            for s in (submit, *done):
                s.close()
            raise
        client.lane = lane
        client.gate = gate
        self.lanes.add(lane)
        fds = 1 + len(done)
        self._fds_per_uid[uid] += fds

        def closed(lane: Lane) -> None:
            self.lanes.discard(lane)
            self._fds_per_uid[uid] -= fds
            if self._fds_per_uid[uid] <= 0:
                del self._fds_per_uid[uid]

        lane.on_close = closed
        logger.info("lane of %d slots opened for %s (%s)", lane.slots, public_id(client_id),
                    "compiled data plane" if gate is not None else "served on the event loop")
        return lane
