"""A scheduler's view of the node-wide cache: how much of a prompt is cached for a whole KV
space, without a pool (``ViewCore`` plans; these shells send).

The space is opened (``OpenSpace``) on the first call, with a peer ticket on a Unix socket so
that the daemon knows the caller's uid; ``space_id`` and ``tenant`` are "" until then. The
synchronous view's Lookups then take the space's fast lane where the daemon gives one
(``kvclient.view_lane``); the asyncio view's stay on gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import torch

from kvclient._transport.channel import CHANNEL_OPTIONS
from kvclient._transport.fd_socket import ticket_for
from kvclient._transport.lane import ClientLane
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.keys import KEY_BYTES, Keys
from kvclient.results import EventsResult, LookupResult
from kvclient.view_core import RETRY, ViewCore, ViewOp
from kvclient.view_lane import ViewLane
from kvserver.protocol.layout import KVLayout
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (a sliver at least: a call past it fails at once as late)."""
    return max(0.001, deadline - time.monotonic())


class _ViewShell:
    _core: ViewCore

    @property
    def space_id(self) -> str:
        return self._core.space_id

    @property
    def tenant(self) -> str:
        return self._core.tenant

    @property
    def misses(self) -> int:
        return self._core.misses


class CacheView(_ViewShell):
    """``lookup`` answers for the whole space (a page counts once every part of it is cached).
    ``lane="auto"``: on a Unix socket the Lookups take the space's fast lane (``kvclient.view_lane``),
    opened on the first one; ``"grpc"``: every call is a gRPC call."""

    def __init__(self, address: str | None = None, *, model: str, layout: KVLayout, dtype: torch.dtype,
                 page_size: int, num_layers: int, tp_size: int = 1, pp_size: int = 1, timeout: float = 5.0,
                 token: str | None = None, tenant_token: str | None = None, weights: str = "",
                 lane: str = "auto") -> None:
        if lane not in ("auto", "grpc"):
            raise ValueError(f"lane must be 'auto' or 'grpc', not {lane!r}")
        self._core = ViewCore(address, model=model, layout=layout, dtype=dtype, page_size=page_size,
                              num_layers=num_layers, tp_size=tp_size, pp_size=pp_size, timeout=timeout,
                              token=token, tenant_token=tenant_token, weights=weights)
        self._channel = grpc.insecure_channel(self._core.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self._lane = ViewLane(self._core.target, self._core.metadata, lambda: self._core.space_id,
                              enabled=lane == "auto")

    @property
    def lane(self) -> ClientLane | None:
        """The space's open fast lane, or None (the Lookups take gRPC)."""
        return self._lane.lane

    def open(self, timeout: float | None = None) -> str:
        """Opens the space (raising on failure); returns its id. The peer ticket and the call
        together wait at most ``timeout`` (the view's by default)."""
        deadline = time.monotonic() + (self._core.timeout if timeout is None else timeout)
        req = self._core.open_request(ticket_for(self._core.target, timeout=_left(deadline)))
        try:
            resp = self._stub.OpenSpace(req, timeout=_left(deadline), metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._core.opened(resp)

    def _run(self, op: ViewOp, timeout: float | None = None):
        retried = False
        # every step of the call within one bound: the view's, or the caller's
        deadline = time.monotonic() + (self._core.timeout if timeout is None else timeout)
        while True:
            try:
                space_id = self._core.space_id or self.open(_left(deadline))
                request = op.build(space_id)
                resp = self._lane.lookup(self._stub, request, deadline) if op.rpc == "Lookup" else None
                if resp is None:
                    resp = getattr(self._stub, op.rpc)(request, timeout=_left(deadline),
                                                       metadata=self._core.metadata)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            except KVClientError as exc:
                error = exc
            else:
                return op.read(resp)
            if self._core.failed(op, error, retried) != RETRY:
                return op.miss
            retried = True

    def lookup(self, keys: Keys, *, pin_ms: int = 0, key_bytes: int = KEY_BYTES,
               timeout: float | None = None) -> LookupResult:
        """Leading keys cached in every part of the space (0 while the daemon is away);
        ``pin_ms`` pins them under the returned lease. ``timeout``: the whole call's bound, if
        not the view's."""
        return self._run(self._core.lookup(keys, pin_ms, key_bytes), timeout)

    def events(self, log_id: str = "", after_seq: int = 0, *, max_keys: int = 0) -> EventsResult:
        """KV events of the space since the last read (``log_id`` and ``next_seq`` of the last
        answer; the first read starts the space's log and returns none). While the daemon is
        away: none, to read again from the same place."""
        return self._run(self._core.events(log_id, after_seq, max_keys))

    def ping(self) -> bool:
        """True if the daemon answers: the space opened again (within the view's timeout)."""
        try:
            self.open()
        except KVClientError:
            return False
        return True

    def release(self, lease_ids: str | Sequence[str]) -> int:
        return self._run(self._core.release(lease_ids))

    def close(self) -> None:
        self._lane.close()
        self._channel.close()

    def __enter__(self) -> CacheView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncCacheView(_ViewShell):
    """asyncio twin of CacheView; create it inside the running loop."""

    def __init__(self, address: str | None = None, *, model: str, layout: KVLayout, dtype: torch.dtype,
                 page_size: int, num_layers: int, tp_size: int = 1, pp_size: int = 1, timeout: float = 5.0,
                 token: str | None = None, tenant_token: str | None = None, weights: str = "") -> None:
        self._core = ViewCore(address, model=model, layout=layout, dtype=dtype, page_size=page_size,
                              num_layers=num_layers, tp_size=tp_size, pp_size=pp_size, timeout=timeout,
                              token=token, tenant_token=tenant_token, weights=weights)
        self._channel = grpc.aio.insecure_channel(self._core.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)

    async def open(self) -> str:
        """Opens the space (raising on failure); returns its id."""
        req = self._core.open_request(await asyncio.to_thread(ticket_for, self._core.target, (),
                                                              self._core.timeout))
        try:
            resp = await self._stub.OpenSpace(req, timeout=self._core.timeout, metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._core.opened(resp)

    async def _run(self, op: ViewOp):
        retried = False
        while True:
            try:
                space_id = self._core.space_id or await self.open()
                resp = await getattr(self._stub, op.rpc)(op.build(space_id), timeout=self._core.timeout,
                                                         metadata=self._core.metadata)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            except KVClientError as exc:
                error = exc
            else:
                return op.read(resp)
            if self._core.failed(op, error, retried) != RETRY:
                return op.miss
            retried = True

    async def lookup(self, keys: Keys, *, pin_ms: int = 0, key_bytes: int = KEY_BYTES) -> LookupResult:
        return await self._run(self._core.lookup(keys, pin_ms, key_bytes))

    async def events(self, log_id: str = "", after_seq: int = 0, *, max_keys: int = 0) -> EventsResult:
        return await self._run(self._core.events(log_id, after_seq, max_keys))

    async def release(self, lease_ids: str | Sequence[str]) -> int:
        return await self._run(self._core.release(lease_ids))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncCacheView:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
