"""Daemon configuration: one frozen object built at the edge from flags and KVSERVER_* variables."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


DEFAULT_MAX_REQUEST_INDICES = 1 << 20  # most indices (or keys) in one request
# The most an operator may set: gRPC then takes requests of up to 61 MiB (kvserver.api.message_size),
# each read on the event loop. kvclient's channel sends and receives at most 64 MiB: a Write of
# more indices would not leave the engine, an Alloc's answer of more (9 bytes an index) not reach it.
MOST_REQUEST_INDICES = 1 << 22

_SHARE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")


def parse_size(text: str) -> int:
    """'8GiB', '512MiB', '4G', '1048576' -> bytes (binary units)."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"cannot read size {text!r}; write it like 8GiB, 512MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def machine_memory() -> int:
    """The machine's memory in bytes: MemTotal of /proc/meminfo (a container's cgroup limit is not
    looked at), else the physical page count."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def format_size(n: int) -> str:
    """Bytes for people: '23.4 GiB', '1000.0 TiB', '512 bytes'."""
    for name, unit in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} bytes"


def _size_or_share(text: str, whole, of: str) -> int:
    """A size (see ``parse_size``), or a share of ``whole()`` bytes, '60%' -> bytes."""
    m = _SHARE.fullmatch(text)
    if not m:
        return parse_size(text)
    share = float(m.group(1))
    if not 0 < share <= 100:
        raise ValueError(f"a share of {of} is above 0% and at most 100%, not {text!r}")
    return int(whole() * share / 100)


def parse_host_memory(text: str) -> int:
    """A size (see ``parse_size``) or a share of the machine's memory, '60%' -> bytes."""
    return _size_or_share(text, machine_memory, "the machine's memory")


def parse_disk_size(text: str, path: str) -> int:
    """A size (see ``parse_size``) or a share of the size of the file system holding ``path``
    (its nearest existing directory), '25%' -> bytes."""

    def file_system() -> int:
        where = os.path.abspath(path)
        while not os.path.isdir(where):
            where = os.path.dirname(where)
        st = os.statvfs(where)
        return st.f_blocks * st.f_frsize

    return _size_or_share(text, file_system, "the disk")


def parse_cluster_segment(text: str, host_memory: int) -> int:
    """A size (see ``parse_size``) or a share of host memory, '25%' -> bytes."""
    return _size_or_share(text, lambda: host_memory, "host memory")


# The most threads a thread-count flag may ask for: torch's count is a C int, and each copy or
# disk thread is a real one started at the daemon's start.
MAX_THREADS = 1024
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[\w.-]*):(\d{1,5})")


