"""asyncio client, for engines and tools that run an event loop.

Same behaviour as ``KVClient``: a Session stream keeps the registration alive, and in resilient
mode the daemon going away turns into misses while a task re-registers with backoff. What to
send and what each answer means is ``ClientCore``'s; this shell only sends it, on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

import grpc
import torch

from kvclient import _messages as msg
from kvclient._ops import Call, Missed, Op, StreamOp
from kvclient._shell import CoreShell
from kvclient._transport.channel import CHANNEL_OPTIONS
from kvclient._transport.fd_socket import ticketed
from kvclient.aio_load_handle import AsyncLoadHandle
from kvclient.core import ClientCore, Reregistration
from kvclient.cuda_pool import CudaKVPool
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.keys import KEY_BYTES, Keys
from kvclient.results import LookupResult, PutResult
from kvclient.shm_pool import ShmKVPool
from kvclient.views_pool import KVViewsPool
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

__all__ = ["AsyncKVClient", "AsyncLoadHandle"]


class AsyncKVClient(CoreShell):
    """asyncio twin of KVClient; create it inside the running loop."""

    def __init__(self, address: str | None = None, *, timeout: float = 5.0, token: str | None = None,
                 resilient: bool = True, tenant_token: str | None = None) -> None:
        self._core = ClientCore(address, timeout=timeout, token=token, resilient=resilient,
                                tenant_token=tenant_token)
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self._reconnect: asyncio.Task | None = None

    # ---- I/O --------------------------------------------------------------------------------

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout, metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def _run(self, op: Op):
        call = self._core.start(op)
        if isinstance(call, Missed):
            return call.value
        try:
            resp = await getattr(self._stub, op.rpc)(call.request, timeout=call.timeout,
                                                     metadata=self._core.metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this task itself was cancelled
                raise
            # grpc.aio ends a call with CancelledError when its channel is closed under it: as the
            # blocking client, a cancelled call (a miss, not an exception reaching the engine)
            error = KVClientError(grpc.StatusCode.CANCELLED, f"the {op.rpc} call was cancelled (closed)")
        else:
            return op.read(resp)
        if self._core.unconfirmed(call, error):
            await self._confirm_stopped(call.reg)
        if self._is_miss(error, call.reg, call.op.cache):
            return op.miss
        raise error from None

    def _stream(self, op: StreamOp) -> AsyncLoadHandle:
        call = self._core.start_stream(op)
        if isinstance(call, Missed):
            return AsyncLoadHandle(call.value, None, get=op.get)
        stream = getattr(self._stub, op.rpc)(call.request, timeout=call.timeout, metadata=self._core.metadata)
        handle = AsyncLoadHandle(call.layers, stream, lambda error: self._stream_failed(call, handle, error),
                                 get=op.get)
        handle.events = call.events
        return handle

    async def _stream_failed(self, call: Call, handle: AsyncLoadHandle, error: KVClientError) -> bool:
        # Reported to the engine only once the copy cannot still run.
        if self._core.unconfirmed(call, error):
            handle.confirmed = await self._confirm_stopped(call.reg)
        return self._is_miss(error, call.reg, call.op.cache)

    def _is_miss(self, error: KVClientError, reg: msg.Registration | None, cache: bool = False) -> bool:
        miss, lose = self._core.judge(error, reg, cache)
        if lose:
            self._lost(reg, error.message)
        return miss

    async def _confirm_stopped(self, reg: msg.Registration) -> bool:
        req = self._core.confirm_request(reg)
        if req is None:
            return False
        try:
            confirmed = self._core.confirmed(await self._stub.Unregister(req, timeout=self.timeout,
                                                                         metadata=self._core.metadata))
        except grpc.RpcError as exc:
            confirmed = self._core.confirmed(None, from_rpc_error(exc))
        self._lost(reg, "a copy outlived its deadline unanswered")
        return confirmed

    # ---- registration and liveness --------------------------------------------------------

    async def register(self, *, model: str, pool: ShmKVPool | CudaKVPool | KVViewsPool, start_layer: int,
                       end_layer: int,
                       num_layers: int, host_tokens: int, page_size: int = 1, tp_rank: int = 0,
                       tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                       event_slots: int = 0, min_host_tokens: int | None = None,
                       weights: str = "") -> msg.Registration:
        req = self._core.register_request(
            model=model, pool=pool, start_layer=start_layer, end_layer=end_layer,
            num_layers=num_layers, host_tokens=host_tokens, page_size=page_size,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, event_slots=event_slots,
            min_host_tokens=min_host_tokens, weights=weights,
        )
        sent = await asyncio.to_thread(ticketed, self.target, pool, req, self.timeout)
        reg, replaced = self._core.registered(await self._call(self._stub.Register, sent), req, pool)
        if replaced is not None and replaced is not asyncio.current_task():
            replaced.cancel()
        self._open_session(reg)
        return reg

    def _open_session(self, reg: msg.Registration) -> None:
        task = asyncio.get_running_loop().create_task(self._hold_session(reg))
        if not self._core.hold(reg, task):
            task.cancel()

    async def _hold_session(self, reg: msg.Registration) -> None:
        reason = "session ended"
        try:
            async for _ in self._stub.Session(pb.SessionRequest(client_id=reg.client_id),
                                              metadata=self._core.metadata):
                pass
        except grpc.RpcError as exc:
            reason = f"session ended: {exc.code().name}"
        self._lost(reg, reason)

    def _lost(self, reg: msg.Registration | None, reason: str) -> None:
        lost = self._core.lose(reg, reason)
        if lost is None:
            return
        if lost.session is not None and lost.session is not asyncio.current_task():
            lost.session.cancel()
        if lost.reconnect:
            self._reconnect = asyncio.get_running_loop().create_task(self._reregister(reg))

    async def _reregister(self, old: msg.Registration) -> None:
        tries = Reregistration()
        try:
            while True:
                await asyncio.sleep(tries.next())
                retry = self._core.retry_request(old)
                if retry is None:
                    return
                try:
                    sent = await asyncio.to_thread(ticketed, self.target, self._core.pool, retry,
                                                   self.timeout)
                    resp = await self._stub.Register(sent, timeout=self.timeout, metadata=self._core.metadata)
                except grpc.RpcError as exc:
                    tries.failed(exc.code(), exc.details() or "")
                    continue
                except KVClientError as exc:  # no peer ticket: the daemon is not back yet
                    tries.failed(None, exc.message)
                    continue
                tries.succeeded()
                reg = self._core.reregistered(resp, old, tries.attempts)
                if reg is not None:
                    self._open_session(reg)
                else:  # unregistered, closed or replaced meanwhile: this one is nobody's
                    await asyncio.shield(self._drop_orphan(resp.client_id))
                return
        finally:
            self._core.reconnect_ended(old)
            if self._reconnect is asyncio.current_task():
                self._reconnect = None

    async def _drop_orphan(self, client_id: str) -> None:
        """Unregisters a registration the client no longer wants (best effort: the daemon would
        otherwise hold it for its lease)."""
        try:
            await self._stub.Unregister(pb.UnregisterRequest(client_id=client_id), timeout=self.timeout,
                                        metadata=self._core.metadata)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            logger.debug("unregistering a registration nobody uses failed: %r", exc)

    async def _stop_tasks(self, session: object | None) -> None:
        for task in (session, self._reconnect):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reconnect = None

    async def unregister(self) -> None:
        reg, session = self._core.unregistering()
        await self._stop_tasks(session)
        if reg is None:
            return
        try:
            resp = await self._call(self._stub.Unregister, pb.UnregisterRequest(client_id=reg.client_id))
        except KVClientError as exc:
            self._core.unregister_failed(exc)
        else:
            self._core.unregistered(resp.copies_pending)

    # ---- the index API ----------------------------------------------------------------------

    async def alloc(self, num_tokens: int) -> torch.Tensor | None:
        return await self._run(self._core.alloc(num_tokens))

    async def free(self, host_indices: msg.Indices) -> int:
        return await self._run(self._core.free(host_indices))

    async def write(self, *, host_indices: msg.Indices, device_indices: msg.Indices,
                    layers: Iterable[int] | None = None, ready_event=None) -> int:
        return await self._run(self._core.write(host_indices, device_indices, layers, ready_event))

    def load(self, *, host_indices: msg.Indices, device_indices: msg.Indices,
             layers: Iterable[int] | None = None, event_slot: int = 0, ready_event=None) -> AsyncLoadHandle:
        """Starts a layer-by-layer load; CUDA pools record the layer events of ``event_slot``."""
        return self._stream(self._core.load(host_indices, device_indices, layers, event_slot, ready_event))

    async def available_size(self) -> int:
        """Host token slots this registration can still allocate (0 on a miss)."""
        return await self._run(self._core.available_size())

    async def stats(self, all_clients: bool = False) -> pb.StatsResponse:
        """This client's stats, or (``all_clients``) daemon-wide totals; the list of every client
        is only for a caller with the daemon's admin token."""
        return await self._run(self._core.stats(all_clients))

    # ---- the node-wide cache ----------------------------------------------------------------

    async def lookup(self, keys: Keys, *, pin_ms: int = 0, whole_space: bool = False,
                     key_bytes: int = KEY_BYTES, timeout: float | None = None,
                     memory_only: bool = False) -> LookupResult:
        return await self._run(self._core.lookup(keys, pin_ms, whole_space, key_bytes, timeout, memory_only))

    async def ping(self, timeout: float | None = None) -> bool:
        """True if the daemon answers a call on this registration (an empty Lookup) in time."""
        misses = self.misses
        try:
            await self.lookup(b"", timeout=timeout)
        except KVClientError:
            return False
        return self.misses == misses

    async def put(self, keys: Keys, device_pages: msg.Indices, *, ready_event=None,
                  key_bytes: int = KEY_BYTES) -> PutResult:
        return await self._run(self._core.put(keys, device_pages, ready_event, key_bytes))

    def get(self, keys: Keys, device_pages: msg.Indices, *, layers: Iterable[int] | None = None,
            event_slot: int = 0, ready_event=None, lease_id: str = "",
            key_bytes: int = KEY_BYTES) -> AsyncLoadHandle:
        """Starts a Get, as ``load``; ``await handle.pages()`` says how many pages it loads."""
        return self._stream(self._core.get(keys, device_pages, layers, event_slot, ready_event, lease_id,
                                           key_bytes))

    def get_parts(self, parts: Sequence[tuple[Keys, msg.Indices, str]], *,
                  layers: Iterable[int] | None = None, event_slot: int = 0, ready_event=None,
                  key_bytes: int = KEY_BYTES) -> AsyncLoadHandle:
        """Several Gets in one call, as ``KVClient.get_parts``; ``await handle.part_pages()``."""
        handle = self._stream(self._core.get_parts(parts, layers, event_slot, ready_event, key_bytes))
        handle.parts = len(parts)
        return handle

    async def release(self, lease_ids: str | Sequence[str]) -> int:
        return await self._run(self._core.release(lease_ids))

    # ---- closing ----------------------------------------------------------------------------

    async def close(self) -> None:
        await self._stop_tasks(self._core.closing())
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
