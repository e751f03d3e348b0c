"""The client without its I/O: every request it sends, every answer it reads, its registration
state, and what each failure means (``_resilience``).

``KVClient`` (threads) and ``AsyncKVClient`` (asyncio) are shells around one ``ClientCore``: they
send what it plans, hand it what comes back, and do what it decides (cancel a session, start
re-registering, confirm that a copy stopped). State changes are made under the core's lock, which
is never held across I/O, so the threaded shell may call it from any thread.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence

import grpc

from kvclient import _messages as msg
from kvclient._ops import Call, Lost, Missed, Op, StreamOp
from kvclient._resilience import (
    CACHE_BEST_EFFORT,
    OUTAGE,
    Backoff,
    confirm_grace,
    is_miss,
    job_unconfirmed,
    needs_register,
)
from kvclient._transport.channel import target
from kvclient.cuda_events import LayerEvents, event_handle
from kvclient.errors import KVClientError
from kvclient.keys import KEY_BYTES, Keys, pack_keys
from kvclient.results import LookupResult, PutResult
from kvserver.protocol import lane_request
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger("kvclient")

TENANT_METADATA = "x-kvserver-tenant"


def call_metadata(token: str | None, tenant_token: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata of every call: the daemon's token (default: KVSERVER_TOKEN) and a tenant token."""
    token = token or os.environ.get("KVSERVER_TOKEN")
    md = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    if tenant_token:
        md.append((TENANT_METADATA, tenant_token))
    return tuple(md) or None


def packed(keys: Keys, key_bytes: int) -> tuple[bytes, int, int]:
    """``keys.pack_keys``, its errors as the client's INVALID_ARGUMENT."""
    try:
        return pack_keys(keys, key_bytes)
    except ValueError as exc:
        raise KVClientError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def lease_list(lease_ids: str | Sequence[str]) -> list[str]:
    return [lease_ids] if isinstance(lease_ids, str) else list(lease_ids)


def _ready(event) -> bytes:
    return b"" if event is None else event_handle(event)


# A re-registration the daemon answers with a refusal (any status but UNAVAILABLE: it came back
# with less memory than the grant, say) is asked again after REFUSED_FIRST seconds, doubling to
# REFUSED_CAP, once it was refused REFUSALS_TO_SLOW times in a row: a refusal costs the daemon the
# pool's opening and checks, and what makes it grant again (an operator, another engine leaving)
# comes in seconds, not milliseconds. A daemon that is away again (UNAVAILABLE, no peer ticket)
# is asked at ``Backoff``'s pace again.
REFUSALS_TO_SLOW = 3
REFUSED_FIRST, REFUSED_CAP = 0.5, 4.0


class Reregistration:
    """The pace and the log of one re-registration's attempts (``Backoff`` while the daemon is
    away; slower once it keeps refusing). A refusal is logged at WARNING, with the daemon's
    reason, the first time it is seen and whenever its status or reason (digits aside: free bytes
    change from one refusal to the next) changes; the others at DEBUG."""

    def __init__(self) -> None:
        self._away = Backoff()
        self._refused = Backoff(REFUSED_FIRST, REFUSED_CAP)
        self.attempts = 0  # tries so far
        self.refusals = 0  # in a row
        self._said: tuple[grpc.StatusCode, str] | None = None

    def next(self) -> float:
        """Seconds to wait before the next attempt."""
        return (self._refused if self.refusals >= REFUSALS_TO_SLOW else self._away).next()

    def failed(self, code: grpc.StatusCode | None, message: str) -> None:
        """An attempt failed with ``code`` (None: no Register was sent, the daemon's fd socket
        did not answer) and ``message``."""
        self.attempts += 1
        if code is None or code in OUTAGE:
            self.refusals = 0
            self._refused.reset()
            logger.debug("re-registration failed: %s", message if code is None else code.name)
            return
        self.refusals += 1
        said = (code, re.sub(r"\d+", "#", message))
        if said == self._said:
            logger.debug("re-registration refused again: %s: %s", code.name, message)
            return
        self._said = said
        logger.warning("kvserver refused the re-registration: %s: %s; writes are dropped and loads miss "
                       "until it grants one (retrying)", code.name, message)

    def succeeded(self) -> None:
        self.attempts += 1


def _sent_already(_reg) -> None:
    raise AssertionError("a failed lane call's op is never sent")


# What a Write or Load sent on the lane in its binary format is judged by if it fails (a copy job,
# missing with 0 bytes: ``KVClient._failed``), without its arguments, which its failure must not
# touch again; ``write`` and ``load`` plan their ops with the same.
LANE_WRITE = Op("Write", _sent_already, _sent_already, 0, job=True)
LANE_LOAD = StreamOp("Load", _sent_already, [], job=True)


