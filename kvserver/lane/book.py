"""Opening lanes (the OpenLane RPC's checks). A registration's lane belongs to it, and only the
process that registered it may open it; its release (Unregister, reclaim, replacement, daemon
stop) closes the lane: ``KVCore._release`` awaits ``ClientState.lane.close()``. A space's lane
(a scheduler's Lookups, ``open_space``) belongs to no registration: any process of the space's
tenant may open one, and it closes when that process closes its end, or at the daemon's stop."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from kvserver.core.client_state import public_id
from kvserver.core.kvcore import KVCore, settle
from kvserver.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVError,
    NoCapacity,
    PermissionDenied,
    Unavailable,
    UnknownClient,
)
from kvserver.lane.plane import DataPlane
from kvserver.lane.server import Lane, open_ring
from kvserver.peers.tenants import tenant_of
from kvserver.peers.tickets import PEER_GONE, process_exited

logger = logging.getLogger(__name__)

# run(client_id or space_id, rpc name, request bytes, progress callback) -> response bytes
Runner = Callable[[str, str, bytes, Callable[[Any], None]], Awaitable[bytes]]


# Descriptors (doorbell sockets: 1 + one per slot) the open lanes of one uid hold together.
MAX_LANE_FDS_PER_UID = 4096
# Space lanes (schedulers' Lookups): no registration bounds them, so one uid may hold at most
# MAX_SPACE_LANES_PER_UID, the daemon MAX_SPACE_LANES, each of at most MAX_SPACE_LANE_SLOTS slots.
MAX_SPACE_LANES_PER_UID = 16
MAX_SPACE_LANES = 256
MAX_SPACE_LANE_SLOTS = 4
# The data plane's bookkeeping of one uid's pools (``DataPlane.gate_bytes``: per device token, in
# the daemon's memory): a share of the node's memory; past it, a lane is served on the loop.
MAX_PLANE_BYTES_PER_UID = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 32


def _pidfd(ticket: Any) -> int:
    """A pidfd of the ticket's process (readable once it exits): the one taken when it connected
    to the fd socket, else one opened now; -1 where the kernel has none (end-of-file alone then
    closes the lane). Refused if that process has exited already."""
    fd = ticket.take_pidfd()
    if fd == PEER_GONE:
        raise FailedPrecondition("the process that asked for the lane has exited")
    if fd < 0:  # this kernel gave no pidfd of the peer: one of its pid, now
        try:
            fd = os.pidfd_open(ticket.peer.pid)
        except ProcessLookupError:
            raise FailedPrecondition("the process that asked for the lane has exited") from None
        except OSError:  # no pidfd (Linux < 5.3, a pid not seen here)
            return -1
    try:
        exited = process_exited(fd)
    except BaseException:
        os.close(fd)
        raise
    if exited:
        os.close(fd)
        raise FailedPrecondition("the process that asked for the lane has exited")
    return fd


class LaneBook:
    def __init__(self, core: KVCore, run: Runner, plane: DataPlane | None = None,
                 run_space: Runner | None = None, fast: Callable[..., bool] | None = None,
                 fast_space: Callable[..., bool] | None = None) -> None:
        self.core = core
        self.run = run  # run(client_id, rpc, request bytes, progress): a registration's lane request
        # fast(client_id, lane, slot, rpc id, request bytes, counted): a Get or Put the data plane
        # copies, served without a task (server.Fast), for the lanes the plane serves
        self.fast = fast
        # fast_space(space_id, lane, slot, rpc id, request bytes, counted): a space lane's Lookup
        # served without a task (server.Fast)
        self.fast_space = fast_space
        self.run_space = run_space  # run_space(space_id, ...): a space lane's request
        self.space_lanes: set[Lane] = set()
        self.max_space_lanes_per_uid = MAX_SPACE_LANES_PER_UID
        self.max_space_lanes = MAX_SPACE_LANES
        self.stopping = False  # set by drain: no lane opens any more
        self._space_lanes_per_uid: Counter[int] = Counter()
        self.plane = plane  # the compiled data plane (kvserver.lane.plane), if it runs
        self.lanes: set[Lane] = set()
        self.max_fds_per_uid = MAX_LANE_FDS_PER_UID
        self._fds_per_uid: Counter[int] = Counter()
        self.max_plane_bytes_per_uid = MAX_PLANE_BYTES_PER_UID
        self._plane_bytes_per_uid: Counter[int] = Counter()

    async def drain(self, grace: float) -> None:
        """At shutdown: every lane finishes what it runs within ``grace`` and takes nothing new."""
        self.stopping = True
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
        # No release closes a space's lane: the stop does, once its Lookups had their grace (a
        # lane already closing itself, its peer gone, stays in space_lanes until it has closed).
        await asyncio.gather(*(lane.close() for lane in list(self.space_lanes)), return_exceptions=True)

    async def open(self, client_id: str, peer_ticket: str, named_tenant: str | None) -> Lane:
        ticket = self._redeem(peer_ticket)
        try:
            client = self.core.client(client_id)
            peer = client.peer
            if peer is None or (peer.uid, peer.pid) != (ticket.peer.uid, ticket.peer.pid):
                raise PermissionDenied("only the process that registered a client may open its lane")
            if tenant_of(named_tenant, ticket.peer) != client.tenant:
                raise PermissionDenied("a lane is opened with the tenant of its registration")
            if client.lane is not None:
                raise FailedPrecondition("this registration has a lane open already")
            ring, submit, done = self._take_ring(ticket)
        except BaseException:
            ticket.close_off_loop()  # a peer's memfd may be the last reference to many pages
            raise
        ticket.fds, ticket.doorbells = [], []  # the lane owns them now
        gate = None
        uid, plane_bytes = ticket.peer.uid, 0
        # With copies of the client already running on the loop (a concurrent gRPC call), they hold
        # no turn the plane would see: its lane is served on the loop, which orders them all.
        if self.plane is not None and not client.inflight:
            plane_bytes = self.plane.gate_bytes(client)
            if self._plane_bytes_per_uid[uid] + plane_bytes > self.max_plane_bytes_per_uid:
                logger.info("%s's lane is served on the event loop: the data plane's bookkeeping of "
                            "uid %d's pools would pass %d bytes", public_id(client_id), uid,
                            self.max_plane_bytes_per_uid)
            else:
                try:
                    gate = self.plane.gate_for(client, self.core.max_request_indices)
                except Exception:  # its lane is served on the loop, as without a plane
                    logger.exception("the data plane cannot serve %s's lane", public_id(client_id))
        if gate is None:
            plane_bytes = 0
        on_served = gate.py_exit if gate is not None else None
        fast = functools.partial(self.fast, client_id) if gate is not None and self.fast is not None else None
        lane = Lane(public_id(client_id), ring, submit, done, functools.partial(self.run, client_id),
                    on_served, fast=fast)
        # Both before its opening, which waits for the plane's thread: another open is refused, a
        # gRPC copy meanwhile takes its turn through the gate (ordered with the lane's), and a
        # release meanwhile shuts the gate and closes the lane (which waits for the opening).
        client.lane = lane
        client.gate = gate
        try:
            await self._start(lane, ring, submit, done, uid, gate, plane_bytes=plane_bytes)
        except BaseException as exc:
            if client.closing:  # (a release holds the lane and the gate, to close them)
                if isinstance(exc, Exception):
                    raise UnknownClient(f"client {public_id(client_id)} was released while its lane "
                                        "opened") from exc
                raise
            if client.lane is lane:
                client.lane = None
            if client.gate is gate:
                if lane.was_on_plane and gate is not None:  # its copies there end before it goes
                    await settle(asyncio.ensure_future(self.plane.idle(gate)))
                client.gate = None
            raise
        if client.closing or lane.closing:  # released while it opened: its release closes it too
            await lane.close()
            raise UnknownClient(f"client {public_id(client_id)} was released while its lane opened")
        if self.stopping:  # the drain began while it opened: over gRPC until the stop's release
            await lane.close()
            raise Unavailable("the daemon is stopping: it opens no lane")
        logger.info("lane of %d slots opened for %s (%s)", lane.slots, public_id(client_id),
                    "compiled data plane" if gate is not None else "served on the event loop")
        return lane

    async def open_space(self, space_id: str, peer_ticket: str, named_tenant: str | None,
                         space_tenant: Callable[[str], str]) -> Lane:
        """A scheduler's lane of a KV space: opened by a process of the space's tenant
        (``space_tenant(space_id)``: the space's tenant, or NotFound), it carries only Lookups of
        that space, served on the loop (``run_space``), and closes itself when the process exits or
        closes its end of the submit doorbell (it closed the view), or at the daemon's stop."""
        ticket = self._redeem(peer_ticket, pidfd=True)
        try:
            if self.run_space is None:
                raise FailedPrecondition("this daemon serves no space's lane")
            tenant = space_tenant(space_id)
            if tenant_of(named_tenant, ticket.peer) != tenant:
                raise PermissionDenied("a space's lane is opened by a process of the space's tenant")
            uid = ticket.peer.uid
            if self._space_lanes_per_uid[uid] >= self.max_space_lanes_per_uid:
                raise NoCapacity(f"uid {uid} has {self._space_lanes_per_uid[uid]} space lanes open, the most "
                                 f"one uid may ({self.max_space_lanes_per_uid}): its Lookups go over gRPC")
            if len(self.space_lanes) >= self.max_space_lanes:
                raise NoCapacity(f"the daemon has {len(self.space_lanes)} space lanes open, the most it "
                                 "holds: the Lookups go over gRPC")
            if len(ticket.doorbells) - 1 > MAX_SPACE_LANE_SLOTS:
                raise InvalidArgument(f"a space's lane has at most {MAX_SPACE_LANE_SLOTS} slots; "
                                      f"{len(ticket.doorbells)} doorbells asked for")
            # Its process's end: the lane closes when the process exits, even if the doorbell's
            # other end lives on (handed back to the daemon, or held by a child it forked).
            gone = _pidfd(ticket)
            try:
                ring, submit, done = self._take_ring(ticket)
            except BaseException:
                if gone >= 0:
                    os.close(gone)
                raise
        except BaseException:
            ticket.close_off_loop()
            raise
        ticket.fds, ticket.doorbells = [], []  # the lane owns them now
        owner = f"space {public_id(space_id)}"
        fast = functools.partial(self.fast_space, space_id) if self.fast_space is not None else None
        lane = Lane(owner, ring, submit, done, functools.partial(self.run_space, space_id),
                    close_when_gone=True, peer_gone_fd=gone, fast=fast)
        gate = None
        if self.plane is not None and fast is not None:
            try:  # the plane answers its Lookups once the space has all its parts (CacheOps)
                gate = self.plane.space_gate()
            except Exception:  # its lane is served on the loop, as without a plane
                logger.exception("the data plane cannot serve %s's lane", owner)

        def closed() -> None:
            if gate is not None:  # it answers nothing more (its Lookups' ends are let go)
                self.plane.close_gate(gate)
            self._space_lanes_per_uid[uid] -= 1
            if self._space_lanes_per_uid[uid] <= 0:
                del self._space_lanes_per_uid[uid]

        # Counted from before its opening, which waits for the plane's thread (the count given
        # back by its close, or by a failed opening).
        self._space_lanes_per_uid[uid] += 1
        self.space_lanes.add(lane)
        lane.on_closed = self.space_lanes.discard
        try:
            await self._start(lane, ring, submit, done, uid, gate, closed)
        except BaseException:
            self.space_lanes.discard(lane)
            lane.close_gone_fd()  # (once: a close, the drain's, may be letting go of it too)
            raise
        if self.stopping:  # the drain began while it opened
            await lane.close()
            raise Unavailable("the daemon is stopping: it opens no lane")
        logger.info("lane of %d slots opened for %s (its Lookups, %s)", lane.slots, owner,
                    "compiled data plane" if gate is not None else "on the event loop")
        return lane

    def spend(self, peer_ticket: str) -> None:
        """Redeems and drops a ticket whose request is refused before it is read: its
        descriptors go now, not at the ticket's expiry."""
        tickets = self.core.tickets
        if tickets is not None and peer_ticket:
            try:
                tickets.redeem(peer_ticket).close_off_loop()
            except KVError:  # unknown or spent: nothing held
                pass

    def _redeem(self, peer_ticket: str, pidfd: bool = False) -> Any:
        if self.stopping:
            self.spend(peer_ticket)
            raise Unavailable("the daemon is stopping: it opens no lane")
        tickets = self.core.tickets
        if tickets is None:
            raise FailedPrecondition("this daemon has no Unix socket: lanes need its fd socket")
        return tickets.redeem(peer_ticket, pidfd)  # spent whatever happens next

    def _take_ring(self, ticket: Any) -> tuple[Any, Any, list[Any]]:
        """The ticket's ring and doorbells, checked, within its uid's descriptor budget."""
        uid, held = ticket.peer.uid, self._fds_per_uid[ticket.peer.uid]
        if held + len(ticket.fds) + len(ticket.doorbells) > self.max_fds_per_uid:  # (the ring's
            # mapping keeps a copy of its fd)
            raise NoCapacity(
                f"uid {uid}'s lanes hold {held} descriptors; this one would pass the most one uid's "
                f"lanes may hold ({self.max_fds_per_uid}): its calls go over gRPC"
            )
        return open_ring(ticket.fds, ticket.doorbells)

    async def _start(self, lane: Lane, ring: Any, submit: Any, done: list[Any], uid: int, gate: Any,
                     also: Callable[[], None] | None = None, plane_bytes: int = 0) -> None:
        """Starts serving ``lane`` and books its descriptors (and ``plane_bytes`` of the data
        plane's bookkeeping), from before its opening (a close meanwhile gives them back); ``also``
        runs when it closes, or when its opening fails."""
        self.lanes.add(lane)
        fds = 2 + len(done)  # the ring's mapping's copy of its fd, the doorbells
        self._fds_per_uid[uid] += fds
        if plane_bytes:
            self._plane_bytes_per_uid[uid] += plane_bytes
        given_back = False

        def closed(lane: Lane) -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            self.lanes.discard(lane)
            self._fds_per_uid[uid] -= fds
            if self._fds_per_uid[uid] <= 0:
                del self._fds_per_uid[uid]
            if plane_bytes:
                self._plane_bytes_per_uid[uid] -= plane_bytes
                if self._plane_bytes_per_uid[uid] <= 0:
                    del self._plane_bytes_per_uid[uid]
            if also is not None:
                also()

        lane.on_close = closed
        try:
            await lane.start(self.plane, gate)
        except BaseException as exc:
            closed(lane)
            ring.close()
            for s in (submit, *done):
                s.close()
            if isinstance(exc, OSError) and exc.errno == errno.ESHUTDOWN:  # behind the stop's unwatch_all
                raise Unavailable("the daemon is stopping: it opens no lane") from exc
            if isinstance(exc, RuntimeError) and self.plane is not None and self.plane.stopped:
                raise Unavailable("the daemon is stopping: it opens no lane") from exc
            if isinstance(exc, OSError):  # its doorbell cannot be watched (ENOMEM, ENOSPC): never served
                raise NoCapacity(f"the daemon cannot watch this lane's doorbell ({exc.strerror}): "
                                 "its calls go over gRPC") from exc
            raise
