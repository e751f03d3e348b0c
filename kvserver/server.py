"""Server bootstrap: build the aio server with health and reflection, run it, shut it down."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserver.api.auth import TokenAuth
from kvserver.api.message_size import SEND_BYTES, request_message_bytes
from kvserver.api.metrics import Metrics
from kvserver.api.servicer import KVServicer, add_to_server
from kvserver.cluster import MooncakeClient, local_address
from kvserver.config import ServerConfig
from kvserver.copies import transfer
from kvserver.core.cache_ops import expire_leases
from kvserver.core.kvcore import KVCore
from kvserver.core.liveness import Reaper
from kvserver.events.publisher import ZmqPublisher
from kvserver.host.heap import keep_freed_heap
from kvserver.media.cuda.waits import set_wait_seconds
from kvserver.peers.fd_socket import PeerSocket
from kvserver.peers.tenants import TenantBook, parse_quota
from kvserver.peers.tickets import TicketBook, raise_fd_limit
from kvserver.protocol.fd_socket import fd_socket_path
from kvserver.protocol.paths import foreign_path
from kvserver.v1 import kvserver_pb2 as pb

logger = logging.getLogger(__name__)

# The daemon's worker threads run Python (a Register's per-layer views and checks, a Put's settle
# steps, a large request's parse): each time the event loop wakes while one runs, it waits for the
# GIL until the worker's switch interval ends, and a call to the daemon takes several wake-ups.
# Python's default, 5 ms, made a 4096-layer Register hold another engine's Stats 28-40 ms; 1 ms,
# 10-17 ms (docs/performance.md, "A Register of many layers, and the GIL's turns").
SWITCH_INTERVAL_S = 0.001


class _SwitchInterval:
    """The process's switch interval (the loop's and its workers' alike) at SWITCH_INTERVAL_S while
    any daemon of the process runs; as it was once none does (a process of other work: tests)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # daemons of one process may run on loops of their own
        self.daemons = 0
        self.before = sys.getswitchinterval()

    def take(self) -> None:
        with self.lock:
            if self.daemons == 0:
                self.before = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            self.daemons += 1

    def give(self) -> None:
        with self.lock:
            self.daemons -= 1
            if self.daemons == 0:
                sys.setswitchinterval(self.before)


_SWITCH = _SwitchInterval()
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVServer"].full_name


def cluster_client(config: ServerConfig) -> MooncakeClient | None:
    """The cluster store's client the configuration asks for (not joined yet), or None."""
    if not config.cluster_master:
        return None
    host = config.cluster_host or local_address(config.cluster_master)
    return MooncakeClient(config.cluster_master, config.cluster_metadata, host, config.cluster_segment,
                          config.cluster_protocol)


class ListenError(RuntimeError):
    """An address the daemon was told to listen on cannot be used."""


