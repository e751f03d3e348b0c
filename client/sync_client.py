"""Synchronous client, safe to call from engine threads."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from kvclient import _messages as msg
from kvclient._channel import CHANNEL_OPTIONS, target
from kvclient.errors import KVClientError, from_rpc_error
from kvclient.shm_pool import ShmKVPool
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc


class LoadHandle:
    """A load in flight. ``wait_layer(i)`` returns once global layer i has landed."""

    def __init__(self, layers: list[int], start_layer: int, end_layer: int) -> None:
        self.layers = layers or list(range(start_layer, end_layer))
        self._cond = threading.Condition()
        self._last_layer = -1
        self._done = False
        self._bytes = 0
        self._error: KVClientError | None = None

    def _consume(self, stream: Iterable[pb.LoadProgress]) -> None:
        try:
            for progress in stream:
                with self._cond:
                    self._last_layer = progress.last_layer
                    self._bytes = progress.bytes
                    self._done = progress.done
                    self._cond.notify_all()
            if not self._done:
                raise KVClientError(grpc.StatusCode.INTERNAL, "load stream ended before the last layer")
        except grpc.RpcError as exc:
            self._fail(from_rpc_error(exc))
        except KVClientError as exc:
            self._fail(exc)
        except BaseException as exc:  # never leave waiters hanging
            self._fail(KVClientError(grpc.StatusCode.INTERNAL, f"load stream failed: {exc!r}"))

    def _fail(self, error: KVClientError) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def landed(self, layer_id: int) -> bool:
        with self._cond:
            self._check()
            return self._last_layer >= layer_id

    def wait_layer(self, layer_id: int, timeout: float | None = None) -> None:
        if layer_id not in self.layers:
            raise ValueError(f"layer {layer_id} is not part of this load")
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or self._last_layer >= layer_id, timeout
            )
            self._check()
            if not ok:
                raise TimeoutError(f"layer {layer_id} did not land within {timeout} s")

    def wait(self, timeout: float | None = None) -> int:
        """Waits for every layer; returns the bytes copied."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._error is not None or self._done, timeout)
            self._check()
            if not ok:
                raise TimeoutError(f"load did not finish within {timeout} s")
            return self._bytes


class KVClient:
    """One engine process's connection to the daemon and its registration."""

    def __init__(self, address: str | None = None, *, timeout: float = 30.0) -> None:
        self.target = target(address)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVServerStub(self._channel)
        self._loaders = ThreadPoolExecutor(8, thread_name_prefix="kvclient-load")
        self.registration: msg.Registration | None = None

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    @property
    def client_id(self) -> str:
        if self.registration is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        return self.registration.client_id

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
    ) -> msg.Registration:
        req = msg.register_request(
            model=model, pool=pool, start_layer=start_layer, end_layer=end_layer,
            num_layers=num_layers, host_tokens=host_tokens, page_size=page_size,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        )
        self.registration = msg.registration(self._call(self._stub.Register, req), req)
        return self.registration

    def unregister(self) -> None:
        if self.registration is not None:
            self._call(self._stub.Unregister, pb.UnregisterRequest(client_id=self.client_id))
            self.registration = None

    def alloc(self, num_tokens: int) -> torch.Tensor:
        req = pb.AllocRequest(client_id=self.client_id, num_tokens=num_tokens)
        return msg.host_tensor(self._call(self._stub.Alloc, req))

    def free(self, host_indices: msg.Indices) -> int:
        req = pb.FreeRequest(client_id=self.client_id, host_indices=msg.ids(host_indices))
        return self._call(self._stub.Free, req).freed_tokens

    def write(
        self, *, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None = None
    ) -> int:
        """Offloads device slots to host slots for the given global layers (default: all)."""
        req = pb.WriteRequest(
            client_id=self.client_id,
            host_indices=msg.ids(host_indices),
            device_indices=msg.ids(device_indices),
            layers=msg.layer_list(layers),
        )
        return self._call(self._stub.Write, req).bytes

    def load(
        self, *, host_indices: msg.Indices, device_indices: msg.Indices, layers: Iterable[int] | None = None
    ) -> LoadHandle:
        """Starts a layer-by-layer load and returns at once."""
        reg = self.registration
        req = pb.LoadRequest(
            client_id=self.client_id,
            host_indices=msg.ids(host_indices),
            device_indices=msg.ids(device_indices),
            layers=msg.layer_list(layers),
        )
        handle = LoadHandle(list(req.layers), reg.start_layer, reg.end_layer)
        stream = self._stub.Load(req, timeout=self.timeout)
        self._loaders.submit(handle._consume, stream)
        return handle

    def stats(self, all_clients: bool = False) -> pb.StatsResponse:
        req = pb.StatsRequest(client_id="" if all_clients else self.client_id)
        return self._call(self._stub.Stats, req)

    def close(self) -> None:
        self._loaders.shutdown(wait=True)
        self._channel.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
