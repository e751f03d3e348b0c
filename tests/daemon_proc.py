"""The daemon as a real subprocess, with what tests read of it from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc

from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

ADMIN_TOKEN = "test-admin-token"
ADMIN = (("x-kvserver-admin", ADMIN_TOKEN),)


class DaemonProcess:
    """``stats()`` carries the admin token the daemon is started with, so it lists every client."""

    def __init__(self, socket: str, *args: str, host_memory: str = "1GiB",
                 prefix: tuple[str, ...] = ()) -> None:
        self.socket = socket
        self.prefix = list(prefix)  # a command the daemon runs under, e.g. ip netns exec NS
        self.address = f"unix://{socket}"
        self.args = ["--socket", socket, "--host-memory", host_memory, "--log-level", "WARNING", *args]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "kvserver", *self.args],
                                     env={**os.environ, "KVSERVER_ADMIN_TOKEN": ADMIN_TOKEN})
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start (exit {self.proc.poll()})")
            time.sleep(0.02)
        self._channel = grpc.insecure_channel(self.address)
        # The socket's file exists from its bind, a moment before the server listens on it.
        grpc.channel_ready_future(self._channel).result(timeout=30)
        self.stub = pb_grpc.KVServerStub(self._channel)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=10, metadata=ADMIN)

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def shm_maps(self) -> list[str]:
        """The daemon's mappings of engine pools: named /dev/shm objects and memfds."""
        with open(f"/proc/{self.pid}/maps") as f:
            return [line.split(None, 5)[5].strip() for line in f
                    if len(line.split(None, 5)) == 6 and ("/dev/shm/" in line or "/memfd:" in line)]

    def num_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def wait_for(self, predicate, timeout: float) -> float:
        """Seconds until ``predicate(stats)`` held; raises after ``timeout``."""
        t0 = time.monotonic()
        while True:
            if predicate(self.stats()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"not reached within {timeout} s: {self.stats()}")
            time.sleep(0.01)

    def kill(self) -> None:
        self._channel.close()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        self._channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)