def _check_unix_socket_free(path: str) -> None:
    """grpc unlinks whatever sits at a Unix socket path before binding, so a second daemon would
    silently take the socket of a live one. Refuse if something accepts connections there; a dead
    file left by a crash (connection refused) is fine to replace."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                return
            # (an OSError of the socket module, such as a path too long, has no strerror)
            raise ListenError(f"cannot use socket {path}: {exc.strerror or exc}") from None
    raise ListenError(f"another process is already listening on {path}")


class Daemon:
    """A running daemon: the aio server, its health service and the core it serves."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._switch_taken = False  # holds the process's switch interval at SWITCH_INTERVAL_S
        self._core_started = False  # its tiers started (a failed start closes it again)
        raise_fd_limit()  # mappings, sockets and peers' descriptors: take what the system allows
        set_wait_seconds(config.cuda_wait_seconds)  # for the CUDA pools this daemon opens
        capacity = config.host_memory
        tokens = config.tenant_tokens
        self.tenants = TenantBook.load(tokens, capacity) if tokens else TenantBook()
        # The daemon's own KV event publisher (--kv-events-endpoint): every space, every tier.
        self.kv_events: ZmqPublisher | None = None
        if config.kv_events_endpoint:
            try:
                self.kv_events = ZmqPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                              config.kv_events_int_hashes)
            except Exception as exc:  # a taken port: the daemon does not start with half its setup
                raise ListenError(f"cannot publish KV events on {config.kv_events_endpoint}: {exc}") from None
            logger.info("KV events on %s, replays on %s", self.kv_events.endpoint,
                        self.kv_events.replay_endpoint or "none")
        self.core = KVCore(
            config.host_memory,
            config.copy_threads,
            config.progress_interval,
            max_clients=config.max_clients,
            max_clients_per_tenant=config.max_clients_per_tenant,
            max_request_indices=config.max_request_indices,
            max_pages_per_client=config.max_pages_per_client,
            allow_named_shm=config.allow_named_shm,
            tenant_quota=parse_quota(config.tenant_quota, capacity),
            tenant_quotas=self.tenants.quotas,
            # The whole budget is no quota: what no region of the daemon's could pass.
            tenant_region_quota=region_quota if (region_quota := parse_quota(config.tenant_region_quota,
                                                                             capacity)) < capacity else 0,
            host_memory_dir=config.host_memory_dir,
            disk_cache=config.disk_cache,
            disk_size=config.disk_size,
            disk_size_share=config.disk_size_share,
            disk_threads=config.disk_threads,
            cluster=cluster_client(config),
            cluster_timeout=config.cluster_timeout,
            event_publisher=self.kv_events,
        )
        self._stop_leases = asyncio.Event()
        self._leases: asyncio.Task | None = None
        self._lag: asyncio.Task | None = None  # observes the event loop's lateness (metrics)
        # Shared-memory pools' descriptors come over the fd socket beside the Unix gRPC socket.
        self.peer_socket: PeerSocket | None = None
        if config.socket:
            self.peer_socket = PeerSocket(fd_socket_path(os.path.abspath(config.socket)),
                                          config.socket_mode, TicketBook())
            self.core.tickets = self.peer_socket.tickets
        self.reaper = Reaper(self.core, config.lease, config.reclaim_grace)
        self.health = health.aio.HealthServicer()
        receive = config.max_message_bytes or request_message_bytes(config.max_request_indices)
        opts = [
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", max(receive, SEND_BYTES)),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [TokenAuth(config.token)] if config.token else []
        self.server = grpc.aio.server(options=opts, interceptors=interceptors)
        # Its registry is this daemon's own; served over HTTP only with --metrics-listen.
        self.metrics = Metrics(self.core, per_space=config.metrics_per_space)
        self.servicer = KVServicer(self.core, self.reaper, config.admin_token, self.tenants, self.metrics,
                                   plane_spin=config.plane_spin)
        add_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.ports: list[int] = []

    def _make_socket_dir(self, path: str) -> None:
        """The socket's directory, made if missing (0700, or 0750 with --socket-group-access: the
        group must be let in too); refused if another user controls it or any directory above it,
        before and after it is made (that user could swap the sockets in it)."""
        directory = os.path.dirname(path)
        try:
            for _ in range(2):
                why = foreign_path(directory)
                if why is not None and not self.config.shared_socket_dir:
                    raise ListenError(f"cannot use socket {path}: {why} (--shared-socket-dir listens there "
                                      "all the same)")
                if why is not None:
                    logger.warning("listening on %s, where %s (--shared-socket-dir): whoever may write "
                                   "there can put its own sockets in the daemon's place", path, why)
                if os.path.isdir(directory):
                    return
                mode = 0o750 if self.config.socket_group_access else 0o700
                os.makedirs(directory, mode=mode, exist_ok=True)
                os.chmod(directory, mode)  # (makedirs's mode is masked by the umask)
        except OSError as exc:  # a file on the way, a directory that cannot be made there
            # (makedirs says EEXIST where a file has the directory's name)
            reason = "not a directory" if exc.errno == errno.EEXIST else exc.strerror or str(exc)
            raise ListenError(f"cannot use socket {path}: its directory {directory}: {reason}") from None

    async def start(self) -> None:
        _SWITCH.take()
        self._switch_taken = True
        try:
            await self._start()
        except BaseException:
            self._switch_taken = False
            _SWITCH.give()
            if self._core_started:  # (its tiers' tasks and threads: nothing of a failed start runs on)
                with contextlib.suppress(Exception):
                    await self.core.close(0.0)
            raise

    async def _start(self) -> None:
        torch = sys.modules.get("torch")
        if self.config.torch_threads and transfer.copy_rows is None and torch is not None:
            torch.set_num_threads(self.config.torch_threads)  # its threads copy, without the kernel
        # What runs beside the calls first, before anyone can call: the disk tier's start names
        # every page of a kept host cache it holds no copy of (a sort of millions of pages).
        self.core.start()
        self._core_started = True
        bound = []
        for address in self.config.addresses:
            if address.startswith("unix://"):
                path = address[len("unix://") :]
                self._make_socket_dir(path)
                _check_unix_socket_free(path)
        # The socket is created at bind under the umask: make it owner-only from the first moment.
        old_umask = os.umask(0o177)
        try:
            # The fd socket first: whoever finds the gRPC socket can register at once.
            if self.peer_socket is not None:
                try:
                    self.peer_socket.start()
                except OSError as exc:  # its path too long, something other than a socket there
                    raise ListenError(f"cannot use the fd socket {self.peer_socket.path}: "
                                      f"{exc.strerror or exc}") from None
                logger.info("shared-memory pools' descriptors on %s", self.peer_socket.path)
            for address in self.config.addresses:
                try:
                    port = self.server.add_insecure_port(address)
                except RuntimeError:
                    if self.peer_socket is not None:
                        await self.peer_socket.stop()
                    raise ListenError(
                        f"cannot listen on {address} (in use, or not a local address)"
                    ) from None
                self.ports.append(port)
                # Name the port the kernel picked for host:0, so a caller can find it in the log.
                unix = address.startswith("unix://")
                bound.append(address if unix else f"{address.rsplit(':', 1)[0]}:{port}")
            await self.server.start()
        finally:
            os.umask(old_umask)
        for address in self.config.addresses:
            if address.startswith("unix://"):
                os.chmod(address[len("unix://") :], self.config.socket_mode)
        if self.config.listen and not self.config.token:
            logger.warning("listening on TCP %s without a token (--insecure-tcp)", self.config.listen)
        if self.config.metrics_listen:
            try:
                url = self.metrics.serve(self.config.metrics_listen)
            except OSError as exc:
                await self.server.stop(0)
                if self.peer_socket is not None:
                    await self.peer_socket.stop()
                raise ListenError(
                    f"cannot serve metrics on {self.config.metrics_listen}: {exc.strerror or exc}"
                ) from None
            detail = " (per tenant, model and space)" if self.config.metrics_per_space else ""
            logger.info("metrics on %s%s", url, detail)
            host = self.metrics.host or ""
            if not (host.startswith("127.") or host in ("::1", "localhost")):
                logger.warning("metrics on %s are served to anyone who can reach %s: no token guards them",
                               url, host)
        self.reaper.start()
        self._leases = asyncio.ensure_future(expire_leases(self.core.cache, self._stop_leases,
                                                           share=self.core.share))
        self._lag = asyncio.ensure_future(self.metrics.watch_loop())
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "kvserver listening on %s with %d bytes of host memory",
            ", ".join(bound), self.core.arena.capacity,
        )

    async def stop(self) -> None:
        """Health goes NOT_SERVING, sessions end, in-flight calls get the grace period, then
        memory is freed."""
        await self.health.enter_graceful_shutdown()
        await self.reaper.stop()
        await self.metrics.stop()
        if self._lag is not None:
            self._lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag
        self._stop_leases.set()
        if self._leases is not None:
            await self._leases
        self.servicer.stopping.set()
        # In-flight calls on both lanes get the grace period; then nothing new is taken.
        await asyncio.gather(self.server.stop(self.config.shutdown_grace),
                             self.servicer.lanes.drain(self.config.shutdown_grace))
        if self.peer_socket is not None:
            await self.peer_socket.stop()
        await self.core.close(self.config.shutdown_grace)
        if self.servicer.plane is not None:  # every lane and gate is gone: its thread ends
            self.servicer.plane.stop()
        if self.kv_events is not None:  # what was recorded until now goes out first
            self.kv_events.close()
        if self._switch_taken:
            self._switch_taken = False
            _SWITCH.give()
        logger.info("kvserver stopped")


