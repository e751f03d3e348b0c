"""Synchronous client, safe to call from engine threads.

The client keeps its registration alive with a Session stream, and in resilient mode (the
default) survives the daemon going away: writes are dropped, loads report a miss, and a
background thread re-registers with backoff once the daemon is back (see ``_resilience``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from kvclient import _messages as msg
from kvclient._base import ClientBase
from kvclient._channel import CHANNEL_OPTIONS
from kvclient._fd_socket import ticketed
from kvclient._resilience import Backoff, is_miss
from kvclient.cuda_events import event_handle
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.load_handle import LoadHandle
from kvclient.shm_pool import ShmKVPool
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class KVClient(ClientBase):
    """One engine process's connection to the daemon and its registration.

    ``resilient`` (default True): when the daemon is unreachable, restarted, or no longer knows
    the registration or its pages, ``write`` returns 0, ``load`` returns a missed handle,
    ``alloc`` returns None and ``free`` 0, counted in ``misses``; the client re-registers by
    itself. Requests that are wrong still raise ``KVClientError``. With ``resilient=False``
    every failure raises.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 5.0, token: str | None = None,
                 resilient: bool = True) -> None:
        super().__init__(address, timeout, token, resilient)
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self._loaders = ThreadPoolExecutor(8, thread_name_prefix="kvclient-load")
        self._lock = threading.Lock()
        self._session: grpc.Future | None = None
        self._reconnecting = False
        self._closed = threading.Event()

    # ---- plumbing ---------------------------------------------------------------------------

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _data_call(self, method, request, on_miss, job: bool = False):
        """A call on the registration: failures that mean "not there" become ``on_miss``.
        ``job``: a Write, whose failure is reported only once its copy cannot still run."""
        reg = self.registration
        if reg is None and self._request is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        if not self.connected:
            return self._disconnected(on_miss)
        try:
            return method(request(reg.client_id), timeout=self._job_deadline if job else self.timeout,
                          metadata=self._metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        if job and self._job_unconfirmed(error):
            self._confirm_stopped(reg)
        if self._is_miss(error, reg):
            return on_miss
        raise error from None

    def _confirm_stopped(self, reg: msg.Registration) -> bool:
        """A Write or Load got no answer in time, so its copy might still run. Unregister stops
        every job of the registration and answers once they are dead; the client then registers
        anew. True if the daemon confirmed (see docs/reliability.md for when it cannot)."""
        if self._closed.is_set():
            return False
        try:
            resp = self._stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=self.timeout,
                                         metadata=self._metadata)
            confirmed = not resp.copies_pending  # GPU work that may still run is not dead
        except grpc.RpcError as exc:
            confirmed = exc.code() == grpc.StatusCode.NOT_FOUND  # already released or being released
        if not confirmed:
            logger.warning("kvserver did not confirm that a timed-out copy stopped; its device slots "
                           "may still be written until the daemon drops the registration")
        self._lost(reg, "a copy outlived its deadline unanswered")
        return confirmed


    # ---- registration and liveness --------------------------------------------------------

    def register(
        self,
        *,
        model: str,
        pool: ShmKVPool,
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
    ) -> msg.Registration:
        """Registers (always raising on failure) and opens the session that keeps it alive.
        ``pool`` is a ShmKVPool or a CudaKVPool; CUDA pools get ``event_slots`` (default 3)
        sets of per-layer events, one set per load in flight. The grant is ``host_tokens``, or
        at least ``min_host_tokens`` if given: a daemon that cannot grant that much refuses with
        RESOURCE_EXHAUSTED, naming what is free."""
        req = msg.register_request(
            model=model, pool=pool, start_layer=start_layer, end_layer=end_layer,
            num_layers=num_layers, host_tokens=host_tokens, page_size=page_size,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, event_slots=event_slots,
            min_host_tokens=min_host_tokens or 0,
        )
        reg = msg.registration(self._call(self._stub.Register, ticketed(self.target, pool, req)), req)
        self._log_grant(reg, req)
        self._remember_pool(pool, reg)
        with self._lock:
            self._request = req
            self._adopt(reg)
        return reg

    def _adopt(self, reg: msg.Registration) -> None:
        """Makes ``reg`` current and holds its session (caller holds the lock)."""
        self.registration = reg
        self.connected = True
        call = self._stub.Session(pb.SessionRequest(client_id=reg.client_id), metadata=self._metadata)
        self._session = call
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
        """The daemon no longer holds ``reg``: misses until a new registration is made."""
        with self._lock:
            if self._closed.is_set() or reg is None or reg is not self.registration or not self.connected:
                return
            self.connected = False
            # Given up: its session ends, so a daemon that still holds it (a slow call, not a
            # dead daemon) reclaims it rather than keeping it beside the next registration.
            if self._session is not None:
                self._session.cancel()
            if not self.resilient or self._reconnecting or self._request is None:
                return
            self._reconnecting = True
        logger.warning("kvserver registration lost (%s); writes are dropped and loads miss until "
                       "the daemon is back", reason)
        threading.Thread(target=self._reconnect, args=(reg,), daemon=True, name="kvclient-reconnect").start()

    def _reconnect(self, old: msg.Registration) -> None:
        backoff = Backoff()
        try:
            while not self._closed.wait(backoff.next()):
                request = self._request
                if request is None:
                    return
                try:
                    resp = self._stub.Register(ticketed(self.target, self._pool, self._retry_request(old)),
                                               timeout=self.timeout, metadata=self._metadata)
                except grpc.RpcError as exc:
                    logger.debug("re-registration failed: %s", exc.code().name)
                    continue
                except KVClientError as exc:  # no peer ticket: the daemon is not back yet
                    logger.debug("re-registration failed: %s", exc.message)
                    continue
                with self._lock:
                    if self._closed.is_set() or self.registration is None:
                        return
                    self._adopt(msg.registration(resp, request))
                    self.reconnects += 1
                logger.warning("kvserver registration restored after %d attempts", backoff.attempt)
                return
        finally:
            with self._lock:
                self._reconnecting = False

    def unregister(self) -> None:
        with self._lock:
            reg, self.registration, self._request = self.registration, None, None
            self.connected = False
            session, self._session = self._session, None
        if session is not None:
            session.cancel()
        if reg is None:
            return
        try:
            resp = self._call(self._stub.Unregister, pb.UnregisterRequest(client_id=reg.client_id))
        except KVClientError as exc:
            if not (self.resilient and is_miss(exc.code)):
                raise
        else:
            self._unregistered(resp.copies_pending)

    # ---- data -----------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Page-aligned host indices, or None on a miss (resilient mode)."""
        resp = self._data_call(self._stub.Alloc,
                               lambda cid: pb.AllocRequest(client_id=cid, num_tokens=num_tokens), None)
        return None if resp is None else msg.host_tensor(resp)

    def free(self, host_indices: msg.Indices) -> int:
        ids = msg.ids(host_indices)
        resp = self._data_call(self._stub.Free, lambda cid: pb.FreeRequest(client_id=cid, host_indices=ids),
                               None)
        return 0 if resp is None else resp.freed_tokens

    def write(
        self, *, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None = None,
        ready_event=None,
    ) -> int:
        """Offloads device slots to host slots for the given global layers (default: all).
        CUDA pools: ``ready_event`` (an interprocess torch.cuda.Event the engine recorded after
        writing the KV) makes the daemon's copy wait for it on the GPU.
        Returns the bytes written, 0 on a miss (resilient mode)."""
        host, dev, lay = msg.ids(host_indices), msg.ids(device_indices), msg.layer_list(layers)
        ready = b"" if ready_event is None else event_handle(ready_event)
        resp = self._data_call(
            self._stub.Write,
            lambda cid: pb.WriteRequest(client_id=cid, host_indices=host, device_indices=dev, layers=lay,
                                        ready_event=ready, timeout_ms=self._timeout_ms),
            None, job=True,
        )
        return 0 if resp is None else resp.bytes

    def load(
        self, *, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None = None,
        event_slot: int = 0, ready_event=None,
    ) -> LoadHandle:
        """Starts a layer-by-layer load and returns at once. CUDA pools: the load records the
        layer events of ``event_slot`` (``handle.stream_wait_layer``); ``ready_event`` makes the
        daemon wait for the engine before overwriting the device slots."""
        reg = self.registration
        if reg is None and self._request is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        req = self._request or pb.RegisterRequest()
        lay = msg.layer_list(layers) or list(range(req.start_layer, req.end_layer))
        if not self.connected:
            return self._disconnected(LoadHandle.miss(lay))
        request = pb.LoadRequest(client_id=reg.client_id, host_indices=msg.ids(host_indices),
                                 device_indices=msg.ids(device_indices), layers=msg.layer_list(layers),
                                 event_slot=event_slot, timeout_ms=self._timeout_ms,
                                 ready_event=b"" if ready_event is None else event_handle(ready_event))
        handle = LoadHandle(lay)

        def failed(error: KVClientError) -> bool:
            # Reported to the engine only once the daemon said the copy is dead, or was made to.
            if self._job_unconfirmed(error):
                handle.confirmed = self._confirm_stopped(reg)
            return self._is_miss(error, reg)

        handle._on_error = failed
        if reg.layer_events:
            events = self._layer_events(reg)
            handle.events = {g: events.event(event_slot, g - reg.start_layer) for g in lay}
        stream = self._stub.Load(request, timeout=self._job_deadline, metadata=self._metadata)
        self._loaders.submit(handle._consume, stream)
        return handle

    def available_size(self) -> int:
        """Host token slots this registration can still allocate (0 on a miss)."""
        resp = self._data_call(self._stub.Stats, lambda cid: pb.StatsRequest(client_id=cid), None)
        if resp is None:
            return 0
        c = resp.clients[0]
        return c.capacity_tokens - c.used_tokens

    def stats(self, all_clients: bool = False) -> pb.StatsResponse:
        """This client's stats, or (``all_clients``) daemon-wide totals; the list of every client
        is only for a caller with the daemon's admin token."""
        req = pb.StatsRequest(client_id="" if all_clients else self.client_id)
        return self._call(self._stub.Stats, req)

    def close(self) -> None:
        """Stops the session (the daemon then reclaims the registration) and the channel."""
        self._closed.set()
        with self._lock:
            session, self._session = self._session, None
            self.connected = False
        if session is not None:
            session.cancel()
        self._loaders.shutdown(wait=True)
        self._channel.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
