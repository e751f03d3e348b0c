"""asyncio client, for engines and tools that run an event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
import torch

from kvclient import _messages as msg
from kvclient._channel import CHANNEL_OPTIONS, target
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.shm_pool import ShmKVPool
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc


class AsyncLoadHandle:
    """A load in flight. ``await wait_layer(i)`` returns once global layer i has landed."""

    def __init__(self, layers: list[int], stream: AsyncIterator[pb.LoadProgress]) -> None:
        self.layers = layers
        self._last_layer = -1
        self._done = False
        self._bytes = 0
        self._changed = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._consume(stream))

    async def _consume(self, stream: AsyncIterator[pb.LoadProgress]) -> None:
        try:
            async for progress in stream:
                async with self._changed:
                    self._last_layer = progress.last_layer
                    self._bytes = progress.bytes
                    self._done = progress.done
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            async with self._changed:
                self._changed.notify_all()
        if not self._done:
            raise KVClientError(grpc.StatusCode.INTERNAL, "load stream ended before the last layer")

    async def _wait(self, ready) -> None:
        async with self._changed:
            while not ready():
                if self._task.done():
                    self._task.result()
                await self._changed.wait()
        if self._task.done() and not ready():
            self._task.result()

    async def wait_layer(self, layer_id: int) -> None:
        if layer_id not in self.layers:
            raise ValueError(f"layer {layer_id} is not part of this load")
        await self._wait(lambda: self._last_layer >= layer_id)

    async def wait(self) -> int:
        await self._task
        return self._bytes


class AsyncKVClient:
    """asyncio twin of KVClient; create it inside the running loop."""

    def __init__(self, address: str | None = None, *, timeout: float = 30.0) -> None:
        self.target = target(address)
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self.registration: msg.Registration | None = None

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    @property
    def client_id(self) -> str:
        if self.registration is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        return self.registration.client_id

    async def register(self, *, model: str, pool: ShmKVPool, start_layer: int, end_layer: int,
                       num_layers: int, host_tokens: int, page_size: int = 1, tp_rank: int = 0,
                       tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> msg.Registration:
        req = msg.register_request(
            model=model, pool=pool, start_layer=start_layer, end_layer=end_layer,
            num_layers=num_layers, host_tokens=host_tokens, page_size=page_size,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        )
        self.registration = msg.registration(await self._call(self._stub.Register, req), req)
        return self.registration

    async def unregister(self) -> None:
        if self.registration is not None:
            await self._call(self._stub.Unregister, pb.UnregisterRequest(client_id=self.client_id))
            self.registration = None

    async def alloc(self, num_tokens: int) -> torch.Tensor:
        req = pb.AllocRequest(client_id=self.client_id, num_tokens=num_tokens)
        return msg.host_tensor(await self._call(self._stub.Alloc, req))

    async def free(self, host_indices: msg.Indices) -> int:
        req = pb.FreeRequest(client_id=self.client_id, host_indices=msg.ids(host_indices))
        return (await self._call(self._stub.Free, req)).freed_tokens

    async def write(self, *, host_indices: msg.Indices, device_indices: msg.Indices,
                    layers: Iterable[int] | None = None) -> int:
        req = pb.WriteRequest(
            client_id=self.client_id,
            host_indices=msg.ids(host_indices),
            device_indices=msg.ids(device_indices),
            layers=msg.layer_list(layers),
        )
        return (await self._call(self._stub.Write, req)).bytes

    def load(self, *, host_indices: msg.Indices, device_indices: msg.Indices,
             layers: Iterable[int] | None = None) -> AsyncLoadHandle:
        reg = self.registration
        req = pb.LoadRequest(
            client_id=self.client_id,
            host_indices=msg.ids(host_indices),
            device_indices=msg.ids(device_indices),
            layers=msg.layer_list(layers),
        )
        layer_ids = list(req.layers) or list(range(reg.start_layer, reg.end_layer))
        return AsyncLoadHandle(layer_ids, self._stub.Load(req, timeout=self.timeout))

    async def stats(self, all_clients: bool = False) -> pb.StatsResponse:
        req = pb.StatsRequest(client_id="" if all_clients else self.client_id)
        return await self._call(self._stub.Stats, req)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
