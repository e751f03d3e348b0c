"""A real Mooncake Store master for the cluster tier's tests: started on free ports of one address
(in a network namespace if asked), killed, and started again on the same ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest


def master_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.path.exists(here) else shutil.which("mooncake_master")


def needs_mooncake() -> None:
    """Skips the test where Mooncake Store's client or master is not installed (the 'cluster' extra)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Mooncake Store is not installed (pip install 'kvserver[cluster]'): {exc}")
    if master_binary() is None:
        pytest.skip("mooncake_master is not installed (pip install 'kvserver[cluster]')")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """``address`` (HOST:PORT, for --cluster-master) and ``metadata`` (its HTTP metadata URL).
    ``netns``: run it in that network namespace (its ports then picked by the caller)."""

    def __init__(self, host: str = "127.0.0.1", netns: str | None = None, ports: tuple[int, ...] = (),
                 client_ttl: int = 2, log: str | None = None) -> None:
        self.host, self.netns = host, netns
        self.rpc, self.http, self.metrics = ports or (free_port(host), free_port(host), free_port(host))
        self.client_ttl = client_ttl
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.http}/metadata"

    def start(self, timeout: float = 20) -> None:
        binary = master_binary()
        assert binary is not None
        cmd = [binary, f"--rpc_address={self.host}", f"--rpc_port={self.rpc}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
               f"--http_metadata_server_port={self.http}", f"--metrics_host={self.host}",
               f"--metrics_port={self.metrics}", "--rpc_thread_num=2", f"--client_ttl={self.client_ttl}",
               "--logtostderr"]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def _answers(self) -> bool:
        cmd = [sys.executable, "-c", "import socket,sys; socket.create_connection((sys.argv[1], "
               "int(sys.argv[2])), 1).close()", self.host, str(self.rpc)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
            return subprocess.run(cmd, capture_output=True).returncode == 0
        try:
            socket.create_connection((self.host, self.rpc), 1).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()
