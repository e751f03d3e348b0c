"""Server bootstrap: build the aio server with health and reflection, run it, shut it down."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserver.config import ServerConfig
from kvserver.core import KVCore
from kvserver.servicer import KVServicer
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVServer"].full_name


class Daemon:
    """A running daemon: the aio server, its health service and the core it serves."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.core = KVCore(config.host_memory, config.copy_threads)
        self.health = health.aio.HealthServicer()
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=opts)
        pb_grpc.add_KVServerServicer_to_server(KVServicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.ports: list[int] = []

    async def start(self) -> None:
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        for address in self.config.addresses:
            if address.startswith("unix://"):
                os.makedirs(os.path.dirname(address[len("unix://") :]), mode=0o700, exist_ok=True)
            self.ports.append(self.server.add_insecure_port(address))
        await self.server.start()
        for address in self.config.addresses:
            if address.startswith("unix://"):
                # Only the daemon's user may connect; grpc creates the socket under the umask.
                os.chmod(address[len("unix://") :], 0o600)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "kvserver listening on %s with %d bytes of host memory",
            ", ".join(self.config.addresses), self.core.arena.capacity,
        )

    async def stop(self) -> None:
        """Health goes NOT_SERVING, in-flight calls get the grace period, then memory is freed."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.shutdown_grace)
        await self.core.close()
        logger.info("kvserver stopped")


async def serve(config: ServerConfig) -> None:
    daemon = Daemon(config)
    await daemon.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received, shutting down")
    await daemon.stop()
