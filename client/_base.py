"""What the sync and asyncio clients share: settings, registration state and the miss policy."""

from __future__ import annotations

import logging
import os

import grpc

from kvclient import _messages as msg
from kvclient._channel import target
from kvclient._resilience import confirm_grace, is_miss, job_unconfirmed, needs_register
from kvclient.cuda_events import LayerEvents
from kvclient.errors import KVClientError
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger("kvclient")


class ClientBase:
    def __init__(self, address: str | None, timeout: float, token: str | None, resilient: bool) -> None:
        self.target = target(address)
        self.timeout = timeout
        self.resilient = resilient
        token = token or os.environ.get("KVSERVER_TOKEN")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._request: pb.RegisterRequest | None = None
        self.registration: msg.Registration | None = None
        self.connected = False
        self.misses = 0
        self.reconnects = 0
        self._events: LayerEvents | None = None
        self._device = 0  # CUDA pools: the device the layer events are opened on
        self._pool = None  # the registered pool

    @property
    def client_id(self) -> str:
        if self.registration is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "register() first")
        return self.registration.client_id

    def _is_miss(self, error: KVClientError, reg: msg.Registration | None) -> bool:
        """In resilient mode, counts ``error`` as a miss if it means "not there" (and starts
        re-registering when the registration is gone); False means it must be raised."""
        if not self.resilient or not is_miss(error.code):
            return False
        self.misses += 1
        if needs_register(error.code):
            self._lost(reg, error.message)
        return True

    def _lost(self, reg: msg.Registration | None, reason: str) -> None:
        raise NotImplementedError

    def _job_unconfirmed(self, error: KVClientError) -> bool:
        """A Write or Load failed without the daemon confirming that its job is dead."""
        return job_unconfirmed(error.code, error.job_ended)

    @property
    def _job_deadline(self) -> float:
        """The gRPC deadline of a Write or Load: later than the job deadline the daemon is told
        (``timeout``), so that its answer, not the client's clock, ends the call."""
        return self.timeout + confirm_grace(self.timeout)

    @property
    def _timeout_ms(self) -> int:
        return max(1, int(self.timeout * 1000))

    def _disconnected(self, on_miss):
        """A call while the registration is lost: a miss, or (not resilient) an error."""
        if not self.resilient:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE,
                                "the registration was lost (daemon unreachable, restarted or reclaimed it)")
        self.misses += 1
        return on_miss

    def _retry_request(self, reg: msg.Registration | None) -> pb.RegisterRequest:
        """The registration request again, naming the registration it replaces: a daemon that
        still holds that one (a slow call, not a restart) releases it first."""
        req = pb.RegisterRequest()
        req.CopyFrom(self._request)
        if reg is not None:
            req.replaces_client_id = reg.client_id
        return req

    @staticmethod
    def _log_grant(reg: msg.Registration, req: pb.RegisterRequest) -> None:
        logger.info("registered with kvserver: %d host tokens granted of %d asked (%d bytes each), "
                    "layers [%d, %d)", reg.host_tokens, req.host_tokens, reg.host_bytes_per_token,
                    reg.start_layer, reg.end_layer)

    def _remember_pool(self, pool, reg: msg.Registration) -> None:
        """The registered pool; for CUDA pools, the device its layer events are opened on."""
        self._pool = pool
        if reg.layer_events:
            self._device = pool.buffers[0][0].device

    def _unregistered(self, copies_pending: bool = False) -> None:
        """The daemon confirmed the registration is gone, mappings closed: a CUDA pool may let
        torch reuse its memory once the engine frees it. Not while the daemon says copies of it
        may still run on the GPU (quarantined): torch must not hand that memory to anything else."""
        pool, self._pool = self._pool, None
        if copies_pending:
            logger.warning("kvserver still holds GPU copies of this pool (quarantined): its memory "
                           "stays exported, so torch will not reuse it")
            return
        release = getattr(pool, "release_exports", None)
        if release is not None:
            release()

    def _layer_events(self, reg: msg.Registration) -> LayerEvents:
        if self._events is None or self._events.handles is not reg.layer_events:
            self._events = LayerEvents(reg.layer_events, reg.end_layer - reg.start_layer, self._device)
        return self._events
