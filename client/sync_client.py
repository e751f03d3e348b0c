"""Synchronous client, safe to call from engine threads.

The client keeps its registration alive with a Session stream, and in resilient mode (the
default) survives the daemon going away: writes and puts are dropped, loads, gets and lookups
report a miss, and a background thread re-registers with backoff once the daemon is back (see
``_resilience``). What to send and what each answer means is ``ClientCore``'s; this shell only
sends it, on threads.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from kvclient import _messages as msg
from kvclient._ops import Call, Missed, Op, StreamOp
from kvclient._shell import CoreShell
from kvclient._transport.channel import CHANNEL_OPTIONS
from kvclient._transport.fd_socket import fd_socket_path, lane_ticket_for, ticketed
from kvclient._transport.lane import ClientLane, release_late
from kvclient.core import LANE_LOAD, LANE_WRITE, ClientCore, Reregistration
from kvclient.cuda_pool import CudaKVPool
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.keys import KEY_BYTES, Keys
from kvclient.load_handle import LATER, LoadHandle
from kvclient.results import LookupResult, PutResult
from kvclient.shm_pool import ShmKVPool
from kvclient.views_pool import KVViewsPool
from kvserver.protocol import ring as R
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# The unary calls the fast lane carries, with their response messages.
LANE_UNARY = {"Write": pb.WriteResponse, "Put": pb.PutResponse, "Lookup": pb.LookupResponse}


class KVClient(CoreShell):
    """One engine process's connection to the daemon and its registration.

    ``resilient`` (default True): when the daemon is unreachable, restarted, or no longer knows
    the registration or its pages, ``write`` returns 0, ``load`` and ``get`` return a missed
    handle, ``alloc`` returns None, ``free`` and ``release`` 0, ``lookup`` no pages and ``put``
    every page dropped, counted in ``misses``; the client re-registers by itself. Requests that
    are wrong still raise ``KVClientError``. With ``resilient=False`` every failure raises.
    ``tenant_token``: sent with every call (``x-kvserver-tenant``), it puts the client's cached
    pages in that token's tenant.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 5.0, token: str | None = None,
                 resilient: bool = True, tenant_token: str | None = None, lane: str = "auto") -> None:
        if lane not in ("auto", "grpc"):
            raise ValueError(f"lane must be 'auto' or 'grpc', not {lane!r}")
        self._core = ClientCore(address, timeout=timeout, token=token, resilient=resilient,
                                tenant_token=tenant_token)
        # "auto": Write, Load, Put, Get and Lookup take the fast lane (docs/lane.md) once it is open.
        self.lane_mode = lane
        self._lane: ClientLane | None = None
        # Lanes of lost registrations, closed without waking their calls (``_close_lane``): shut
        # once a registration replaced theirs, or the client closes.
        self._lost_lanes: list[ClientLane] = []
        self._lane_lock = threading.Lock()  # over _lane and _lost_lanes (never held across a close)
        self._lane_refused = False
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self._loaders = ThreadPoolExecutor(8, thread_name_prefix="kvclient-load")
        # The confirming Unregister of each registration whose copy went unanswered (one at a time)
        self._confirms: dict[str, Future] = {}
        self._confirm_lock = threading.Lock()
        self._closed = threading.Event()

    # ---- I/O --------------------------------------------------------------------------------

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _run(self, op: Op):
        """A unary call planned as ``op``: on the lane (its protobuf request) where it is open for
        the registration and carries the call, else on gRPC."""
        lane = self._lane
        call = self._core.start(op)
        if isinstance(call, Missed):
            return call.value
        got = None
        try:
            if lane is not None and op.rpc in LANE_UNARY and lane.reg is call.reg and lane.serves(op.rpc):
                if op.rpc == "Lookup" and call.request.pin_ms:
                    # No gRPC deadline ends it, and the daemon's bound starts when its loop takes the
                    # request: an answer with a lease may come after this call gave up.
                    got = lane.unary(op.rpc, call.request.SerializeToString(), call.timeout,
                                     functools.partial(self._release_late, call.reg),
                                     call.request.pin_ms / 1000)
                else:
                    got = lane.unary(op.rpc, call.request.SerializeToString(), call.timeout)
            if got is not None:
                return op.read(LANE_UNARY[op.rpc].FromString(got))
            resp = getattr(self._stub, op.rpc)(call.request, timeout=call.timeout,
                                               metadata=self._core.metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        except KVClientError as exc:
            error = exc
        else:
            return op.read(resp)
        return self._failed(call, error)

    def _failed(self, call: Call, error: KVClientError):
        """A unary call failed: its miss, or ``error`` raised (a Write or Put the daemon did not
        say is dead is confirmed stopped first)."""
        if self._core.unconfirmed(call, error):
            self._confirm_stopped(call.reg)
        if self._is_miss(error, call.reg, call.op.cache):
            return call.op.miss
        raise error from None

    def _release_late(self, reg: msg.Registration, response: bytes) -> None:
        """A pinning Lookup's answer that came on the lane after the call gave up (on the lane's
        watching thread): the lease it took, which nobody holds, is released."""
        release_late(self._stub, response, self.timeout, self._core.metadata, client_id=reg.client_id)

    def _binary_lane(self, lane: ClientLane | None, reg: msg.Registration | None) -> bool:
        """Whether ``lane`` takes the binary Write and Load of ``reg``, the live registration."""
        return (lane is not None and reg is not None and lane.reg is reg and lane.request_format >= 1
                and self._core.connected)

    def _write_on_lane(self, lane: ClientLane | None, host_indices: msg.Indices, device_indices: msg.Indices,
                       layers: list[int], ready_event) -> int | None:
        """A Write in the lane's binary format, packed from its arguments without planning an Op:
        bytes written, or its miss; None: not sent so (the protobuf request carries it)."""
        core = self._core
        reg = core.registration
        if not self._binary_lane(lane, reg):
            return None
        data = core.write_packed(reg, host_indices, device_indices, layers, ready_event)
        if data is None:
            return None
        deadline = core.job_deadline
        try:
            got = lane.unary("WriteB", data, deadline)
        except KVClientError as error:
            return self._failed(Call(LANE_WRITE, reg, None, deadline), error)
        return None if got is None else pb.WriteResponse.FromString(got).bytes

    def _nudge(self, keys: Keys = b"", key_bytes: int = KEY_BYTES) -> ClientLane | None:
        """Wakes the daemon's data plane, if it sleeps, while this call builds its request; the
        lane the call then takes, if one is open. Not for a call of more ``keys`` than a lane's
        slot holds, which goes over gRPC: a ring that brings no call is one the plane counts
        against the lane (it stops watching a doorbell rung hundreds of times without a call)."""
        lane = self._lane
        packed = len(keys) if isinstance(keys, bytes | bytearray | memoryview) else len(keys) * key_bytes
        if lane is not None and packed < R.REQUEST_BYTES:
            lane.nudge()
        return lane

    def _stream(self, op: StreamOp) -> LoadHandle:
        """A Load or Get planned as ``op``: on the lane (its protobuf request) where it is open for
        the registration and carries the call, else on gRPC."""
        lane = self._lane
        call = self._core.start_stream(op)
        if isinstance(call, Missed):
            return LoadHandle.miss(call.value, get=op.get)
        handle = LoadHandle(call.layers, get=op.get)
        handle.events = call.events
        handle._on_error = lambda error: self._stream_failed(call, handle, error)
        if lane is not None and op.lane and lane.reg is call.reg:
            source = lane.stream(op.rpc, call.request.SerializeToString(), call.timeout)
            if source is not None:
                source.handle = handle
                handle._source = source
                return handle
        stream = getattr(self._stub, op.rpc)(call.request, timeout=call.timeout, metadata=self._core.metadata)
        self._loaders.submit(handle._consume, stream)
        return handle

    def _load_on_lane(self, lane: ClientLane | None, host_indices: msg.Indices, device_indices: msg.Indices,
                      layers: list[int], event_slot: int, ready_event) -> LoadHandle | None:
        """A Load in the lane's binary format, packed from its arguments without planning a
        StreamOp; None: not sent so (the protobuf request carries it)."""
        core = self._core
        reg = core.registration
        if not self._binary_lane(lane, reg):
            return None
        data = core.load_packed(reg, host_indices, device_indices, layers, event_slot, ready_event)
        if data is None:
            return None
        handle = LoadHandle(reg.load_layers(layers))
        handle.events = core.layer_events(reg, handle.layers, event_slot)
        deadline = core.job_deadline
        source = lane.stream("LoadB", data, deadline)
        if source is None:
            return None
        handle._on_error = lambda error: self._stream_failed(Call(LANE_LOAD, reg, None, deadline), handle,
                                                             error)
        source.handle = handle
        handle._source = source
        return handle

    def _stream_failed(self, call: Call, handle: LoadHandle, error: KVClientError) -> object:
        # Reported to the engine only once the daemon said the copy is dead, or was made to. On
        # the lane the failure is found by whichever engine thread reads the handle (ended(), a
        # timed wait): the confirmation runs on a loader thread, and the load ends with it.
        if self._core.unconfirmed(call, error):
            if handle._source is not None:
                try:
                    self._loaders.submit(self._confirm_then_settle, call, handle, error)
                    return LATER
                except RuntimeError:  # the client is closing: no thread left, so this one
                    pass
            handle.confirmed = self._confirm_stopped(call.reg)
        return self._is_miss(error, call.reg, call.op.cache)

    def _confirm_then_settle(self, call: Call, handle: LoadHandle, error: KVClientError) -> None:
        missed = False
        try:
            handle.confirmed = self._confirm_stopped(call.reg)
            missed = self._is_miss(error, call.reg, call.op.cache)
        except BaseException:
            logger.exception("kvclient: settling a failed load")
        finally:
            handle._settle(error, missed)

    def _is_miss(self, error: KVClientError, reg: msg.Registration | None, cache: bool = False) -> bool:
        miss, lose = self._core.judge(error, reg, cache)
        if lose:
            self._lost(reg, error.message)
        return miss

    def _confirm_stopped(self, reg: msg.Registration) -> bool:
        """Unregisters ``reg``, whose copy got no answer in time, and says whether the daemon
        confirmed every job of it dead. Once per registration: the calls of it that fail
        meanwhile or after (loads in flight together) take that one's answer."""
        with self._confirm_lock:
            confirming = self._confirms.get(reg.client_id)
            mine = confirming is None
            if mine:  # (the answers of registrations given up before are not needed any more)
                self._confirms = {cid: f for cid, f in self._confirms.items() if not f.done()}
                confirming = self._confirms[reg.client_id] = Future()
        if not mine:
            return confirming.result()
        confirmed = False
        try:
            req = self._core.confirm_request(reg)
            if req is None:
                return False
            try:
                confirmed = self._core.confirmed(self._stub.Unregister(req, timeout=self.timeout,
                                                                       metadata=self._core.metadata))
            except grpc.RpcError as exc:
                confirmed = self._core.confirmed(None, from_rpc_error(exc))
            self._lost(reg, "a copy outlived its deadline unanswered")
            return confirmed
        finally:
            confirming.set_result(confirmed)

    # ---- registration and liveness --------------------------------------------------------

    def register(
        self,
        *,
        model: str,
        pool: ShmKVPool | CudaKVPool | KVViewsPool,
        start_layer: int,
        end_layer: int,
        num_layers: int,
        host_tokens: int,
        page_size: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        event_slots: int = 0,
        min_host_tokens: int | None = None,
        weights: str = "",
    ) -> msg.Registration:
        """Registers (always raising on failure) and opens the session that keeps it alive.
        ``pool`` is a ShmKVPool, a CudaKVPool or a KVViewsPool; CUDA pools get ``event_slots`` (default 3)
        sets of per-layer events, one set per load in flight. The grant is ``host_tokens``, or
        at least ``min_host_tokens`` if given: a daemon that cannot grant that much refuses with
        RESOURCE_EXHAUSTED, naming what is free. ``weights``: the weights' identity beyond the model's
        name (``kvclient.weights``), part of the KV space: pages of other weights are never shared."""
        req = self._core.register_request(
            model=model, pool=pool, start_layer=start_layer, end_layer=end_layer,
            num_layers=num_layers, host_tokens=host_tokens, page_size=page_size,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, event_slots=event_slots,
            min_host_tokens=min_host_tokens, weights=weights,
        )
        resp = self._call(self._stub.Register, ticketed(self.target, pool, req, self.timeout))
        reg, replaced = self._core.registered(resp, req, pool)
        if replaced is not None:
            replaced.cancel()
        self._open_session(reg)
        self._open_lane(reg)
        return reg

    # ---- the fast lane ------------------------------------------------------------------------

    def _open_lane(self, reg: msg.Registration) -> None:
        """Opens the registration's lane (a Unix socket target, lane="auto"); on any failure the
        client stays on gRPC (an older daemon answers UNIMPLEMENTED)."""
        if self.lane_mode != "auto" or fd_socket_path(self.target) is None \
                or not self.target.startswith("unix") or self._closed.is_set():
            return
        lane = None
        try:
            lane = ClientLane()
            ticket = lane_ticket_for(self.target, lane, self.timeout)
            opened = lane.opened_by(lambda: self._stub.OpenLane(
                pb.OpenLaneRequest(client_id=reg.client_id, peer_ticket=ticket), timeout=self.timeout,
                metadata=self._core.metadata))
        # ValueError: closed meanwhile; OSError: no descriptors or memory left for the lane's own
        except (grpc.RpcError, KVClientError, ValueError, OSError) as exc:
            if lane is not None:
                lane.close()
            code = exc.code() if isinstance(exc, grpc.RpcError) else getattr(exc, "code", None)
            log = logger.debug if self._lane_refused else logger.info
            self._lane_refused = True
            log("kvserver lane not opened (%s): Write, Load, Put, Get and Lookup stay on gRPC",
                code.name if isinstance(code, grpc.StatusCode) else exc)
            return
        finally:
            if lane is not None:
                lane.handed_over()
        lane.reg = reg
        lane.request_format = opened.request_format
        lane.rpc_mask = opened.rpc_mask or R.OLD_RPC_MASK
        with self._lane_lock:
            # Only the current registration's lane is installed: another thread may have made a
            # newer registration (and opened its lane) while this one was opened.
            current = (not self._closed.is_set() and self._core.registration is reg
                       and self._core.connected)
            if current:
                old, self._lane = self._lane, lane
                shut, self._lost_lanes = [old, *self._lost_lanes], []  # their registrations replaced
            else:
                shut = [lane]
        for each in shut:
            if each is not None:
                each.close()
        if current and (self._core.registration is not reg or not self._core.connected):  # lost meanwhile
            self._close_lane(reg)

    def _close_lane(self, reg: msg.Registration | None = None, wake: bool = True) -> None:
        """The lane (``reg``'s only, if given) taken out of use. ``wake``: calls in flight on it,
        and the lanes of registrations lost before, end now (cancelled). Else (a lost registration)
        it takes no new call but lets those in flight end as the daemon answers them, as on gRPC
        (the daemon's death ends them at once: its doorbells close), and is shut with the next
        ``wake`` or once a new registration's lane opens."""
        with self._lane_lock:
            lane = self._lane
            if lane is not None and (reg is None or lane.reg is reg):
                self._lane = None
            else:
                lane = None
            if wake:
                shut, self._lost_lanes = self._lost_lanes, []
            else:
                shut = []
                if lane is not None:
                    self._lost_lanes.append(lane)
        if lane is not None:
            lane.close(wake)
        for each in shut:
            each.close()

    @property
    def lane(self) -> ClientLane | None:
        """The open fast lane, or None (gRPC only)."""
        return self._lane

    def _open_session(self, reg: msg.Registration) -> None:
        call = self._stub.Session(pb.SessionRequest(client_id=reg.client_id), metadata=self._core.metadata)
        if not self._core.hold(reg, call):
            call.cancel()
            return
        threading.Thread(target=self._hold_session, args=(call, reg), daemon=True,
                         name="kvclient-session").start()

    def _hold_session(self, call, reg: msg.Registration) -> None:
        reason = "session ended"
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            reason = f"session ended: {exc.code().name}"
        self._lost(reg, reason)

    def _lost(self, reg: msg.Registration | None, reason: str) -> None:
        if reg is not None:
            self._close_lane(reg, wake=False)
        lost = self._core.lose(reg, reason)
        if lost is None:
            return
        if lost.session is not None:
            lost.session.cancel()
        if lost.reconnect:
            threading.Thread(target=self._reconnect, args=(reg,), daemon=True,
                             name="kvclient-reconnect").start()

    def _reconnect(self, old: msg.Registration) -> None:
        tries = Reregistration()
        try:
            while not self._closed.wait(tries.next()):
                retry = self._core.retry_request(old)
                if retry is None:
                    return
                try:
                    resp = self._stub.Register(ticketed(self.target, self._core.pool, retry, self.timeout),
                                               timeout=self.timeout, metadata=self._core.metadata)
                except grpc.RpcError as exc:
                    tries.failed(exc.code(), exc.details() or "")
                    continue
                except KVClientError as exc:  # no peer ticket: the daemon is not back yet
                    tries.failed(None, exc.message)
                    continue
                except ValueError:  # the client closed its channel meanwhile
                    return
                tries.succeeded()
                reg = self._core.reregistered(resp, old, tries.attempts)
                try:
                    if reg is not None:
                        self._open_session(reg)
                        self._open_lane(reg)
                    else:  # unregistered, closed or replaced meanwhile: this one is nobody's
                        self._drop_orphan(resp.client_id)
                except ValueError:  # closed meanwhile: the daemon reclaims what it gave
                    logger.debug("the client closed while it registered again")
                return
        finally:
            self._core.reconnect_ended(old)

    def _drop_orphan(self, client_id: str) -> None:
        """Unregisters a registration the client no longer wants (best effort: the daemon would
        otherwise hold it for its lease)."""
        try:
            self._stub.Unregister(pb.UnregisterRequest(client_id=client_id), timeout=self.timeout,
                                  metadata=self._core.metadata)
        except grpc.RpcError as exc:
            logger.debug("unregistering a registration nobody uses failed: %s", exc.code().name)
        except ValueError:  # the client's channel closed: the daemon reclaims it (its lease)
            logger.debug("unregistering a registration nobody uses: the client is closed")

    def unregister(self) -> None:
        reg, session = self._core.unregistering()
        if session is not None:
            session.cancel()
        self._close_lane()
        if reg is None:
            return
        try:
            resp = self._call(self._stub.Unregister, pb.UnregisterRequest(client_id=reg.client_id))
        except KVClientError as exc:
            self._core.unregister_failed(exc)
        else:
            self._core.unregistered(resp.copies_pending)

    # ---- the index API ----------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Page-aligned host indices, or None on a miss (resilient mode)."""
        return self._run(self._core.alloc(num_tokens))

    def free(self, host_indices: msg.Indices) -> int:
        return self._run(self._core.free(host_indices))

    def write(
        self, *, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None = None,
        ready_event=None,
    ) -> int:
        """Offloads device slots to host slots for the given global layers (default: all).
        CUDA pools: ``ready_event`` (an interprocess torch.cuda.Event the engine recorded after
        writing the KV) makes the daemon's copy wait for it on the GPU.
        Returns the bytes written, 0 on a miss (resilient mode)."""
        lane = self._nudge()
        layers = msg.layer_list(layers)  # a list: an iterator would be spent by the lane's attempt
        written = self._write_on_lane(lane, host_indices, device_indices, layers, ready_event)
        if written is not None:
            return written
        return self._run(self._core.write(host_indices, device_indices, layers, ready_event))

    def load(
        self, *, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None = None,
        event_slot: int = 0, ready_event=None,
    ) -> LoadHandle:
        """Starts a layer-by-layer load and returns at once. CUDA pools: the load records the
        layer events of ``event_slot`` (``handle.stream_wait_layer``); ``ready_event`` makes the
        daemon wait for the engine before overwriting the device slots."""
        lane = self._nudge()
        layers = msg.layer_list(layers)
        handle = self._load_on_lane(lane, host_indices, device_indices, layers, event_slot, ready_event)
        if handle is not None:
            return handle
        return self._stream(self._core.load(host_indices, device_indices, layers, event_slot, ready_event))

    def available_size(self) -> int:
        """Host token slots this registration can still allocate (0 on a miss)."""
        return self._run(self._core.available_size())

    def stats(self, all_clients: bool = False) -> pb.StatsResponse:
        """This client's stats, or (``all_clients``) daemon-wide totals; the list of every client
        is only for a caller with the daemon's admin token."""
        return self._run(self._core.stats(all_clients))

    # ---- the node-wide cache ----------------------------------------------------------------

    def lookup(self, keys: Keys, *, pin_ms: int = 0, whole_space: bool = False,
               key_bytes: int = KEY_BYTES, timeout: float | None = None,
               memory_only: bool = False) -> LookupResult:
        """How many leading ``keys`` are cached in this engine's part (``whole_space``: in every
        part of its space); ``pin_ms`` pins them under the returned lease. Keys are packed bytes
        of ``key_bytes`` each, or a sequence of equal-length bytes. ``timeout``: this call's
        bound, if not the client's. ``memory_only``: only pages in the daemon's host memory count
        (not those its disk tier holds)."""
        self._nudge(keys, key_bytes)
        return self._run(self._core.lookup(keys, pin_ms, whole_space, key_bytes, timeout, memory_only))

    def ping(self, timeout: float | None = None) -> bool:
        """True if the daemon answers a call on this registration (an empty Lookup) in time."""
        misses = self.misses
        try:
            self.lookup(b"", timeout=timeout)
        except KVClientError:
            return False
        return self.misses == misses

    def put(self, keys: Keys, device_pages: msg.Indices, *, ready_event=None,
            key_bytes: int = KEY_BYTES) -> PutResult:
        """Stores device page ``device_pages[i]`` under key i, for keys not cached yet."""
        self._nudge(keys, key_bytes)
        return self._run(self._core.put(keys, device_pages, ready_event, key_bytes))

    def get(self, keys: Keys, device_pages: msg.Indices, *, layers: Iterable[int] | None = None,
            event_slot: int = 0, ready_event=None, lease_id: str = "",
            key_bytes: int = KEY_BYTES) -> LoadHandle:
        """Starts loading the longest cached prefix of ``keys`` into ``device_pages``, layer by
        layer as ``load``; ``handle.pages()`` says how many pages that is. ``lease_id`` (from a
        pinning ``lookup``) is ended once the get is done."""
        self._nudge(keys, key_bytes)
        return self._stream(self._core.get(keys, device_pages, layers, event_slot, ready_event, lease_id,
                                           key_bytes))

    def get_parts(self, parts: Sequence[tuple[Keys, msg.Indices, str]], *,
                  layers: Iterable[int] | None = None, event_slot: int = 0, ready_event=None,
                  key_bytes: int = KEY_BYTES) -> LoadHandle:
        """Several Gets in one call, (keys, device_pages, lease_id) each, copied as one job:
        each part loads its own longest cached prefix and ends its own lease;
        ``handle.part_pages()`` says how many pages of each part that is. Sent on gRPC."""
        handle = self._stream(self._core.get_parts(parts, layers, event_slot, ready_event, key_bytes))
        handle.parts = len(parts)
        return handle

    def release(self, lease_ids: str | Sequence[str]) -> int:
        """Ends leases taken by ``lookup(pin_ms=...)``; returns how many were still held."""
        return self._run(self._core.release(lease_ids))

    # ---- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the session (the daemon then reclaims the registration) and the channel."""
        self._closed.set()
        session = self._core.closing()
        if session is not None:
            session.cancel()
        self._close_lane()
        self._loaders.shutdown(wait=True)
        self._channel.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
