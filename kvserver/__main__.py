"""``kvserver`` console script: flags (or KVSERVER_* variables) to ServerConfig, then serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvloop

from kvserver.cluster import check_installed
from kvserver.config import (
    DEFAULT_MAX_REQUEST_INDICES,
    ServerConfig,
    parse_cluster_segment,
    parse_disk_size,
    parse_host_memory,
)
from kvserver.events.publisher import check_events_installed
from kvserver.host.arena import HostMemoryError
from kvserver.peers.tenants import TenantBook, parse_quota
from kvserver.protocol.paths import default_socket
from kvserver.server import ListenError, end_process, serve


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"KVSERVER_{name}", default)


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}; use DEBUG, INFO, WARNING or ERROR")
    return level


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserver",
        description="Per-node KV-cache host memory daemon for LLM inference engines.",
        epilog="Every flag can also be set as an environment variable, e.g. KVSERVER_HOST_MEMORY.",
    )
    p.add_argument("--socket", default=_env("SOCKET"),
                   help=f"Unix socket path (default {default_socket()}; 'none' to disable)")
    p.add_argument("--listen", default=_env("LISTEN"), help="also listen on TCP host:port")
    p.add_argument("--host-memory", default=_env("HOST_MEMORY", "4GiB"),
                   help="host KV memory budget: a size (8GiB) or a share of the machine's memory "
                        "(60%%) (default 4GiB)")
    p.add_argument("--host-memory-dir", default=_env("HOST_MEMORY_DIR"),
                   help="keep the host cache in files in this directory, on tmpfs (e.g. "
                        "/dev/shm/kvserver), so that a restarted daemon finds it again, after a crash "
                        "too (default: the cache ends with the daemon)")
    p.add_argument("--disk-cache", default=_env("DISK_CACHE"),
                   help="a directory on a local disk for the disk tier: pages the host cache evicts "
                        "live on there and are read back on a hit, across restarts too (default: none)")
    p.add_argument("--disk-size", default=_env("DISK_SIZE", "10%"),
                   help="the disk tier's size: a size (100GiB) or a share of its file system (25%%) "
                        "(default 10%%)")
    p.add_argument("--disk-threads", type=int, default=_env("DISK_THREADS", "8"),
                   help="worker threads of the disk tier's reads and writes (default 8)")
    p.add_argument("--cluster-master", default=_env("CLUSTER_MASTER"),
                   help="HOST:PORT of a Mooncake Store master: join its cluster, storing pages there "
                        "and reading other nodes' pages on a local miss (default: no cluster; needs "
                        "the 'cluster' extra; Mooncake authenticates nothing: a private network only)")
    p.add_argument("--cluster-metadata", default=_env("CLUSTER_METADATA", "P2PHANDSHAKE"),
                   help="the cluster's metadata service: P2PHANDSHAKE (default) or the master's "
                        "http://HOST:PORT/metadata")
    p.add_argument("--cluster-host", default=_env("CLUSTER_HOST"),
                   help="this node's address as other nodes reach it (default: the local address "
                        "of the route to the master)")
    p.add_argument("--cluster-segment", default=_env("CLUSTER_SEGMENT", "25%"),
                   help="memory this node contributes to the cluster: a size or a share of "
                        "--host-memory (default 25%%)")
    p.add_argument("--cluster-protocol", default=_env("CLUSTER_PROTOCOL", "tcp"), choices=("tcp", "rdma"),
                   help="the transfer engine's protocol: tcp (default; rdma is refused for now, see "
                        "docs/design.md)")
    p.add_argument("--cluster-timeout-ms", type=float, default=_env("CLUSTER_TIMEOUT_MS", "1000"),
                   help="longest wait for the cluster in a Lookup or a Get: past it the pages are "
                        "misses (default 1000)")
    p.add_argument("--kv-events-endpoint", default=_env("KV_EVENTS_ENDPOINT"),
                   help="publish every space's KV events (stores and removals per tier) on this ZMQ PUB "
                        "address in vLLM's schema, one topic per space, e.g. tcp://*:5557 (default "
                        "off; needs the 'events' extra)")
    p.add_argument("--kv-events-replay-endpoint", default=_env("KV_EVENTS_REPLAY_ENDPOINT"),
                   help="a ZMQ ROUTER address where subscribers ask for missed batches, e.g. tcp://*:5558")
    p.add_argument("--kv-events-hashes", default=_env("KV_EVENTS_HASHES", "int"), choices=("int", "bytes"),
                   help="block hashes in the published events: int (vLLM's default, "
                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or bytes (default int)")
    p.add_argument("--copy-threads", type=int, default=_env("COPY_THREADS", "2"),
                   help="copy worker threads (default 2): loads go first, and a large job's pieces "
                        "run on every idle worker")
    p.add_argument("--torch-threads", type=int, default=_env("TORCH_THREADS", "0"),
                   help="torch intra-op threads for copies (default: torch's choice)")
    p.add_argument("--shutdown-grace", type=float, default=_env("SHUTDOWN_GRACE", "5"),
                   help="seconds in-flight calls get on SIGTERM (default 5)")
    p.add_argument("--progress-interval-ms", type=float, default=_env("PROGRESS_INTERVAL_MS", "1"),
                   help="least time between load progress messages, or on the compiled data plane "
                        "between wake-ups of a sleeping waiter (it updates the progress words every "
                        "layer); 0: one per layer (default 1)")
    p.add_argument("--plane-spin-us", type=float, default=_env("PLANE_SPIN_US", "50"),
                   help="after a fast-lane request or copy, how long the data plane's thread looks for the "
                        "next one before it sleeps; 0 never spins (default 50)")
    p.add_argument("--lease-seconds", type=float, default=_env("LEASE_SECONDS", "30"),
                   help="a client without a Session is reclaimed this long after its last call, or with "
                        "the grace once its registering process exited (default 30)")
    p.add_argument("--reclaim-grace-seconds", type=float, default=_env("RECLAIM_GRACE_SECONDS", "1"),
                   help="wait for a new Session this long before reclaiming a client whose session "
                        "ended (default 1)")
    p.add_argument("--cuda-wait-seconds", type=float, default=_env("CUDA_WAIT_SECONDS", "20"),
                   help="a CUDA client whose GPU copies make no progress this long (say, an engine "
                        "event that never fires) is failed and reclaimed (default 20)")
    p.add_argument("--max-clients", type=int, default=_env("MAX_CLIENTS", "1024"))
    p.add_argument("--max-clients-per-tenant", type=int, default=_env("MAX_CLIENTS_PER_TENANT", "256"),
                   help="most registrations one tenant (a uid, a tenant token, or the anonymous one) "
                        "holds at once, so that no one caller takes every client slot (default 256)")
    p.add_argument("--max-request-indices", type=int,
                   default=_env("MAX_REQUEST_INDICES", str(DEFAULT_MAX_REQUEST_INDICES)),
                   help="most indices in one request (default 1048576, at most 4194304); gRPC takes no "
                        "request larger than the largest valid one (16 MiB at the default)")
    p.add_argument("--max-pages-per-client", type=int, default=_env("MAX_PAGES_PER_CLIENT", str(1 << 24)),
                   help="most host pages one registration may hold (default 16777216)")
    p.add_argument("--token-file", default=_env("TOKEN_FILE"),
                   help="file holding the token clients must send; KVSERVER_TOKEN gives it directly")
    p.add_argument("--admin-token-file", default=_env("ADMIN_TOKEN_FILE"),
                   help="file holding the admin token (x-kvserver-admin metadata): it lets a caller "
                        "list every client in Stats; KVSERVER_ADMIN_TOKEN gives it directly")
    p.add_argument("--insecure-tcp", action="store_true", default=_env("INSECURE_TCP", "") == "1",
                   help="allow --listen without a token")
    p.add_argument("--socket-group-access", action="store_true",
                   default=_env("SOCKET_GROUP_ACCESS", "") == "1",
                   help="socket mode 0660 instead of 0600, and a socket directory the daemon makes 0750 "
                        "instead of 0700 (one that exists must let the group in too)")
    p.add_argument("--shared-socket-dir", action="store_true",
                   default=_env("SHARED_SOCKET_DIR", "") == "1",
                   help="listen even where other users may write the socket's directory or one above "
                        "it (a Kubernetes emptyDir shared by a pod's containers): whoever may write it "
                        "can put its own sockets in the daemon's place; warned at start")
    p.add_argument("--allow-named-shm", action="store_true", default=_env("ALLOW_NAMED_SHM", "") == "1",
                   help="also accept pools in named /dev/shm objects, only ones owned by the caller's "
                        "uid (default: sealed memfds passed over the fd socket only)")
    p.add_argument("--tenant-quota", default=_env("TENANT_QUOTA", "100%"),
                   help="cached bytes one tenant may hold in the node-wide cache: a size or a share of "
                        "--host-memory (default 100%%: the whole budget)")
    p.add_argument("--tenant-region-quota", default=_env("TENANT_REGION_QUOTA", "100%"),
                   help="host memory the regions of one tenant's registrations may take together: a "
                        "size or a share of --host-memory (default 100%%: the whole budget)")
    p.add_argument("--tenant-tokens", default=_env("TENANT_TOKENS"),
                   help="file of 'name token [quota]' lines: a call sending x-kvserver-tenant: <token> "
                        "is in tenant <name> (default: a caller's tenant is its uid)")
    p.add_argument("--metrics-listen", default=_env("METRICS_LISTEN"),
                   help="serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9400 "
                        "(default off; no token guards it: bind it where only your scraper reaches)")
    p.add_argument("--metrics-per-space", action="store_true", default=_env("METRICS_PER_SPACE", "") == "1",
                   help="also export per tenant, model and space series (tenant and model names: what "
                        "Stats shows only with the admin token; default: daemon-wide series only)")
    p.add_argument("--log-level", type=_log_level, default=_env("LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return p


def _read_token(path: str | None, variable: str = "KVSERVER_TOKEN") -> str | None:
    if path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    return os.environ.get(variable) or None


# Flags that do something only beside another one: (its dest, the dest of the flag it needs).
_NEEDS = (
    ("disk_size", "disk_cache"),
    ("cluster_segment", "cluster_master"),
    ("cluster_timeout_ms", "cluster_master"),
    ("cluster_host", "cluster_master"),
    ("kv_events_hashes", "kv_events_endpoint"),
    ("metrics_per_space", "metrics_listen"),
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def given_flags(argv: list[str], args: argparse.Namespace) -> dict[str, str]:
    """The flags the operator gave, on the command line ``argv`` or as a set KVSERVER_* variable
    (``args`` is what ``argv`` parsed to), each as its message names it: ``--disk-size`` or
    ``--disk-size (KVSERVER_DISK_SIZE)``. A default is not given: ``argv`` is parsed again into a
    namespace whose every name holds a marker, which argparse keeps where ``argv`` names no value (it
    fills in a default only where a name is missing; defaults set to ``argparse.SUPPRESS`` would not
    do: Python 3.11 still converts that string with an option's type)."""
    unset = object()
    on_line = build_parser().parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    given = {}
    for dest in vars(args):
        variable = f"KVSERVER_{dest.upper()}"
        if getattr(on_line, dest) is not unset:
            given[dest] = _flag(dest)
        elif variable in os.environ:
            given[dest] = f"{_flag(dest)} ({variable})"
    return given


def refuse_lone_flags(argv: list[str], args: argparse.Namespace) -> None:
    """A flag given without the flag it needs would do nothing: refused (ValueError). One that asks
    for nothing (an empty value, a switch left off) passes, and a needed flag given empty counts as
    given: a template such as docker-compose.yml's passes ``--disk-cache ""`` (the tier off) beside
    ``--disk-size``."""
    given = given_flags(argv, args)
    for dest, needs in _NEEDS:
        value = getattr(args, dest)
        asks = value is not None and value is not False and value != ""
        if dest in given and asks and needs not in given:
            raise ValueError(f"{given[dest]} needs {_flag(needs)}")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    socket = args.socket
    if socket is None:
        socket = default_socket()
    elif socket.lower() == "none":
        socket = None
    host_memory = parse_host_memory(args.host_memory)
    # Read even where their tier is off, so that a malformed value is never passed over.
    disk_size = parse_disk_size(args.disk_size, args.disk_cache or os.curdir)
    cluster_segment = parse_cluster_segment(args.cluster_segment, host_memory)
    config = ServerConfig(
        socket=socket,
        listen=args.listen,
        host_memory=host_memory,
        host_memory_dir=args.host_memory_dir or None,
        disk_cache=args.disk_cache or None,
        disk_size=disk_size if args.disk_cache else 0,
        disk_size_share=args.disk_size.strip().endswith("%"),
        disk_threads=args.disk_threads,
        cluster_master=args.cluster_master or None,
        cluster_metadata=args.cluster_metadata,
        cluster_host=args.cluster_host or None,
        cluster_segment=cluster_segment if args.cluster_master else 0,
        cluster_protocol=args.cluster_protocol,
        cluster_timeout=args.cluster_timeout_ms / 1000,
        kv_events_endpoint=args.kv_events_endpoint or None,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint or None,
        kv_events_int_hashes=args.kv_events_hashes == "int",
        copy_threads=args.copy_threads,
        torch_threads=args.torch_threads,
        shutdown_grace=args.shutdown_grace,
        progress_interval=args.progress_interval_ms / 1000,
        plane_spin=args.plane_spin_us / 1e6,
        lease=args.lease_seconds,
        reclaim_grace=args.reclaim_grace_seconds,
        max_clients=args.max_clients,
        max_clients_per_tenant=args.max_clients_per_tenant,
        max_request_indices=args.max_request_indices,
        max_pages_per_client=args.max_pages_per_client,
        token=_read_token(args.token_file),
        admin_token=_read_token(args.admin_token_file, "KVSERVER_ADMIN_TOKEN"),
        insecure_tcp=args.insecure_tcp,
        socket_group_access=args.socket_group_access,
        shared_socket_dir=args.shared_socket_dir,
        cuda_wait_seconds=args.cuda_wait_seconds,
        allow_named_shm=args.allow_named_shm,
        tenant_quota=args.tenant_quota,
        tenant_region_quota=args.tenant_region_quota,
        tenant_tokens=args.tenant_tokens,
        metrics_listen=args.metrics_listen,
        metrics_per_space=args.metrics_per_space,
    )
    if config.cluster_master:
        check_installed()
    if config.kv_events_endpoint:
        check_events_installed()
    # Checked here, so that a bad quota or tokens file stops the daemon with a clear message.
    parse_quota(config.tenant_quota, config.host_memory)
    parse_quota(config.tenant_region_quota, config.host_memory)
    if config.tenant_tokens:
        TenantBook.load(config.tenant_tokens, config.host_memory)
    return config


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        refuse_lone_flags(argv, args)
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvserver: {exc}", file=sys.stderr)
        return 2
    if not config.addresses:
        print("kvserver: nothing to listen on: give --socket or --listen", file=sys.stderr)
        return 2
    try:
        uvloop.run(serve(config))
    except ListenError as exc:
        print(f"kvserver: {exc}", file=sys.stderr)
        return 1
    except HostMemoryError as exc:
        print(f"kvserver: {exc}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """The process's entry (the ``kvserver`` command, ``python -m kvserver``): ``main()``, then the
    process ends at once (``end_process``), without the interpreter's teardown."""
    end_process(main())


if __name__ == "__main__":
    run()