def parse_metrics_listen(text: str) -> tuple[str, int]:
    """'127.0.0.1:9400', '[::1]:9400', '0.0.0.0:9400' -> (host, port); port 0 picks one. The host
    is never implied: every interface has to be asked for by name."""
    m = _ADDRESS.fullmatch(text)
    if not m or int(m.group(2)) > 65535:
        raise ValueError(f"metrics address {text!r} is not HOST:PORT (e.g. 127.0.0.1:9400 or [::1]:9400)")
    host = m.group(1).strip("[]")
    if not host:
        raise ValueError(f"metrics address {text!r} names no host: write 127.0.0.1:PORT, or 0.0.0.0:PORT "
                         "for every IPv4 interface")
    return host, int(m.group(2))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: str | None = None  # Unix socket path; None with no TCP address means default_socket()
    listen: str | None = None  # optional TCP address, host:port
    host_memory: int = 4 << 30
    host_memory_dir: str | None = None  # keep the host cache in files here (tmpfs): it outlives the daemon
    disk_cache: str | None = None  # directory of the disk tier (pages evicted from host memory); None: none
    disk_size: int = 0  # bytes of it
    disk_size_share: bool = False  # disk_size came from a share of the file system (see DiskTier)
    disk_threads: int = 8  # its I/O threads, as many for reads: checks run while others wait on I/O
    cluster_master: str | None = None  # HOST:PORT of a Mooncake Store master; None: no cluster tier
    cluster_metadata: str = "P2PHANDSHAKE"  # or the master's http://HOST:PORT/metadata
    cluster_host: str | None = None  # this node's address for peers; None: the route to the master's
    cluster_segment: int = 0  # bytes this node contributes to the cluster
    cluster_protocol: str = "tcp"
    cluster_timeout: float = 1.0  # seconds a Lookup or Get waits for the cluster
    kv_events_endpoint: str | None = None  # ZMQ PUB address of the daemon's KV events; None: off
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER address for replays
    kv_events_int_hashes: bool = True  # block hashes as vLLM's default: 64-bit integers of the keys
    copy_threads: int = 2  # copy workers: loads first, a large job's pieces on all (kvserver.copies.workers)
    torch_threads: int = 0  # 0 leaves torch's default
    shutdown_grace: float = 5.0
    progress_interval: float = 0.001  # seconds between load progress messages (the last always goes)
    plane_spin: float = 50e-6  # seconds the data plane's thread looks for the next request before it sleeps
    lease: float = 30.0  # seconds a client without a Session survives after its last call
    reclaim_grace: float = 1.0  # seconds after a Session ends before the client is reclaimed
    max_clients: int = 1024
    max_clients_per_tenant: int = 256  # registrations one tenant holds at once
    max_request_indices: int = DEFAULT_MAX_REQUEST_INDICES
    max_pages_per_client: int = 1 << 24  # x page_size (at most 4096) fits below the epoch bits
    token: str | None = None  # required as "authorization: Bearer <token>" metadata when set
    admin_token: str | None = None  # as "x-kvserver-admin: <token>" metadata: Stats lists every client
    insecure_tcp: bool = False  # allow --listen without a token
    socket_group_access: bool = False  # socket mode 0660 instead of 0600
    shared_socket_dir: bool = False  # listen where others may write the socket's directory (warned)
    allow_named_shm: bool = False  # accept named /dev/shm pools (owned by the caller) besides memfds
    # gRPC's cap on one request; None: the largest a valid request needs (kvserver.api.message_size)
    max_message_bytes: int | None = None
    cuda_wait_seconds: float = 20.0  # GPU work of a client making no progress this long fails it
    tenant_quota: str = "100%"  # cached bytes one tenant may hold: a size or a share of host_memory
    # host memory one tenant's registrations' regions may take together: a size or a share of host_memory
    tenant_region_quota: str = "100%"
    tenant_tokens: str | None = None  # file of 'name token [quota]' lines (kvserver.peers.tenants)
    metrics_listen: str | None = None  # HOST:PORT of a Prometheus /metrics endpoint; None: off
    metrics_per_space: bool = False  # also tenants', models' and spaces' series (names every tenant)

    def __post_init__(self) -> None:
        if self.host_memory < 2 << 20:
            raise ValueError("host memory must be at least 2MiB")
        if not 1 <= self.copy_threads <= MAX_THREADS:
            raise ValueError(f"copy threads must be between 1 and {MAX_THREADS}")
        if not 0 <= self.torch_threads <= MAX_THREADS:
            raise ValueError(f"torch threads must be between 0 (torch's default) and {MAX_THREADS}")
        if self.disk_cache is not None and self.disk_size < 2 << 20:
            raise ValueError("the disk cache must be at least 2MiB (--disk-size)")
        if (self.disk_cache is not None and self.host_memory_dir is not None
                and os.path.abspath(self.disk_cache) == os.path.abspath(self.host_memory_dir)):
            raise ValueError("--disk-cache and --host-memory-dir must be two directories")
        if not 1 <= self.disk_threads <= MAX_THREADS:
            raise ValueError(f"disk threads must be between 1 and {MAX_THREADS}")
        if self.cluster_master is not None:
            m = _ADDRESS.fullmatch(self.cluster_master)
            if not m or not m.group(1) or not 0 < int(m.group(2)) <= 65535:
                raise ValueError(f"--cluster-master {self.cluster_master!r} is not HOST:PORT")
            if self.cluster_segment < 1 << 20:
                raise ValueError("the cluster segment must be at least 1MiB (--cluster-segment)")
            if not 0 < self.cluster_timeout <= 60:
                raise ValueError("the cluster timeout must be in (0, 60000] ms")
            if self.cluster_protocol == "rdma":
                raise ValueError("--cluster-protocol rdma is not supported yet: RDMA registration would pin "
                                 "the whole host arena, and the arena gives freed pages back to the kernel, "
                                 "which a registered range must not do (docs/design.md); use tcp")
            if self.cluster_protocol != "tcp":
                raise ValueError("--cluster-protocol is tcp")
            if not (self.cluster_metadata == "P2PHANDSHAKE" or self.cluster_metadata.startswith("http://")
                    or self.cluster_metadata.startswith("etcd://")):
                raise ValueError("--cluster-metadata is P2PHANDSHAKE, http://HOST:PORT/metadata or etcd://...")
        for name, ep in (("--kv-events-endpoint", self.kv_events_endpoint),
                         ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint)):
            if ep is not None and not re.fullmatch(r"(tcp://[^\s]+:\d+|ipc://[^\s]+|inproc://[^\s]+)", ep):
                raise ValueError(f"{name} {ep!r} is not a ZMQ address (tcp://*:5557, tcp://HOST:PORT, "
                                 "ipc://PATH)")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        # A NaN time compares False with everything, so it passes a plain `< 0` check and never
        # elapses (a NaN grace never reclaims a dead engine); an infinite one never elapses either.
        if not (math.isfinite(self.shutdown_grace) and self.shutdown_grace >= 0):
            raise ValueError("shutdown grace must not be negative, NaN or infinite")
        if not 0 <= self.progress_interval <= 1:
            raise ValueError("progress interval must be between 0 and 1000 ms")
        if not 0 <= self.plane_spin <= 0.01:
            raise ValueError("plane spin must be between 0 and 10000 µs")
        if self.listen is not None:
            m = re.fullmatch(r"\[?[\w.:-]*\]?:(\d{1,5})", self.listen)
            if not m or int(m.group(1)) > 65535:  # grpc would bind a larger port modulo 65536
                raise ValueError(f"listen address {self.listen!r} is not host:port (a port 0..65535)")
        if self.listen is not None and not self.token and not self.insecure_tcp:
            raise ValueError(
                "listening on TCP needs a token (--token-file or KVSERVER_TOKEN); "
                "--insecure-tcp runs without one"
            )
        if not (math.isfinite(self.lease) and self.lease > 0):
            raise ValueError("lease must be positive and finite")
        if not (math.isfinite(self.reclaim_grace) and self.reclaim_grace >= 0):
            raise ValueError("reclaim grace must not be negative, NaN or infinite")
        if min(self.max_clients, self.max_clients_per_tenant, self.max_request_indices,
               self.max_pages_per_client) < 1:
            raise ValueError("client, request and page limits must be at least 1")
        if self.max_request_indices > MOST_REQUEST_INDICES:
            raise ValueError(f"max request indices must be at most {MOST_REQUEST_INDICES}: a request of "
                             "more is past what a client's channel sends (64 MiB)")
        if self.admin_token is not None and self.admin_token == self.token:
            raise ValueError("the admin token must differ from the client token")
        if not 0 < self.cuda_wait_seconds <= 3600:
            raise ValueError("CUDA wait seconds must be in (0, 3600]")
        if self.metrics_listen is not None:
            parse_metrics_listen(self.metrics_listen)


    @property
    def socket_mode(self) -> int:
        return 0o660 if self.socket_group_access else 0o600

    @property
    def addresses(self) -> list[str]:
        out = []
        if self.socket:
            out.append(f"unix://{os.path.abspath(self.socket)}")
        if self.listen:
            out.append(self.listen)
        return out
