"""Fixtures: a real daemon on a temp Unix socket, run on its own uvloop thread."""

from __future__ import annotations

import asyncio
import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator

import pytest
import uvloop

from kvserver.config import ServerConfig
from kvserver.server import Daemon


class DaemonThread:
    """A Daemon on a private event loop thread, so sync clients in the test can call it."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.address = f"unix://{config.socket}"
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.daemon: Daemon = self.call(self._start())

    async def _start(self) -> Daemon:
        daemon = Daemon(self.config)
        await daemon.start()
        return daemon

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def run(self, fn, *args):
        """Runs a plain function on the daemon's loop thread (to read core state safely)."""

        async def wrapper():
            return fn(*args)

        return self.call(wrapper())

    @property
    def core(self):
        return self.daemon.core

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self.call(self.daemon.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@pytest.fixture
def socket_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvs-") as d:
        yield d


@pytest.fixture
def daemon(socket_dir: str) -> Iterator[DaemonThread]:
    config = ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=512 << 20)
    d = DaemonThread(config)
    try:
        yield d
    finally:
        d.stop()


def pytest_configure(config) -> None:
    """scripts/sanitize.sh: every process running tests (each xdist worker too) uses the sanitized
    builds of the extensions, or the job would pass without its sanitizers."""
    if not os.environ.get("KVSERVER_EXPECT_SANITIZED"):
        return
    from kvserver.protocol import compiled

    for name in compiled.SOURCES:
        module = compiled.extension(name)
        if module is None:
            raise pytest.UsageError(f"{name} would not be used")
        with open(module.__file__, "rb") as f:
            if b"__asan_" not in f.read():
                raise pytest.UsageError(f"{module.__file__} is not built with ASan")


# Spawned engine processes import their bodies from this folder.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p
)


@pytest.fixture
def plane_daemon(daemon: DaemonThread) -> DaemonThread:
    """The in-process daemon, where its compiled data plane runs (else the test is skipped)."""
    if daemon.core.plane is None:
        if os.environ.get("KVSERVER_EXPECT_PLANE"):  # scripts/sanitize.sh: a skip would hide the job
            pytest.fail("the compiled data plane is not running")
        pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
    return daemon


@pytest.fixture
def daemon_factory(socket_dir: str):
    """Builds in-process daemons with other settings: daemon_factory(lease=0.5, ...)."""
    made: list[DaemonThread] = []

    def make(**overrides) -> DaemonThread:
        overrides.setdefault("host_memory", 512 << 20)
        config = ServerConfig(socket=os.path.join(socket_dir, f"kv{len(made)}.sock"), **overrides)
        made.append(DaemonThread(config))
        return made[-1]

    yield make
    for d in made:
        d.stop()


@pytest.fixture
def spins_kept() -> Iterator[None]:
    """Lane waits spin as long as they are told, however busy the CPUs (the process's crowded
    window off: docs/lane.md, "Waiting"), for a test of how a waiter spins, rings or is rung; the
    window given back after."""
    from kvclient._transport import lane

    window = lane.crowded()[0]
    lane.crowded(0)
    try:
        yield
    finally:
        lane.crowded(window)


@pytest.fixture(scope="module")
def default_socket_lock() -> Iterator[None]:
    """Held by a test module that runs daemons on the node's default socket and TCP port (the
    documents' blocks): such modules run one at a time, also under pytest-xdist's workers."""
    path = os.path.join(tempfile.gettempdir(), "kvserver-tests-default-socket.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