async def serve(config: ServerConfig) -> None:
    # What the imports made (grpc's and numpy's modules; torch's where the daemon will use it,
    # loaded here for that) lives as long as the daemon: kept out of the collector, a full collection
    # walks only what the daemon made, not the event loop's 60-75 ms, and the exit is not slowed by
    # collections over it either. Frozen before the start, so that the daemon's own objects (a kept
    # cache's spaces, a registration taken while it starts) are collected as ever once dropped.
    if transfer.torch_needed():
        transfer.load_torch()
    gc.freeze()
    keep_freed_heap()  # frees never give a burst of memory back at once, on the loop (host/heap.py)
    daemon = Daemon(config)
    await daemon.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received, shutting down")
    await daemon.stop()
    if daemon.core.left_running:
        # Mooncake calls still wait on a master that does not answer (threads its exit would join,
        # or abort on): the daemon's own state is closed, so the process ends here.
        end_process(0)


def end_process(code: int) -> NoReturn:
    """Ends the process at once, what it logged and printed written out first: the daemon's files,
    publisher and tiers are closed by then. The interpreter's own teardown (grpc's modules, its
    last collections) took 0.3-0.9 s more of every stop, which a restart waits for.
    One collection runs first, so that a task dropped with an exception still says so."""
    gc.collect()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