class ClientCore:
    def __init__(self, address: str | None, *, timeout: float, token: str | None, resilient: bool,
                 tenant_token: str | None = None) -> None:
        self.target = target(address)
        self.timeout = timeout
        self.resilient = resilient
        self.metadata = call_metadata(token, tenant_token)
        self.request: pb.RegisterRequest | None = None  # the last Register sent (without its ticket)
        self.registration: msg.Registration | None = None
        self.connected = False
        self.closed = False
        self.misses = 0
        self._warned: set[tuple[grpc.StatusCode, str]] = set()  # cache misses' reasons, logged once
        self.reconnects = 0
        self.pool = None  # the registered pool
        self._device = 0  # CUDA pools: the device the layer events are opened on
        self._events: LayerEvents | None = None
        self._session: object | None = None  # the shell's handle on the current registration's session
        self._reconnecting_for: msg.Registration | None = None  # the lost one a re-registration replaces
        self._lock = threading.Lock()

    # ---- settings ---------------------------------------------------------------------------

    @property
    def client_id(self) -> str:
        if self.registration is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        return self.registration.client_id

    @property
    def job_deadline(self) -> float:
        """The gRPC deadline of a Write, Load, Put or Get: later than the job deadline the daemon
        is told (``timeout``), so that its answer, not the client's clock, ends the call."""
        return self.timeout + confirm_grace(self.timeout)

    @property
    def timeout_ms(self) -> int:
        return max(1, int(self.timeout * 1000))

    # ---- registration -----------------------------------------------------------------------

    def register_request(self, **kwargs) -> pb.RegisterRequest:
        """``_messages.register_request`` (the shell adds a peer ticket to what it sends). A
        client that holds a registration already (live, or lost and being re-registered) names it
        as the one this replaces: the daemon releases it, so one client never holds two."""
        kwargs["min_host_tokens"] = kwargs.get("min_host_tokens") or 0
        req = msg.register_request(**kwargs)
        with self._lock:
            held = self.registration if self.registration is not None else self._reconnecting_for
        if held is not None:
            req.replaces_client_id = held.client_id
        return req

    def registered(self, resp: pb.RegisterResponse, req: pb.RegisterRequest,
                   pool) -> tuple[msg.Registration, object | None]:
        """A Register answered: ``req`` is the request to send again after a loss. Returns the
        registration and the session of the one it replaced, for the shell to cancel; a
        re-registration under way for a lost one stops (this one replaced it)."""
        reg = msg.registration(resp, req)
        if req.weights and resp.weights != req.weights:
            logger.warning("kvserver: the daemon did not keep this engine's weights identity %r (a daemon "
                           "older than it?): its pages are not kept apart from those of other weights under "
                           "the model name %r", req.weights, req.model)
        logger.info("registered with kvserver: %d host tokens granted of %d asked (%d bytes each), "
                    "layers [%d, %d)", reg.host_tokens, req.host_tokens, reg.host_bytes_per_token,
                    reg.start_layer, reg.end_layer)
        self.pool = pool
        if reg.layer_events:
            self._device = pool.buffers[0][0].device
        kept = pb.RegisterRequest()
        kept.CopyFrom(req)
        kept.ClearField("replaces_client_id")  # a retry names the registration it then replaces
        with self._lock:
            self.request = kept
            stale = self._session
            self._reconnecting_for = None
            self._adopt(reg)
        return reg, stale

    def _adopt(self, reg: msg.Registration) -> None:
        self.registration = reg
        self.connected = True
        self._session = None

    def hold(self, reg: msg.Registration, session: object) -> bool:
        """The shell opened ``session`` for ``reg``; False if ``reg`` is no longer current
        (lost or closed meanwhile): the shell then cancels it."""
        with self._lock:
            if self.closed or reg is not self.registration or not self.connected:
                return False
            self._session = session
            return True

    def lose(self, reg: msg.Registration | None, reason: str) -> Lost | None:
        """The daemon no longer holds ``reg``: calls miss until a new registration is made. None
        if ``reg`` was not the current live registration (nothing to do)."""
        with self._lock:
            if self.closed or reg is None or reg is not self.registration or not self.connected:
                return None
            self.connected = False
            # Given up: its session ends, so a daemon that still holds it (a slow call, not a dead
            # daemon) reclaims it rather than keeping it beside the next registration.
            session, self._session = self._session, None
            reconnect = self.resilient and self.request is not None and self._reconnecting_for is None
            if reconnect:
                self._reconnecting_for = reg
        if reconnect:
            logger.warning("kvserver registration lost (%s); writes are dropped and loads miss until "
                           "the daemon is back", reason)
        return Lost(session, reconnect)

    def retry_request(self, old: msg.Registration) -> pb.RegisterRequest | None:
        """The registration request again, naming the registration it replaces: a daemon that
        still holds that one (a slow call, not a restart) releases it first. None: stop trying
        (closed or unregistered)."""
        with self._lock:
            if self.closed or self.request is None or self._reconnecting_for is not old:
                return None
            req = pb.RegisterRequest()
            req.CopyFrom(self.request)
        req.replaces_client_id = old.client_id
        return req

    def reregistered(self, resp: pb.RegisterResponse, old: msg.Registration,
                     attempts: int) -> msg.Registration | None:
        """A re-registration answered: the new registration, or None if the client was closed or
        unregistered meanwhile."""
        with self._lock:
            if self.closed or self.request is None or self._reconnecting_for is not old:
                return None
            reg = msg.registration(resp, self.request)
            self._adopt(reg)
            self._reconnecting_for = None
            self.reconnects += 1
        logger.warning("kvserver registration restored after %d attempts", attempts)
        return reg

    def reconnect_ended(self, old: msg.Registration) -> None:
        """The re-registration for ``old`` stopped (whatever the reason)."""
        with self._lock:
            if self._reconnecting_for is old:
                self._reconnecting_for = None

    def unregistering(self) -> tuple[msg.Registration | None, object | None]:
        """Forgets the registration: (the one to unregister, its session to cancel)."""
        with self._lock:
            reg, self.registration, self.request = self.registration, None, None
            self.connected = False
            session, self._session = self._session, None
            self._reconnecting_for = None
        return reg, session

    def unregister_failed(self, error: KVClientError) -> None:
        """An Unregister that failed: raised unless it only means the daemon has no such client."""
        if not (self.resilient and is_miss(error.code)):
            raise error

    def unregistered(self, copies_pending: bool = False) -> None:
        """The daemon confirmed the registration is gone, mappings closed: a CUDA pool may let
        torch reuse its memory once the engine frees it. Not while the daemon says copies of it
        may still run on the GPU (quarantined): torch must not hand that memory to anything else."""
        pool, self.pool = self.pool, None
        if copies_pending:
            logger.warning("kvserver still holds GPU copies of this pool (quarantined): its memory "
                           "stays exported, so torch will not reuse it")
            return
        release = getattr(pool, "release_exports", None)
        if release is not None:
            release()

    def closing(self) -> object | None:
        """The client closes: nothing more is adopted or retried; returns the session to cancel."""
        with self._lock:
            self.closed = True
            self.connected = False
            session, self._session = self._session, None
            self._reconnecting_for = None
        return session

    # ---- calls and their failures -----------------------------------------------------------

    def start(self, op: Op) -> Call | Missed:
        """What to send for ``op`` now, or its miss (the registration is known lost)."""
        if not op.registered:
            return Call(op, None, op.build(None), self.timeout)
        reg = self.registration
        if reg is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        if not self.connected:
            return Missed(self.disconnected(op.miss))
        return Call(op, reg, op.build(reg), op.timeout or (self.job_deadline if op.job else self.timeout))

    def start_stream(self, op: StreamOp) -> Call | Missed:
        """A Load or Get to send now (with its layers and CUDA layer events), or the layers of a
        missed handle."""
        reg = self.registration
        if reg is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        layers = reg.load_layers(op.layers)
        if not self.connected:
            return Missed(self.disconnected(layers))
        events = self.layer_events(reg, layers, op.event_slot)
        return Call(op, reg, op.build(reg), self.job_deadline, layers, events)

    def layer_events(self, reg: msg.Registration, layers: list[int], event_slot: int) -> dict[int, object]:
        """CUDA pools: global layer -> the event of ``event_slot`` a load of ``layers`` records."""
        if not reg.layer_events:
            return {}
        opened = self._layer_events(reg)
        return {g: opened.event(event_slot, g - reg.start_layer) for g in layers}

    def disconnected(self, on_miss):
        """A call while the registration is lost: a miss, or (not resilient) an error."""
        if not self.resilient:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE,
                                "the registration was lost (daemon unreachable, restarted or reclaimed it)")
        self._count_miss()
        return on_miss

    def unconfirmed(self, call: Call, error: KVClientError) -> bool:
        """A copy job failed without the daemon confirming that it is dead: the shell must
        confirm it (``confirm_request``) before reporting the failure."""
        return call.op.job and job_unconfirmed(error.code, error.job_ended)

    def judge(self, error: KVClientError, reg: msg.Registration | None,
              cache: bool = False) -> tuple[bool, bool]:
        """(a miss, not raised; the registration is lost and must be given up). In resilient mode
        a failure that means "not there" is a miss, counted. The node-wide cache is best effort:
        a cache call the daemon cannot serve now (a limit reached, slabs not pinned yet, or a part
        whose layer range this engine disagrees with) is a miss too, logged once per reason so
        that a misconfigured engine does not miss in silence."""
        if reg is None or not self.resilient:
            return False, False
        if cache and error.code in CACHE_BEST_EFFORT:
            self._count_miss()
            reason = (error.code, error.message[:80])
            if reason not in self._warned:
                self._warned.add(reason)
                logger.warning("kvserver cache call missed: %s: %s", error.code.name, error.message)
            return True, False
        if not is_miss(error.code):
            return False, False
        self._count_miss()
        return True, needs_register(error.code)

    def confirm_request(self, reg: msg.Registration) -> pb.UnregisterRequest | None:
        """A copy got no answer in time, so it might still run: Unregister stops every job of the
        registration and answers once they are dead; then the client registers anew (see
        docs/reliability.md). None once closed: there is no channel left to ask on."""
        return None if self.closed else pb.UnregisterRequest(client_id=reg.client_id)

    def confirmed(self, resp: pb.UnregisterResponse | None, error: KVClientError | None = None) -> bool:
        """Whether the answer to ``confirm_request`` says the jobs are dead."""
        if resp is not None:
            ok = not resp.copies_pending  # GPU work that may still run is not dead
        else:
            ok = error is not None and error.code == grpc.StatusCode.NOT_FOUND  # released already
        if not ok:
            logger.warning("kvserver did not confirm that a timed-out copy stopped; its device slots "
                           "may still be written until the daemon drops the registration")
        return ok

    def _count_miss(self) -> None:
        with self._lock:  # engine threads miss at the same time
            self.misses += 1

    def _layer_events(self, reg: msg.Registration) -> LayerEvents:
        if self._events is None or self._events.handles is not reg.layer_events:
            self._events = LayerEvents(reg.layer_events, reg.end_layer - reg.start_layer, self._device)
        return self._events

    # ---- the RPCs ---------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> Op:
        return Op("Alloc", lambda r: pb.AllocRequest(client_id=r.client_id, num_tokens=num_tokens),
                  msg.host_tensor)

    def free(self, host_indices: msg.Indices) -> Op:
        ids = msg.ids(host_indices)
        return Op("Free", lambda r: pb.FreeRequest(client_id=r.client_id, host_indices=ids),
                  lambda resp: resp.freed_tokens, 0)

    def write(self, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None,
              ready_event) -> Op:
        """A Write as a protobuf request (the shell first tries ``write_packed`` on the lane)."""
        host, dev = msg.index_array(host_indices), msg.index_array(device_indices)
        lay, ready = msg.layer_list(layers), _ready(ready_event)
        return Op("Write", lambda r: pb.WriteRequest(client_id=r.client_id, host_indices=msg.ids(host),
                                                     device_indices=msg.ids(dev), layers=lay,
                                                     ready_event=ready, timeout_ms=self.timeout_ms),
                  lambda resp: resp.bytes, LANE_WRITE.miss, job=LANE_WRITE.job)

    def load(self, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None,
             event_slot: int, ready_event) -> StreamOp:
        """A Load as a protobuf request (the shell first tries ``load_packed`` on the lane)."""
        host, dev = msg.index_array(host_indices), msg.index_array(device_indices)
        lay, ready = msg.layer_list(layers), _ready(ready_event)

        def build(r: msg.Registration) -> pb.LoadRequest:
            return pb.LoadRequest(client_id=r.client_id, host_indices=msg.ids(host),
                                  device_indices=msg.ids(dev), layers=lay, event_slot=event_slot,
                                  ready_event=ready, timeout_ms=self.timeout_ms)

        return StreamOp("Load", build, lay, event_slot, job=LANE_LOAD.job)

    def write_packed(self, reg: msg.Registration, host_indices: msg.Indices, device_indices: msg.Indices,
                     layers: list[int], ready_event) -> bytes | None:
        """A Write's request in the lane's binary format for ``reg``, or None where it has none
        (indices that are not whole pages: ``write``'s protobuf request carries those); ``layers``
        as ``msg.layer_list`` gives them."""
        return self._packed(lane_request.KIND_WRITE, reg, host_indices, device_indices, layers, 0,
                            ready_event)

    def load_packed(self, reg: msg.Registration, host_indices: msg.Indices, device_indices: msg.Indices,
                    layers: list[int], event_slot: int, ready_event) -> bytes | None:
        """``write_packed`` for a Load."""
        return self._packed(lane_request.KIND_LOAD, reg, host_indices, device_indices, layers, event_slot,
                            ready_event)

    def _packed(self, kind: int, reg: msg.Registration, host_indices: msg.Indices,
                device_indices: msg.Indices, layers: list[int], event_slot: int, ready_event) -> bytes | None:
        return lane_request.pack_at(kind, msg.index_source(host_indices), msg.index_source(device_indices),
                                    layers, reg.page_size, self.timeout_ms, event_slot, _ready(ready_event))

    def available_size(self) -> Op:
        def read(resp: pb.StatsResponse) -> int:
            c = resp.clients[0]
            return c.capacity_tokens - c.used_tokens

        return Op("Stats", lambda r: pb.StatsRequest(client_id=r.client_id), read, 0)

    def stats(self, all_clients: bool) -> Op:
        req = pb.StatsRequest(client_id="" if all_clients else self.client_id)
        return Op("Stats", lambda r: req, lambda resp: resp, registered=False)

    def lookup(self, keys: Keys, pin_ms: int, whole_space: bool, key_bytes: int = KEY_BYTES,
               timeout: float | None = None, memory_only: bool = False) -> Op:
        data, width, _ = packed(keys, key_bytes)
        # Its bound travels in the request too: on the fast lane no gRPC deadline ends it.
        timeout_ms = max(1, int((timeout or self.timeout) * 1000))
        return Op("Lookup", lambda r: pb.LookupRequest(client_id=r.client_id, keys=data, key_bytes=width,
                                                       pin_ms=pin_ms, whole_space=whole_space,
                                                       memory_only=memory_only, timeout_ms=timeout_ms),
                  LookupResult.from_wire, LookupResult(0),
                  cache=True, timeout=timeout)

    def put(self, keys: Keys, device_pages: msg.Indices, ready_event, key_bytes: int = KEY_BYTES) -> Op:
        data, width, count = packed(keys, key_bytes)
        pages, ready = msg.ids(device_pages), _ready(ready_event)
        return Op("Put", lambda r: pb.PutRequest(client_id=r.client_id, keys=data, key_bytes=width,
                                                 device_pages=pages, ready_event=ready,
                                                 timeout_ms=self.timeout_ms),
                  lambda resp: PutResult(resp.stored, resp.present, resp.dropped, resp.bytes),
                  PutResult(dropped=count), job=True, cache=True)

    def get(self, keys: Keys, device_pages: msg.Indices, layers: Iterable[int] | None, event_slot: int,
            ready_event, lease_id: str, key_bytes: int = KEY_BYTES) -> StreamOp:
        data, width, _ = packed(keys, key_bytes)
        pages, lay, ready = msg.ids(device_pages), msg.layer_list(layers), _ready(ready_event)
        return StreamOp("Get", lambda r: pb.GetRequest(client_id=r.client_id, keys=data, key_bytes=width,
                                                       device_pages=pages, layers=lay,
                                                       event_slot=event_slot, ready_event=ready,
                                                       timeout_ms=self.timeout_ms, lease_id=lease_id),
                        lay, event_slot, get=True)

    def get_parts(self, parts: Sequence[tuple[Keys, msg.Indices, str]], layers: Iterable[int] | None,
                  event_slot: int, ready_event, key_bytes: int = KEY_BYTES) -> StreamOp:
        """Several Gets as one (``GetRequest.parts``): (keys, device pages, lease) each."""
        built, widths = [], set()
        for keys, device_pages, lease_id in parts:
            data, width, _ = packed(keys, key_bytes)
            if data:
                widths.add(width)
            built.append((data, msg.ids(device_pages), lease_id))
        if len(widths) > 1:
            raise KVClientError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the parts of one Get have keys of {sorted(widths)} bytes, not one width")
        width = widths.pop() if widths else key_bytes
        lay, ready = msg.layer_list(layers), _ready(ready_event)
        return StreamOp("Get", lambda r: pb.GetRequest(
            client_id=r.client_id, key_bytes=width, layers=lay, event_slot=event_slot, ready_event=ready,
            timeout_ms=self.timeout_ms,
            parts=[pb.GetPart(keys=d, device_pages=p, lease_id=lease) for d, p, lease in built]),
            lay, event_slot, get=True, lane=False)

    def release(self, lease_ids: str | Sequence[str]) -> Op:
        ids = lease_list(lease_ids)
        return Op("Release", lambda r: pb.ReleaseRequest(client_id=r.client_id, lease_ids=ids),
                  lambda resp: resp.released, 0, cache=True)
