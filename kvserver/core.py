"""The daemon's core: clients, the host arena and the copy workers. No gRPC in here.

State changes (register, alloc, free, unregister) run on the event loop thread, so they need no
locks. Copies run in a thread pool; while one runs, its host pages are marked busy so that a
Free or Unregister of those pages waits for it to finish instead of racing it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvserver import epochs, transfer
from kvserver.client_state import ClientSpec, ClientState, Counters
from kvserver.device_pool import open_pool
from kvserver.errors import InvalidArgument, NoCapacity, UnknownClient, shown
from kvserver.host_pool import HostArena
from kvserver.layer_signal import LayerSignal
from kvserver.page_allocator import PageAllocator
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger(__name__)

# Copies up to this size run on the event loop when the worker is idle (~50 us at memcpy speed).
INLINE_COPY_BYTES = 256 << 10


@dataclass(frozen=True, slots=True)
class LoadStep:
    """One or more layers landed: every requested layer up to ``last_layer`` (global). A CUDA
    load first yields a step with ``events_recorded`` and no layer done yet."""

    last_layer: int
    layers_done: int
    bytes: int
    events_recorded: bool = False


@dataclass(frozen=True, slots=True)
class Job:
    client: ClientState
    plan: transfer.CopyPlan
    local_layers: list[int]
    pages: np.ndarray
    ready_event: bytes = b""  # CUDA: the engine's event to wait on before copying
    event_slot: int = 0  # CUDA loads: whose layer events to record

    @property
    def bytes_per_layer(self) -> int:
        spec = self.client.spec
        return self.plan.num_tokens * spec.token_bytes * spec.layout.num_parts


class KVCore:
    def __init__(
        self,
        host_memory: int,
        copy_threads: int = 1,
        progress_interval: float = 0.0,
        max_clients: int = 1024,
        max_request_indices: int = 1 << 22,
    ) -> None:
        self.arena = HostArena(host_memory)
        self.progress_interval = progress_interval
        self.max_clients = max_clients
        self.max_request_indices = max_request_indices
        self.clients: dict[str, ClientState] = {}
        self.reclaimed = 0  # clients reclaimed by liveness
        self.totals = Counters()  # transfers of clients already gone
        self._queued = 0  # copies handed to the worker and not yet released
        self._executor = ThreadPoolExecutor(copy_threads, thread_name_prefix="kvcopy")

    # ---- registration -------------------------------------------------------------------

    def register(self, req: pb.RegisterRequest) -> ClientState:
        spec = ClientSpec.from_request(req)
        if len(self.clients) >= self.max_clients:
            raise NoCapacity(f"client limit reached: {self.max_clients} clients are registered")
        if req.host_tokens == 0:
            raise InvalidArgument("host_tokens must be at least one page")
        device = open_pool(
            req.device_pool, spec.layout, spec.dtype, len(spec.layers), spec.page_size, req.event_slots
        )
        try:
            page_bytes = spec.page_bytes
            want_pages = -(-req.host_tokens // spec.page_size)
            num_pages = min(want_pages, self.arena.largest_free() // page_bytes)
            if num_pages == 0:
                raise NoCapacity(
                    f"no host memory left for one page of {page_bytes} bytes "
                    f"({self.arena.capacity - self.arena.reserved} of {self.arena.capacity} free)"
                )
            offset = self.arena.reserve(num_pages * page_bytes)
        except BaseException:
            device.close()
            raise
        if device.kind == "cuda":
            try:
                device.attach_host(self.arena.address + offset, num_pages * page_bytes, len(spec.layers))
            except BaseException:
                device.close()
                self.arena.release(offset, num_pages * page_bytes)
                raise
        host_views = self._host_views(spec, device.dtype, offset, num_pages)
        client = ClientState(
            client_id=secrets.token_hex(16),
            epoch=self._new_epoch(),
            spec=spec,
            device=device,
            region_offset=offset,
            region_bytes=num_pages * page_bytes,
            pages=PageAllocator(num_pages),
            host_views=host_views,
            host_table=transfer.BufferTable.of(host_views),
            busy=np.zeros(num_pages, dtype=np.int32),
        )
        self.clients[client.client_id] = client
        logger.info(
            "registered %s: model=%s tp=%d/%d pp=%d/%d layers=%s pages=%d x %d B",
            client.client_id, spec.model, spec.tp_rank, spec.tp_size, spec.pp_rank, spec.pp_size,
            spec.layers, num_pages, page_bytes,
        )
        return client

    def _new_epoch(self) -> int:
        live = {c.epoch for c in self.clients.values()}
        while True:
            epoch = 1 + secrets.randbelow(epochs.MAX_EPOCH)
            if epoch not in live:
                return epoch

    def _host_views(
        self, spec: ClientSpec, wide: torch.dtype, offset: int, num_pages: int
    ) -> list[list[torch.Tensor]]:
        w = wide.itemsize
        flat = self.arena.view(wide)
        chunk = spec.page_size * spec.token_bytes
        parts = spec.layout.num_parts
        return [
            [
                torch.as_strided(
                    flat,
                    (num_pages, chunk // w),
                    (spec.page_bytes // w, 1),
                    (offset + (layer * parts + part) * chunk) // w,
                )
                for part in range(parts)
            ]
            for layer in range(len(spec.layers))
        ]

    async def unregister(self, client_id: str, reason: str = "unregistered") -> None:
        """Releases everything the client holds, once its in-flight copies are done."""
        client = self.client(client_id)
        client.closing = True
        await self._wait(client, lambda: client.inflight == 0)
        del self.clients[client_id]
        self.totals.add(client.counters)
        client.host_views = []
        try:
            client.device.close()
        except Exception:
            logger.exception("closing the device pool of %s failed; releasing its host memory anyway",
                             client_id)
        finally:
            self.arena.release(client.region_offset, client.region_bytes)
            client.gone.set()
        logger.info("%s %s (%d host bytes released)", reason, client_id, client.region_bytes)

    def client(self, client_id: str) -> ClientState:
        """The live client of this id; every call through here renews the client's lease."""
        client = self.clients.get(client_id)
        if client is None or client.closing:
            raise UnknownClient(
                f"unknown client id {shown(client_id)}: register first (it may have been "
                "unregistered, reclaimed after its session ended, or lost in a daemon restart)"
            )
        client.last_seen = time.monotonic()
        return client

    def _host_pages(self, client: ClientState, host_indices) -> np.ndarray:
        self._check_size(len(host_indices))
        host = transfer.as_indices(host_indices, "host")
        slots = epochs.strip(host, client.epoch)
        pages = transfer.host_pages_of(slots, client.spec.page_size)
        client.pages.check_owned(pages)
        return pages

    def _check_size(self, n: int) -> None:
        if n > self.max_request_indices:
            raise NoCapacity(
                f"{n} indices in one request; the limit is {self.max_request_indices}: split it"
            )

    # ---- host pages -----------------------------------------------------------------------

    def alloc(self, client_id: str, num_tokens: int) -> np.ndarray:
        client = self.client(client_id)
        if num_tokens <= 0:
            raise InvalidArgument("num_tokens must be positive")
        p = client.spec.page_size
        num_pages = -(-num_tokens // p)
        if num_pages <= client.pages.num_free:  # else allocate() names the full region
            self._check_size(num_pages * p)
        pages = client.pages.allocate(num_pages)
        return epochs.tag(_page_tokens(pages, p), client.epoch)

    async def free(self, client_id: str, host_indices) -> int:
        client = self.client(client_id)
        pages = self._host_pages(client, host_indices)
        if client.busy[pages].any():
            # A copy still reads or writes these pages: free them once it is done.
            await self._wait(client, lambda: not client.busy[pages].any())
            client = self.client(client_id)
        client.pages.free(pages)
        return pages.size * client.spec.page_size

    # ---- transfers ------------------------------------------------------------------------

    def prepare(self, client_id: str, host_indices, device_indices, layers, ready_event: bytes = b"",
                event_slot: int = 0) -> Job:
        """Validates a whole transfer request and plans it; touches no memory."""
        client = self.client(client_id)
        spec = client.spec
        if client.device.kind != "cuda" and (ready_event or event_slot):
            raise InvalidArgument("ready_event and event_slot are for CUDA pools; this pool is shared memory")
        if client.device.kind == "cuda":
            if event_slot >= client.device.event_slots:
                raise InvalidArgument(
                    f"event_slot {event_slot} is not one of this registration's "
                    f"{client.device.event_slots} slots"
                )
            if ready_event and len(ready_event) != 64:
                raise InvalidArgument(
                    f"ready_event must be a 64-byte CUDA IPC event handle, got {len(ready_event)} bytes"
                )
        local_layers = spec.layers.select(layers)
        if len(host_indices) != len(device_indices):
            raise InvalidArgument(
                f"{len(host_indices)} host indices but {len(device_indices)} device indices; "
                "they must pair up"
            )
        pages = self._host_pages(client, host_indices)
        dev = transfer.as_indices(device_indices, "device")
        transfer.check_device_tokens(dev, client.device.num_tokens)
        client.device.check_sizes()  # narrows, does not close, the window for a SIGBUS
        num_dev_pages = client.device.num_pages if _paged(client.device) else None
        plan = transfer.make_plan(pages, dev, spec.page_size, num_dev_pages)
        return Job(client, plan, local_layers, pages, bytes(ready_event), event_slot)

    async def write(self, job: Job) -> int:
        await self._submit(job, False, None)
        nbytes = job.bytes_per_layer * len(job.local_layers)
        job.client.counters.bytes_written += nbytes
        job.client.counters.write_ops += 1
        return nbytes

    async def load(self, job: Job) -> AsyncIterator[LoadStep]:
        """Runs the copy in the worker and yields progress as layers land.

        Steps are at least ``progress_interval`` seconds apart (the last one is never held
        back): each message costs both processes CPU time, which on a busy node comes out of
        the copy. A step covers every layer landed since the previous one.
        """
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        signal = LayerSignal(self.progress_interval, len(job.local_layers))
        signal.watch(loop, changed)
        try:
            fut = self._submit(job, True, signal)
        except BaseException:
            signal.unwatch(loop)
            signal.release()  # the job's share: it never started
            raise
        start = job.client.spec.layers.start
        total = len(job.local_layers)
        sent, sent_at = 0, -math.inf
        told_recorded = job.client.device.kind != "cuda"
        waiter = None
        try:
            while sent < total:
                if fut.done():
                    fut.result()  # raises the worker's error, if any
                if not told_recorded and signal.recorded:
                    told_recorded = True
                    yield LoadStep(-1, 0, 0, events_recorded=True)
                done = signal.layers_done
                wait = self.progress_interval - (time.monotonic() - sent_at)
                if done > sent and (done == total or wait <= 0):
                    yield LoadStep(start + job.local_layers[done - 1], done, done * job.bytes_per_layer)
                    sent, sent_at = done, time.monotonic()
                    continue
                changed.clear()
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait({waiter, fut}, timeout=wait if done > sent else None,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            await fut
        finally:
            if waiter is not None:
                waiter.cancel()
            signal.unwatch(loop)
        job.client.counters.bytes_loaded += total * job.bytes_per_layer
        job.client.counters.load_ops += 1

    def _submit(self, job: Job, to_device: bool, signal: LayerSignal | None) -> asyncio.Future[None]:
        """Starts a copy; its pages stay busy (and its signal open) until the worker thread is
        really done with them, even when the RPC that asked for it is cancelled first.

        A small copy while no other copy is queued runs right here on the loop: it takes less
        time than handing it to the worker and back would, and still keeps arrival order.
        """
        loop = asyncio.get_running_loop()
        client = job.client
        client.busy[job.pages] += 1
        client.inflight += 1
        small = job.bytes_per_layer * len(job.local_layers) <= INLINE_COPY_BYTES
        if self._queued == 0 and small and client.device.kind == "shm":
            fut = loop.create_future()
            try:
                self._run(job, to_device, signal)
                fut.set_result(None)
            except Exception as exc:
                fut.set_exception(exc)
            finally:
                self._release(job, signal)
            return fut
        self._queued += 1
        cf = self._executor.submit(self._run, job, to_device, signal)
        cf.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, job, signal, True))
        return asyncio.wrap_future(cf, loop=loop)

    def _run(self, job: Job, to_device: bool, signal: LayerSignal | None) -> None:
        client, device = job.client, job.client.device
        if device.kind == "cuda":
            layers = np.asarray(job.local_layers, dtype=np.int64)
            device.run(job.plan, layers, client.host_table, to_device, signal, job.ready_event,
                       job.event_slot)
            return
        table = device.page_table if job.plan.device_paged else device.token_table
        layers = np.asarray(job.local_layers, dtype=np.int64)
        progress, fd = (signal.counter, signal.fd) if signal is not None else (None, -1)
        interval = signal.interval if signal is not None else 0.0
        if transfer.copy_job(job.plan, layers, client.host_table, table, to_device, progress, fd, interval):
            return
        for i, layer in enumerate(job.local_layers):
            for part, host in enumerate(client.host_views[layer]):
                pages = device.page_views[layer][part] if device.page_views is not None else None
                transfer.copy_part(job.plan, host, pages, device.token_views[layer][part], to_device)
            if signal is not None:
                signal.publish(i + 1)

    def _release(self, job: Job, signal: LayerSignal | None, queued: bool = False) -> None:
        self._queued -= queued
        client = job.client
        client.busy[job.pages] -= 1
        client.inflight -= 1
        if signal is not None:
            signal.release()
        client.changed.set()
        client.changed = asyncio.Event()

    @staticmethod
    async def _wait(client: ClientState, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await client.changed.wait()

    # ---- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        for client_id in list(self.clients):
            await self.unregister(client_id)
        self._executor.shutdown(wait=True)
        self.arena.close()


def _paged(device) -> bool:
    return device.paged if device.kind == "cuda" else device.page_views is not None


def _page_tokens(pages: np.ndarray, page_size: int) -> np.ndarray:
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
