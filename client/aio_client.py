"""asyncio client, for engines and tools that run an event loop.

Same behaviour as ``KVClient``: a Session stream keeps the registration alive, and in resilient
mode the daemon going away turns into misses while a task re-registers with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable

import grpc
import torch

from kvclient import _messages as msg
from kvclient._base import ClientBase
from kvclient._channel import CHANNEL_OPTIONS
from kvclient._fd_socket import ticketed
from kvclient._resilience import Backoff, is_miss
from kvclient.cuda_events import event_handle
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.shm_pool import ShmKVPool
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class AsyncLoadHandle:
    """A load in flight. ``await wait_layer(i)`` is True once global layer i has landed, False
    if the load missed."""

    def __init__(self, layers: list[int], stream: AsyncIterator[pb.LoadProgress] | None,
                 client: AsyncKVClient | None = None, reg: msg.Registration | None = None) -> None:
        self.layers = layers
        self.missed = stream is None
        # False only if the load failed and the daemon could not confirm that its copy stopped.
        self.confirmed = True
        self.events: dict[int, object] = {}  # CUDA pools: global layer -> torch.cuda.Event
        self._recorded = False
        self._last_layer = -1
        self._done = False
        self._bytes = 0
        self._client, self._reg = client, reg
        self._changed = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._consume(stream))

    async def _consume(self, stream: AsyncIterator[pb.LoadProgress] | None) -> None:
        try:
            if stream is None:  # a miss from the start; waiters are still woken below
                return
            async for progress in stream:
                async with self._changed:
                    self._recorded = self._recorded or progress.events_recorded
                    if progress.layers_done:
                        self._last_layer = progress.last_layer
                    self._bytes = progress.bytes
                    self._done = progress.done
                    self._changed.notify_all()
            if not self._done:
                raise KVClientError(grpc.StatusCode.INTERNAL, "load stream ended before the last layer")
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if asyncio.current_task().cancelling():  # this task itself was cancelled
                    raise
                # grpc.aio ends a call with CancelledError when its channel is closed under it
                error = KVClientError(grpc.StatusCode.CANCELLED, "the load's call was cancelled (closed)")
            else:
                error = from_rpc_error(exc)
            if self._client is not None and self._client._job_unconfirmed(error):
                # Reported to the engine only once the copy cannot still run.
                self.confirmed = await self._client._confirm_stopped(self._reg)
            if self._client is None or not self._client._is_miss(error, self._reg):
                raise error from None
            self.missed = True
        finally:
            async with self._changed:
                self._changed.notify_all()

    async def wait_layer(self, layer_id: int) -> bool:
        if layer_id not in self.layers:
            raise ValueError(f"layer {layer_id} is not part of this load")
        async with self._changed:
            while self._last_layer < layer_id and not self._task.done():
                await self._changed.wait()
        if self._task.done():
            self._task.result()
        return self._last_layer >= layer_id and not self.missed

    async def wait_recorded(self) -> bool:
        """CUDA pools: until the daemon has recorded this load's layer events; False on a miss."""
        async with self._changed:
            while not (self._recorded or self._done) and not self._task.done():
                await self._changed.wait()
        if self._task.done():
            self._task.result()
        return not self.missed

    async def stream_wait_layer(self, layer_id: int, stream=None) -> bool:
        """CUDA pools: ``stream`` (default: the current one) waits on the GPU for global layer
        ``layer_id``; the event loop does not wait for the copy. False on a miss."""
        if self.missed:  # e.g. the daemon was away when the load was asked for: no events
            return False
        if layer_id not in self.events:
            raise ValueError(f"layer {layer_id} has no event in this load (not a CUDA pool, or not loaded)")
        if not await self.wait_recorded():
            return False
        import torch

        (stream or torch.cuda.current_stream()).wait_event(self.events[layer_id])
        return True

    async def wait(self) -> int:
        await self._task
        return 0 if self.missed else self._bytes


