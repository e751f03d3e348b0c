"""A torch-free engine for liveness, restart and soak tests: raw gRPC stubs and numpy over a
shared-memory KV pool, so a process starts in milliseconds from a forkserver. The pool is a
sealed memfd handed over the daemon's fd socket, or with ``named=True`` a /dev/shm object."""

from __future__ import annotations

import hashlib
import os
import time

import grpc
import numpy as np

from kvserver.protocol.fd_socket import fd_socket_path, request_ticket
from kvserver.protocol.shared_memory import create_memfd, create_shm, unlink_shm
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc


class LightEngine:
    """One MHA fp16 pool of ``layers`` x (K, V) x ``num_tokens`` x ``token_bytes``, registered."""

    def __init__(self, address: str, name: str, *, layers: int = 4, num_tokens: int = 1024,
                 heads: int = 2, head_dim: int = 64, page_size: int = 16, host_tokens: int = 1024,
                 session: bool = True, named: bool = False) -> None:
        self.name = name
        self.named = named
        self.page_size = page_size
        self.token_bytes = heads * head_dim * 2
        self.num_tokens = num_tokens
        size = layers * 2 * num_tokens * self.token_bytes
        self.fd = -1
        if named:
            self.shm = create_shm(name, size)
        else:
            self.fd, self.shm = create_memfd(name, size)
        self.kv = np.frombuffer(self.shm.mm, dtype=np.uint8).reshape(layers, 2, num_tokens, self.token_bytes)
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.KVServerStub(self.channel)
        buffer_bytes = num_tokens * self.token_bytes
        where = {"shm": pb.ShmLocation(name=name)} if named else {"fd": pb.FdLocation(index=0)}
        pool = pb.DevicePool(num_tokens=num_tokens, layers=[
            pb.LayerBuffers(parts=[
                pb.BufferRef(**where, offset=(layer * 2 + part) * buffer_bytes,
                             token_stride=self.token_bytes)
                for part in range(2)
            ])
            for layer in range(layers)
        ])
        self.reg = self.stub.Register(pb.RegisterRequest(
            model="light", start_layer=0, end_layer=layers, num_layers=layers,
            layout=pb.KVLayout(mha=pb.MHALayout(num_heads=heads, head_dim=head_dim)),
            dtype=pb.DTYPE_FLOAT16, page_size=page_size, device_pool=pool, host_tokens=host_tokens,
            peer_ticket=request_ticket(fd_socket_path(address.removeprefix("unix://")),
                                       [] if named else [self.fd]),
        ), timeout=10)
        self.session = None
        if session:
            self.session = self.stub.Session(pb.SessionRequest(client_id=self.reg.client_id))
            next(self.session)  # the first event confirms; the stream then stays open

    @property
    def client_id(self) -> str:
        return self.reg.client_id

    def alloc(self, n: int) -> np.ndarray:
        resp = self.stub.Alloc(pb.AllocRequest(client_id=self.client_id, num_tokens=n), timeout=10)
        return np.array(resp.host_indices, dtype=np.int64)

    def free(self, host: np.ndarray) -> int:
        return self.stub.Free(pb.FreeRequest(client_id=self.client_id, host_indices=host.tolist()),
                              timeout=10).freed_tokens

    def write(self, host: np.ndarray, dev: np.ndarray) -> int:
        return self.stub.Write(pb.WriteRequest(client_id=self.client_id, host_indices=host.tolist(),
                                               device_indices=dev.tolist()), timeout=10).bytes

    def load_stream(self, host: np.ndarray, dev: np.ndarray):
        return self.stub.Load(pb.LoadRequest(client_id=self.client_id, host_indices=host.tolist(),
                                             device_indices=dev.tolist()), timeout=30)

    def load(self, host: np.ndarray, dev: np.ndarray) -> None:
        for _ in self.load_stream(host, dev):
            pass

    def fill(self, dev: np.ndarray, rng: np.random.Generator) -> None:
        self.kv[:, :, dev] = rng.integers(0, 256, self.kv[:, :, dev].shape, dtype=np.uint8)

    def digest(self, dev: np.ndarray) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.kv[:, :, dev]).tobytes()).hexdigest()

    def close(self) -> None:
        if self.session is not None:
            self.session.cancel()
        try:
            self.stub.Unregister(pb.UnregisterRequest(client_id=self.client_id), timeout=10)
        finally:
            self.drop()

    def drop(self) -> None:
        """Goes away without unregistering: channel closed, pool unmapped and closed (unlinked)."""
        self.channel.close()
        del self.kv  # a numpy view pins the mapping: it must go before the mapping does
        self.shm.close()
        if self.fd >= 0:
            os.close(self.fd)
        if self.named:
            unlink_shm(self.name)


def killed_mid_load(address: str, name: str, ready) -> None:
    """Registers a large pool, writes it, starts a load, says so after the first layer lands,
    then waits to be killed."""
    eng = LightEngine(address, name, layers=32, num_tokens=4096, heads=4, head_dim=64,
                      host_tokens=4096)
    host = eng.alloc(4096)
    dev = np.arange(4096, dtype=np.int64)
    eng.write(host, dev)
    stream = eng.load_stream(host, dev)
    next(stream)
    ready.send(b"loading")
    for _ in stream:
        pass
    time.sleep(60)


def registered_without_session(address: str, name: str, ready) -> None:
    """Registers (no Session: killed between its Register and its Session), says so, waits to be
    killed."""
    eng = LightEngine(address, name, session=False)
    ready.send(eng.client_id.encode())
    time.sleep(60)
