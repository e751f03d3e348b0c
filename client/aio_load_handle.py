"""A load or a get in flight, as the asyncio client returns it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from kvclient.errors import KVClientError, from_rpc_error
from kvserver.v1 import kvserver_pb2 as pb


class AsyncLoadHandle:
    """A load in flight. ``await wait_layer(i)`` is True once global layer i has landed, False
    if the load missed. A Get's ``await pages()`` says how many leading pages it loads; one that
    loads none lands no layer.

    ``on_error`` decides about a failed stream: True makes it a miss, False raises it."""

    def __init__(self, layers: list[int], stream: AsyncIterator[pb.LoadProgress] | None,
                 on_error: Callable[[KVClientError], Awaitable[bool]] | None = None, *,
                 get: bool = False) -> None:
        self.layers = layers
        self.get = get
        self.missed = stream is None
        # False only if the load failed and the daemon could not confirm that its copy stopped.
        self.confirmed = True
        self.events: dict[int, object] = {}  # CUDA pools: global layer -> torch.cuda.Event
        self._recorded = False
        self._last_layer = -1
        self._done = False
        self._bytes = 0
        self._pages: int | None = None  # a Get's stored prefix, from its first message
        self._part_pages: list[int] = []  # a Get with parts: each part's
        self.parts = 0  # a Get with parts: how many (set by get_parts)
        self._on_error = on_error
        self._changed = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._consume(stream))

    async def _consume(self, stream: AsyncIterator[pb.LoadProgress] | None) -> None:
        try:
            if stream is None:  # a miss from the start; waiters are still woken below
                return
            async for progress in stream:
                async with self._changed:
                    if self._pages is None:
                        self._pages = progress.pages
                        self._part_pages = list(progress.part_pages)
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
            if self._on_error is None or not await self._on_error(error):
                raise error from None
            self.missed = True
        finally:
            async with self._changed:
                self._changed.notify_all()

    async def wait_layer(self, layer_id: int) -> bool:
        if layer_id not in self.layers:
            raise ValueError(f"layer {layer_id} is not part of this load")
        async with self._changed:
            while self._last_layer < layer_id and not self._done and not self._task.done():
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

    async def pages(self) -> int:
        """Until the first message: how many leading pages this Get loads (0 on a miss)."""
        async with self._changed:
            while self._pages is None and not self._done and not self._task.done():
                await self._changed.wait()
        if self._task.done():
            self._task.result()
        return 0 if self.missed else self._pages or 0

    async def part_pages(self) -> list[int]:
        """A Get with parts: as ``pages``, each part's stored prefix (all 0 on a miss)."""
        await self.pages()
        return [0] * self.parts if self.missed else list(self._part_pages)

    async def stream_wait_layer(self, layer_id: int, stream=None) -> bool:
        """CUDA pools: ``stream`` (default: the current one) waits on the GPU for global layer
        ``layer_id``; the event loop does not wait for the copy. False on a miss."""
        if self.missed:  # e.g. the daemon was away when the load was asked for: no events
            return False
        if layer_id not in self.events:
            raise ValueError(f"layer {layer_id} has no event in this load (not a CUDA pool, or not loaded)")
        if not await self.wait_recorded() or (self.get and self._pages == 0):  # a Get of nothing
            return False
        import torch

        (stream or torch.cuda.current_stream()).wait_event(self.events[layer_id])
        return True

    async def wait(self) -> int:
        await self._task
        return 0 if self.missed else self._bytes