class AsyncKVClient(ClientBase):
    """asyncio twin of KVClient; create it inside the running loop."""

    def __init__(self, address: str | None = None, *, timeout: float = 5.0, token: str | None = None,
                 resilient: bool = True) -> None:
        super().__init__(address, timeout, token, resilient)
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self._session: asyncio.Task | None = None
        self._reconnect: asyncio.Task | None = None

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def _data_call(self, method, request, on_miss, job: bool = False):
        reg = self.registration
        if reg is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        if not self.connected:
            return self._disconnected(on_miss)
        try:
            return await method(request(reg.client_id), timeout=self._job_deadline if job else self.timeout,
                                metadata=self._metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        if job and self._job_unconfirmed(error):
            await self._confirm_stopped(reg)
        if self._is_miss(error, reg):
            return on_miss
        raise error from None

    async def _confirm_stopped(self, reg: msg.Registration) -> bool:
        """As KVClient._confirm_stopped: Unregister stops the registration's jobs and answers once
        they are dead; then the client registers anew. True if the daemon confirmed."""
        if self._request is None:  # closed or unregistered
            return False
        try:
            resp = await self._stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id),
                                               timeout=self.timeout, metadata=self._metadata)
            confirmed = not resp.copies_pending  # GPU work that may still run is not dead
        except grpc.RpcError as exc:
            confirmed = exc.code() == grpc.StatusCode.NOT_FOUND
        if not confirmed:
            logger.warning("kvserver did not confirm that a timed-out copy stopped; its device slots "
                           "may still be written until the daemon drops the registration")
        self._lost(reg, "a copy outlived its deadline unanswered")
        return confirmed


    # ---- registration and liveness --------------------------------------------------------

    async def register(self, *, model: str, pool: ShmKVPool, start_layer: int, end_layer: int,
                       num_layers: int, host_tokens: int, page_size: int = 1, tp_rank: int = 0,
                       tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                       event_slots: int = 0, min_host_tokens: int | None = None) -> msg.Registration:
        req = msg.register_request(
            model=model, pool=pool, start_layer=start_layer, end_layer=end_layer,
            num_layers=num_layers, host_tokens=host_tokens, page_size=page_size,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, event_slots=event_slots,
            min_host_tokens=min_host_tokens or 0,
        )
        sent = await asyncio.to_thread(ticketed, self.target, pool, req)
        reg = msg.registration(await self._call(self._stub.Register, sent), req)
        self._log_grant(reg, req)
        self._remember_pool(pool, reg)
        self._request = req
        self._adopt(reg)
        return reg

    def _adopt(self, reg: msg.Registration) -> None:
        self.registration = reg
        self.connected = True
        self._session = asyncio.get_running_loop().create_task(self._hold_session(reg))

    async def _hold_session(self, reg: msg.Registration) -> None:
        reason = "session ended"
        try:
            async for _ in self._stub.Session(pb.SessionRequest(client_id=reg.client_id),
                                              metadata=self._metadata):
                pass
        except grpc.RpcError as exc:
            reason = f"session ended: {exc.code().name}"
        self._lost(reg, reason)

    def _lost(self, reg: msg.Registration | None, reason: str) -> None:
        if reg is None or reg is not self.registration or not self.connected:
            return
        self.connected = False
        # Given up: its session ends, so a daemon that still holds it (a slow call, not a dead
        # daemon) reclaims it rather than keeping it beside the next registration.
        if self._session is not None and self._session is not asyncio.current_task():
            self._session.cancel()
        if not self.resilient or self._request is None or self._reconnect is not None:
            return
        logger.warning("kvserver registration lost (%s); writes are dropped and loads miss until "
                       "the daemon is back", reason)
        self._reconnect = asyncio.get_running_loop().create_task(self._reregister(reg))

    async def _reregister(self, old: msg.Registration) -> None:
        backoff = Backoff()
        try:
            while self._request is not None:
                await asyncio.sleep(backoff.next())
                request = self._request
                if request is None:
                    return
                try:
                    retry = self._retry_request(old)
                    sent = await asyncio.to_thread(ticketed, self.target, self._pool, retry)
                    resp = await self._stub.Register(sent, timeout=self.timeout, metadata=self._metadata)
                except (grpc.RpcError, KVClientError):
                    continue
                if self._request is None:
                    return
                self._adopt(msg.registration(resp, request))
                self.reconnects += 1
                logger.warning("kvserver registration restored after %d attempts", backoff.attempt)
                return
        finally:
            self._reconnect = None

    async def _stop_tasks(self) -> None:
        for task in (self._session, self._reconnect):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._session = self._reconnect = None

    async def unregister(self) -> None:
        reg, self.registration, self._request = self.registration, None, None
        self.connected = False
        await self._stop_tasks()
        if reg is None:
            return
        try:
            resp = await self._call(self._stub.Unregister, pb.UnregisterRequest(client_id=reg.client_id))
        except KVClientError as exc:
            if not (self.resilient and is_miss(exc.code)):
                raise
        else:
            self._unregistered(resp.copies_pending)

    # ---- data -----------------------------------------------------------------------------

    async def alloc(self, num_tokens: int) -> torch.Tensor | None:
        resp = await self._data_call(
            self._stub.Alloc, lambda cid: pb.AllocRequest(client_id=cid, num_tokens=num_tokens), None)
        return None if resp is None else msg.host_tensor(resp)

    async def free(self, host_indices: msg.Indices) -> int:
        ids = msg.ids(host_indices)
        resp = await self._data_call(
            self._stub.Free, lambda cid: pb.FreeRequest(client_id=cid, host_indices=ids), None)
        return 0 if resp is None else resp.freed_tokens

    async def write(self, *, host_indices: msg.Indices, device_indices: msg.Indices,
                    layers: Iterable[int] | None = None, ready_event=None) -> int:
        host, dev, lay = msg.ids(host_indices), msg.ids(device_indices), msg.layer_list(layers)
        ready = b"" if ready_event is None else event_handle(ready_event)
        resp = await self._data_call(
            self._stub.Write,
            lambda cid: pb.WriteRequest(client_id=cid, host_indices=host, device_indices=dev, layers=lay,
                                        ready_event=ready, timeout_ms=self._timeout_ms),
            None, job=True,
        )
        return 0 if resp is None else resp.bytes

    def load(self, *, host_indices: msg.Indices, device_indices: msg.Indices,
             layers: Iterable[int] | None = None, event_slot: int = 0, ready_event=None) -> AsyncLoadHandle:
        """Starts a layer-by-layer load; CUDA pools record the layer events of ``event_slot``."""
        reg = self.registration
        if reg is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        lay = msg.layer_list(layers) or list(range(reg.start_layer, reg.end_layer))
        if not self.connected:
            self._disconnected(None)  # raises unless resilient
            return AsyncLoadHandle(lay, None)
        req = pb.LoadRequest(client_id=reg.client_id, host_indices=msg.ids(host_indices),
                             device_indices=msg.ids(device_indices), layers=msg.layer_list(layers),
                             event_slot=event_slot, timeout_ms=self._timeout_ms,
                             ready_event=b"" if ready_event is None else event_handle(ready_event))
        stream = self._stub.Load(req, timeout=self._job_deadline, metadata=self._metadata)
        handle = AsyncLoadHandle(lay, stream, self, reg)
        if reg.layer_events:
            events = self._layer_events(reg)
            handle.events = {g: events.event(event_slot, g - reg.start_layer) for g in lay}
        return handle

    async def available_size(self) -> int:
        """Host token slots this registration can still allocate (0 on a miss)."""
        resp = await self._data_call(self._stub.Stats, lambda cid: pb.StatsRequest(client_id=cid), None)
        if resp is None:
            return 0
        c = resp.clients[0]
        return c.capacity_tokens - c.used_tokens

    async def stats(self, all_clients: bool = False) -> pb.StatsResponse:
        """This client's stats, or (``all_clients``) daemon-wide totals; the list of every client
        is only for a caller with the daemon's admin token."""
        req = pb.StatsRequest(client_id="" if all_clients else self.client_id)
        return await self._call(self._stub.Stats, req)

    async def close(self) -> None:
        self._request = None
        self.connected = False
        await self._stop_tasks()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
