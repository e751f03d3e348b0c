"""One client on an in-process daemon that has stored known bytes, and the check around a request
that must be refused: it changes nothing. Shared by the bad-input tests (raw gRPC and grpcurl).

The client holds global layers [4, 8) of an 8-layer model (MHA 2 heads x 8 dims, bf16), a
256-token pool, and 8 host pages of 16 tokens, of which pages 0..3 hold device slots [0, 64).
"Nothing changed" means: Stats (daemon-wide and the client's own) is identical, the device pool's
bytes are the same, the client's host region (read white-box from the in-process arena) is the
same, and the stored pages, loaded back into a zeroed scratch range of the pool, still hash to
what was written. The client's pool is a memfd (kvclient's default); ``named_shm_daemon`` is the
daemon the bad-input tests use, which also takes named /dev/shm pools, so their cases run too.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from checks import error_of, pool_sha, sha_of

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient._transport.fd_socket import get_ticket
from kvserver.core.epochs import EPOCH_SHIFT
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

START, END, NUM_LAYERS = 4, 8, 8
POOL_TOKENS = 256
PAGE = 16
HOST_TOKENS = 128  # 8 pages
STORED_PAGES = [0, 1, 2, 3]  # written at setup from device slots [0, 64)
OTHER = 64  # device slots [64, 128) hold data unlike anything stored: bad writes/loads use them
SCRATCH = slice(192, 256)  # zero except while stored pages are loaded back to be checked
TIMEOUT = 10.0


def named_shm_daemon(socket_dir: str):
    """An in-process daemon as conftest's, that also takes named shm pools (--allow-named-shm)."""
    from conftest import DaemonThread

    from kvserver.config import ServerConfig

    return DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=512 << 20,
                                     allow_named_shm=True))


def ticket_for(daemon, pool: ShmKVPool) -> str:
    """A fresh peer ticket for ``pool``'s descriptors (none for a named pool) from ``daemon``."""
    return get_ticket(daemon.config.socket + ".fd", pool.fds)


def tokens(*pages: int) -> list[int]:
    """Host token slots of whole pages, as Alloc returns them (less the epoch)."""
    return [p * PAGE + i for p in pages for i in range(PAGE)]


def slots(start: int, n: int = PAGE) -> list[int]:
    return list(range(start, start + n))


@dataclass(frozen=True)
class Snapshot:
    stats_all: pb.StatsResponse
    stats_client: pb.StatsResponse
    device_sha: str
    region_sha: str


class StoredEnv:
    """The daemon (a conftest DaemonThread), its one storing client, a raw stub, and the checks."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        g = torch.Generator().manual_seed(0)
        self.pool = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=END - START,
                              num_tokens=POOL_TOKENS)
        for layer in self.pool.buffers:
            for part in layer:
                part.copy_(torch.randn(part.shape, generator=g))
                part[SCRATCH].zero_()
        self.client = KVClient(daemon.address, timeout=TIMEOUT, resilient=False)
        self.channel = grpc.insecure_channel(daemon.address)
        self.stub = pb_grpc.KVServerStub(self.channel)
        self.reg = self.client.register(
            model="m", pool=self.pool, start_layer=START, end_layer=END, num_layers=NUM_LAYERS,
            host_tokens=HOST_TOKENS, page_size=PAGE,
        )
        assert self.reg.host_tokens == HOST_TOKENS
        self.cid, self.epoch = self.reg.client_id, self.reg.epoch
        self.host = self.client.alloc(len(STORED_PAGES) * PAGE).tolist()
        assert self.host == self.tag(tokens(*STORED_PAGES))
        self.client.write(host_indices=self.host, device_indices=slots(0, len(self.host)))
        # What the host now holds: the source rows, hashed right after the write.
        self.stored_sha = sha_of([p[: len(self.host)] for layer in self.pool.buffers for p in layer])
        deadline = time.monotonic() + TIMEOUT  # Stats count sessions: let the client's open first
        while self.stub.Stats(pb.StatsRequest(client_id=self.cid), timeout=TIMEOUT).clients[0].sessions != 1:
            assert time.monotonic() < deadline, "the client's session never opened"
            time.sleep(0.01)
        assert self.loaded_back_sha() == self.stored_sha  # the check itself works

    def close(self) -> None:
        self.channel.close()
        try:
            self.client.unregister()
        finally:
            self.client.close()
            self.pool.close()

    def tag(self, host_slots: list[int], epoch: int | None = None) -> list[int]:
        """Host slots as host indices of this registration (or of ``epoch``), as Alloc returns them."""
        e = self.epoch if epoch is None else epoch
        return [(e << EPOCH_SHIFT) | s for s in host_slots]

    # -- observations ---------------------------------------------------------------------------

    def region_sha(self) -> str:
        def read() -> str:
            core = self.daemon.core
            c = core.clients[self.cid]
            view = core.arena.view(np.uint8)[c.region_offset : c.region_offset + c.region_bytes]
            return hashlib.sha256(view.tobytes()).hexdigest()

        return self.daemon.run(read)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            stats_all=self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT),
            stats_client=self.stub.Stats(pb.StatsRequest(client_id=self.cid), timeout=TIMEOUT),
            device_sha=pool_sha(self.pool),
            region_sha=self.region_sha(),
        )

    def loaded_back_sha(self) -> str:
        """Loads the stored pages into the zeroed scratch slots, hashes them, zeroes them again."""
        scratch = [p[SCRATCH] for layer in self.pool.buffers for p in layer]
        assert all(not t.any() for t in scratch), "scratch slots were not zero"
        req = pb.LoadRequest(client_id=self.cid, host_indices=self.host,
                             device_indices=list(range(SCRATCH.start, SCRATCH.stop)))
        steps = list(self.stub.Load(req, timeout=TIMEOUT))
        assert steps and steps[-1].done
        sha = sha_of(scratch)
        for t in scratch:
            t.zero_()
        return sha

    def assert_unchanged(self, before: Snapshot) -> None:
        after = self.snapshot()
        assert after.stats_all == before.stats_all, "daemon-wide Stats changed"
        assert after.stats_client == before.stats_client, "the client's Stats changed"
        assert after.device_sha == before.device_sha, "the device pool changed"
        assert after.region_sha == before.region_sha, "the client's host region changed"
        assert self.loaded_back_sha() == self.stored_sha, "the stored host pages changed"

    def reject(self, code: grpc.StatusCode, text: str, call: Callable[[], object]) -> str:
        """Runs a bad request; checks its status and message, and that nothing changed."""
        before = self.snapshot()
        got_code, message = error_of(call)
        assert got_code == code, f"{got_code.name}: {message}"
        assert text in message, message
        self.assert_unchanged(before)
        return message
