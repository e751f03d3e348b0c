"""The cluster store's client: Mooncake Store (``mooncake.store.MooncakeDistributedStore``), its
blocking calls as the cluster tier makes them, from worker threads only.

Mooncake Store is a master (which object is where) and clients that each contribute a segment of
host memory and move bytes with a transfer engine (TCP, or RDMA). This daemon is one client: it
contributes ``segment_bytes`` and registers its host arena, so that pages go between the arena
and the cluster with no copy of ours (``batch_put_from`` / ``batch_get_into``); its puts go to its
own segment first (peers then read them from here), and the first writer of a name wins (a page's
bytes are a function of its name). ``mooncake`` is imported only when a cluster is configured (the
``cluster`` extra: ``mooncake-transfer-engine-non-cuda``, which needs ``libibverbs1`` even for TCP).

Primitives: ``MooncakeClient`` (``join``, ``exists``, ``put``, ``get``, ``close``) and the codes.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from typing import Any

logger = logging.getLogger(__name__)

# Mooncake's error codes as its calls return them (negative), those the tier tells apart.
NOT_FOUND = -704
RPC_FAILED = -900  # the master cannot be reached
RPC_TIMEOUT = -901  # the master did not answer (hung, or the network dropped)
TRANSFER_FAILED = -800  # the segment's owner cannot be reached (a dead peer)
NO_SPACE = -200

LOCAL_BUFFER_BYTES = 16 << 20  # Mooncake's own staging buffer: the tier's calls never use it
PROBE_SECONDS = 5.0
# Mooncake's setup holds the interpreter's lock for as long as it retries an absent or hung master
# (a minute and more), which would stop the daemon's event loop: a child process tries it first,
# with no segment, and exits at once; the daemon's own setup follows only once that one succeeded.
# Run as a child process; it dies with the daemon (PR_SET_PDEATHSIG), which may exit while the
# child still retries an absent or hung master.
_PROBE = """import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[6]):  # the daemon exited before the line above
    os._exit(4)
from mooncake.store import MooncakeDistributedStore
host, metadata, protocol, device, master = sys.argv[1:6]
rc = MooncakeDistributedStore().setup(host, metadata, 0, 1 << 20, protocol, device, master)
os._exit(0 if rc == 0 else 3)
"""


def local_address(master: str) -> str:
    """The address of this host that reaches ``master`` (HOST:PORT): the one peers should use,
    unless --cluster-host names another. Where no route (or no name) is known yet, the address of
    this host's name, with a warning."""
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port or 0)))  # no packet is sent: only the route is chosen
            return s.getsockname()[0]
    except OSError as exc:
        try:
            mine = socket.gethostbyname(socket.gethostname())
        except OSError:
            mine = "127.0.0.1"
        logger.warning("no route to the cluster master %s yet (%s): this node calls itself %s to "
                       "its peers; --cluster-host names the address they reach it at", master, exc, mine)
        return mine


class JoinError(RuntimeError):
    """Joining failed; ``probed``: after the master had answered a probe (our own setup failed)."""

    def __init__(self, message: str, probed: bool = False) -> None:
        super().__init__(message)
        self.probed = probed


def check_installed() -> None:
    """ValueError, saying what to install, if Mooncake Store's client cannot be imported here."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--cluster-master needs Mooncake Store's client, which does not import ({exc}): "
                         "pip install 'kvserver[cluster]' (and apt-get install libibverbs1)") from None


class MooncakeClient:
    """One Mooncake Store client of this daemon. Every method blocks; the tier calls them from
    its worker threads only."""

    def __init__(self, master: str, metadata: str, local_host: str, segment_bytes: int,
                 protocol: str = "tcp", device: str = "") -> None:
        self.master, self.metadata, self.local_host = master, metadata, local_host
        self.segment_bytes, self.protocol, self.device = segment_bytes, protocol, device
        self._store: Any = None
        self._config: Any = None
        # Set up, its registration refused: kept for the next try, never closed on the way (its
        # close holds the interpreter's lock for seconds), closed with the rest by ``close``.
        self._half: Any = None
        self.hostname = ""  # this client's segment name in the cluster (after ``join``)

    def probe(self, timeout: float = PROBE_SECONDS) -> None:
        """RuntimeError unless a client in a child process can join the cluster within
        ``timeout`` seconds (the master and metadata service answer now)."""
        cmd = [sys.executable, "-c", _PROBE, self.local_host, self.metadata, self.protocol, self.device,
               self.master, str(os.getpid())]
        try:
            r = subprocess.run(cmd, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise JoinError(f"the master did not answer within {timeout:.0f} s") from None
        if r.returncode != 0:
            raise JoinError(f"the master refused a client (probe exit {r.returncode})")

    def join(self, buffer_address: int, buffer_bytes: int) -> None:
        """Joins the cluster, contributes the segment, registers ``buffer_bytes`` at
        ``buffer_address`` (the host arena), once ``probe`` succeeded. RuntimeError if the store
        refuses."""
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        store = self._half
        if store is None:
            self.probe()
            store = MooncakeDistributedStore()
            rc = store.setup(self.local_host, self.metadata, self.segment_bytes, LOCAL_BUFFER_BYTES,
                             self.protocol, self.device, self.master)
            if rc != 0:
                raise JoinError(f"Mooncake Store setup returned {rc} (master {self.master}, "
                                f"metadata {self.metadata})", probed=True)
            self._half = store
        rc = store.register_buffer(buffer_address, buffer_bytes)
        if rc != 0:
            raise JoinError(f"Mooncake Store refused to register the host arena ({rc})", probed=True)
        self._buffer = buffer_address
        hostname = store.get_hostname()
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        try:
            cfg.preferred_segment = hostname  # a put lands in this node's own segment
        except AttributeError:  # an older wheel: the master places it
            pass
        self.hostname = hostname
        self._store, self._config, self._half = store, cfg, None

    @property
    def open(self) -> bool:
        """Whether this client has joined and not closed."""
        return self._store is not None

    @property
    def half_open(self) -> bool:
        """Whether a client was set up whose registration the store refused (kept for the next
        try): ``close`` leaves it."""
        return self._half is not None

    def exists(self, names: list[str]) -> list[int]:
        """Per name: 1 stored, 0 not, negative an error (a half-joined client answers too)."""
        return list((self._store or self._half).batch_is_exist(names))

    def put(self, names: list[str], addresses: list[int], nbytes: int) -> list[int]:
        """Stores each page of ``nbytes`` at its address (in the registered arena) under its
        name; a name already stored is left as it is. Per name: 0, or a negative error."""
        return list(self._store.batch_put_from(names, addresses, [nbytes] * len(names), self._config))

    def get(self, names: list[str], addresses: list[int], nbytes: int) -> list[int]:
        """Reads each named page into its address: per name, the bytes read or a negative error."""
        return list(self._store.batch_get_into(names, addresses, [nbytes] * len(names)))

    def register(self, address: int, nbytes: int) -> None:
        """Registers more memory of this process for transfers (a benchmark's baseline buffer)."""
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store refused to register {nbytes} bytes ({rc})")

    def close(self) -> None:
        store, self._store = self._store, None
        half, self._half = self._half, None
        if store is None:
            if half is not None:  # its registration was refused: nothing to unregister
                half.close()
            return
        try:
            store.unregister_buffer(self._buffer)
        except Exception:  # leaving the cluster goes on
            logger.debug("unregistering the host arena from Mooncake Store failed", exc_info=True)
        store.close()
