"""The client's own leaks and silences, against the real daemon: a pinning Lookup given up on a
lane leaves no lease behind; a re-registration the daemon keeps refusing is logged; a pool
refused at construction leaves no memfd or /dev/shm object; a lane opened for a registration
that was replaced meanwhile never displaces the new one's; a hung daemon's calls end within the
bounds docs/reliability.md states."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time

import pytest
import torch
from checks import wait_until
from conftest import DaemonThread
from daemon_proc import DaemonProcess
from test_lane import all_stopped

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool
from kvclient._transport import lane as lane_mod
from kvclient.keys import page_keys
from kvserver.config import ServerConfig
from kvserver.protocol.shared_memory import SHM_DIR

LAYOUT, DTYPE, LAYERS, PAGE, TOKENS = KVLayout.mha(2, 8), torch.float16, 4, 16, 256
KEYS = page_keys(range(PAGE), PAGE)  # one page's key


def register(client: KVClient, pool: ShmKVPool, host_tokens: int = 128, model: str = "review"):
    return client.register(model=model, pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=host_tokens, page_size=PAGE)


def leases(daemon: DaemonThread) -> int:
    return daemon.run(lambda: len(daemon.core.cache.leases.leases))


def pool_memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvpool-")
        except OSError:  # the listing's own descriptor, closed since
            pass
    return n


class LateLookups:
    """The daemon's Lookups, each taking ``seconds`` longer (a slow tier, a busy loop) and served
    by a task (not at once where the lane takes them), their leases noted as they are answered."""

    def __init__(self, daemon: DaemonThread, seconds: float) -> None:
        self.ops = daemon.daemon.servicer.cache
        self.real, self.real_now = self.ops.lookup, self.ops.lookup_now
        self.leases: list[str] = []

        async def late(req):
            await asyncio.sleep(seconds)
            found = await self.real(req)
            self.leases.append(found.lease_id)
            return found

        self.ops.lookup, self.ops.lookup_now = late, lambda req: None

    def restore(self) -> None:
        self.ops.lookup, self.ops.lookup_now = self.real, self.real_now


# A Lookup the client waits TIMEOUT for, on a daemon whose loop takes it HELD late and answers it
# SLOW after: within the daemon's own bound (HELD + TIMEOUT), after the client gave up.
TIMEOUT, HELD, SLOW = 0.3, 0.2, 0.2


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_pinning_lookup_given_up_on_the_engines_lane_leaves_no_lease(daemon, monkeypatch, compiled) -> None:
    if not compiled:
        monkeypatch.setattr(lane_mod, "_wire", None)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, host_tokens=0)
        assert client.lane is not None
        assert client.put(KEYS, [0]).stored == 1
        late = LateLookups(daemon, SLOW)
        try:
            misses = client.misses
            daemon.loop.call_soon_threadsafe(time.sleep, HELD)  # another engine's big Put, say
            found = client.lookup(KEYS, pin_ms=60_000, timeout=TIMEOUT)
            assert found.pages == 0 and not found.lease_id and client.misses == misses + 1
            wait_until(lambda: late.leases, 5, "the daemon's answer")
            assert late.leases[0]  # the daemon answered in its bound, with a lease nobody saw
            wait_until(lambda: leases(daemon) == 0, 5, "the lease nobody holds to be released")
        finally:
            late.restore()
        found = client.lookup(KEYS, pin_ms=1000)  # the lane still serves
        assert found.pages == 1 and client.release(found.lease_id) == 1
        client.unregister()


def test_a_pinning_lookup_given_up_on_a_spaces_lane_leaves_no_lease(daemon) -> None:
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as engine, \
            CacheView(daemon.address, model="review", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                      num_layers=LAYERS, timeout=TIMEOUT) as view:
        register(engine, pool, host_tokens=0)
        assert engine.put(KEYS, [0]).stored == 1
        assert view.lookup(KEYS).pages == 1 and view.lane is not None  # the space and its lane open
        late = LateLookups(daemon, SLOW)
        try:
            daemon.loop.call_soon_threadsafe(time.sleep, HELD)
            assert view.lookup(KEYS, pin_ms=60_000).pages == 0  # given up: a miss
            wait_until(lambda: late.leases, 5, "the daemon's answer")
            assert late.leases[0]
            wait_until(lambda: leases(daemon) == 0, 5, "the lease nobody holds to be released")
        finally:
            late.restore()
        assert view.lookup(KEYS).pages == 1


def test_a_reregistration_the_daemon_keeps_refusing_is_logged_and_retried(socket_dir, caplog) -> None:
    """A daemon back with less memory than the engine's grant refuses its Register again and
    again: the first refusal is a warning naming the status and the daemon's reason; the client
    keeps asking, and registers once a daemon can grant it."""
    caplog.set_level(logging.DEBUG, logger="kvclient")
    path = os.path.join(socket_dir, "kv.sock")
    layout = KVLayout.mha(8, 128)  # 16 KiB a token over 4 layers
    daemon = DaemonThread(ServerConfig(socket=path, host_memory=512 << 20))
    try:
        with ShmKVPool(layout, DTYPE, LAYERS, 1024) as pool, KVClient(daemon.address, timeout=1.0) as client:
            client.register(model="refused", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                            host_tokens=16384, page_size=PAGE)  # 256 MiB
            daemon.stop()
            daemon = DaemonThread(ServerConfig(socket=path, host_memory=128 << 20))

            def refusals() -> list[logging.LogRecord]:
                return [r for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()
                        and r.levelno >= logging.WARNING]

            wait_until(refusals, 10, "the refusal's warning")
            time.sleep(2.0)  # more refusals: logged once
            assert len(refusals()) == 1 and not client.connected
            assert "re-registration" in refusals()[0].getMessage()
            daemon.stop()
            daemon = DaemonThread(ServerConfig(socket=path, host_memory=512 << 20))
            wait_until(lambda: client.connected, 15, "the re-registration")
            assert client.reconnects == 1 and client.alloc(16) is not None
    finally:
        daemon.stop()


def test_an_async_reregistration_the_daemon_keeps_refusing_is_logged(socket_dir, caplog) -> None:
    from kvclient import AsyncKVClient

    caplog.set_level(logging.DEBUG, logger="kvclient")
    path = os.path.join(socket_dir, "kv.sock")
    layout = KVLayout.mha(8, 128)
    holder = {"daemon": DaemonThread(ServerConfig(socket=path, host_memory=512 << 20))}

    def refusals() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()
                and r.levelno >= logging.WARNING]

    async def body(pool: ShmKVPool) -> None:
        async with AsyncKVClient(holder["daemon"].address, timeout=1.0) as client:
            await client.register(model="refused", pool=pool, start_layer=0, end_layer=LAYERS,
                                  num_layers=LAYERS, host_tokens=16384, page_size=PAGE)
            await asyncio.to_thread(holder["daemon"].stop)
            holder["daemon"] = await asyncio.to_thread(
                DaemonThread, ServerConfig(socket=path, host_memory=128 << 20))
            deadline = time.monotonic() + 10
            while not refusals():
                assert time.monotonic() < deadline, "no warning of the refusal"
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.0)
            assert len(refusals()) == 1 and not client.connected

    try:
        with ShmKVPool(layout, DTYPE, LAYERS, 1024) as pool:
            asyncio.run(body(pool))
    finally:
        holder["daemon"].stop()


@pytest.mark.parametrize("named", [False, True], ids=["memfd", "named"])
@pytest.mark.parametrize("bad", [
    {"vllm_layout": "bogus"},
    {"vllm_layout": "flash_attn", "token_padding": 2},
    {"vllm_layout": "mla"},  # an MHA pool
    {"vllm_layout": "flash_attn", "block_size": 0},
], ids=["unknown", "padded", "mla-of-mha", "no-block"])
def test_a_pool_refused_at_construction_leaves_no_memfd_and_no_named_object(named, bad) -> None:
    name = f"kvpool-review-{os.getpid()}-{threading.get_ident()}" if named else None
    path = os.path.join(SHM_DIR, name) if named else ""
    before = pool_memfds()
    try:
        for _ in range(3):
            with pytest.raises(ValueError):
                ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS, name=name, **bad)
            assert not named or not os.path.exists(path)
        assert pool_memfds() == before
    finally:
        if named and os.path.exists(path):
            os.unlink(path)  # (left by a failed check)


@pytest.mark.parametrize("named", [False, True], ids=["memfd", "named"])
def test_a_pool_whose_layout_fails_after_its_memory_is_made_leaves_none(named, monkeypatch) -> None:
    """A failure past the checks, once the memfd or the /dev/shm object exists (laying the views
    out): the pool closes what it made before the error goes up."""
    name = f"kvpool-late-{os.getpid()}" if named else None
    path = os.path.join(SHM_DIR, name) if named else ""

    def fail(self, *args) -> None:
        assert self._shm is not None  # made already
        raise RuntimeError("laying out failed")

    monkeypatch.setattr(ShmKVPool, "_lay_out", fail)
    before = pool_memfds()
    try:
        with pytest.raises(RuntimeError, match="laying out failed"):
            ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS, name=name, vllm_layout="flash_attn", block_size=16)
        assert pool_memfds() == before
        assert not named or not os.path.exists(path)
    finally:
        if named and os.path.exists(path):
            os.unlink(path)


def test_a_lane_opened_for_a_registration_replaced_meanwhile_leaves_the_new_ones_lane(daemon) -> None:
    """A lane for R1 whose opening the daemon answers only after a register() made R2 and opened
    R2's lane (the reconnect thread, say, opening R1's lane): R1's lane is closed, R2's stays."""
    lanes = daemon.daemon.servicer.lanes
    real_open = lanes.open
    opened, answer = threading.Event(), threading.Event()
    held = []

    async def slow_open(client_id, ticket, named):
        lane = await real_open(client_id, ticket, named)
        if not held:  # the first only: opened at the daemon, answered late
            held.append(client_id)
            opened.set()
            while not answer.is_set():
                await asyncio.sleep(0.01)
        return lane

    lanes.open = slow_open
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
            first = threading.Thread(target=register, args=(client, pool))
            first.start()
            assert opened.wait(10)
            r2 = register(client, pool)  # replaces R1 (whose lane the daemon then closes)
            new_lane = client.lane
            assert new_lane is not None and new_lane.reg is r2
            answer.set()
            first.join(10)
            assert client.registration is r2
            assert client.lane is new_lane and not new_lane.closed
            host = client.alloc(PAGE)
            assert client.write(host_indices=host, device_indices=torch.arange(PAGE)) > 0
            assert new_lane.calls >= 1  # on R2's lane
            client.unregister()
    finally:
        lanes.open = real_open
        answer.set()


def test_a_hung_daemons_calls_end_within_their_documented_bounds(socket_dir) -> None:
    """docs/reliability.md: on a daemon that answers nothing, Alloc ends after the client's
    timeout; a Write after timeout + max(1 s, timeout / 2) (its deadline), then up to timeout more
    (the Unregister that would confirm its copy stopped)."""
    timeout = 1.0
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=timeout) as client:
            register(client, pool)
            host, dev = client.alloc(PAGE), torch.arange(PAGE)
            assert client.write(host_indices=host, device_indices=dev) > 0
            os.kill(d.pid, signal.SIGSTOP)
            wait_until(lambda: all_stopped(d.pid), 10, "every thread of the daemon to stop")
            t0 = time.monotonic()
            assert client.alloc(PAGE) is None  # a miss
            alloc = time.monotonic() - t0
            t0 = time.monotonic()
            assert client.write(host_indices=host, device_indices=dev) == 0
            write = time.monotonic() - t0
            os.kill(d.pid, signal.SIGCONT)
            assert timeout <= alloc < timeout + 0.5
            bound = timeout + max(1.0, timeout / 2) + timeout
            assert client._core.job_deadline < write < bound + 0.5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_loads_in_flight_on_a_hung_daemon_end_together_and_no_poll_waits(socket_dir) -> None:
    """Four lane loads in flight when the daemon stops answering: the registration is confirmed
    stopped once (one Unregister, on a loader thread), every load ends within a Load's documented
    bound, and an engine thread polling them (ended(), wait(timeout=...)) never waits on that
    confirmation: it sees "not ended" until it came."""
    timeout = 1.0
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=timeout) as client:
            register(client, pool)
            host, dev = client.alloc(PAGE), torch.arange(PAGE)
            assert client.write(host_indices=host, device_indices=dev) > 0
            assert client.lane is not None
            os.kill(d.pid, signal.SIGSTOP)
            wait_until(lambda: all_stopped(d.pid), 10, "every thread of the daemon to stop")
            t0 = time.monotonic()
            handles = [client.load(host_indices=host, device_indices=dev) for _ in range(4)]
            polls: list[float] = []
            while not all(h.ended() for h in handles):  # an engine polling its loads each step
                for h in handles:
                    p = time.monotonic()
                    h.ended()
                    with contextlib.suppress(TimeoutError):
                        h.wait(timeout=0.01)
                    polls.append(time.monotonic() - p)
                assert time.monotonic() - t0 < 10
            ended = time.monotonic() - t0
            assert [h.wait() for h in handles] == [0] * 4 and all(h.missed for h in handles)
            os.kill(d.pid, signal.SIGCONT)
            bound = timeout + max(1.0, timeout / 2) + timeout
            assert ended < bound + 0.5, ended  # was one confirmation after another: 3, 4, 5, 6 s
            assert max(polls) < 0.3, max(polls)  # was the whole confirmation, on the polling thread
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
        d.stop()


def _lane_memfds(prefix: str = "/memfd:kvclient-lane") -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
    return n


@contextlib.contextmanager
def _descriptors_left(n: int):
    """This process may open only ``n`` more descriptors meanwhile."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    limit, free = 0, 0  # (the limit bounds descriptors' numbers: those free below it are what is left)
    while free < n:
        free += limit not in used
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_lane_the_process_has_no_descriptors_for_leaves_the_client_registered_on_grpc(socket_dir):
    """Near its descriptor limit an engine's Register succeeds and its lane cannot be made: the
    registration is returned and serves on gRPC, and the half-made lane leaves nothing open."""
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=2.0) as client:
            client.stats(all_clients=True)  # (the channel's socket made before the limit)
            before, sockets = _lane_memfds(), _lane_memfds("socket:")
            with _descriptors_left(8):  # (its doorbells cannot all be connected)
                reg = register(client, pool)
            assert reg is not None and client.connected and client.lane is None
            # (no more sockets: gRPC's own may close meanwhile, on its threads)
            assert _lane_memfds() == before and _lane_memfds("socket:") <= sockets
            host, dev = client.alloc(PAGE), torch.arange(PAGE)
            assert client.write(host_indices=host, device_indices=dev) > 0  # on gRPC
        sockets = _lane_memfds("socket:")
        for _ in range(3):  # a standalone lane whose socket pairs run out of descriptors midway
            with _descriptors_left(6), pytest.raises(OSError):
                lane_mod.ClientLane.standalone()
        assert _lane_memfds() == before and _lane_memfds("socket:") <= sockets
    finally:
        d.stop()


def test_a_close_while_the_client_registers_again_ends_its_thread_quietly(socket_dir):
    """The engine closes its client while the re-registration thread waits on a stopped daemon
    that resumes at that moment: the thread ends without an exception (its channel is closed)."""
    uncaught: list = []
    hook, threading.excepthook = threading.excepthook, lambda a: uncaught.append(
        (a.thread.name if a.thread else "", repr(a.exc_value)))
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool:
            client = KVClient(d.address, timeout=1.0)
            register(client, pool)
            host, dev = client.alloc(PAGE), torch.arange(PAGE)
            os.kill(d.pid, signal.SIGSTOP)
            wait_until(lambda: all_stopped(d.pid), 10, "every thread of the daemon to stop")
            assert client.write(host_indices=host, device_indices=dev) == 0 and not client.connected
            time.sleep(0.3)  # the reconnect thread waits for a peer ticket from the stopped daemon
            client.close()
            os.kill(d.pid, signal.SIGCONT)
            time.sleep(1.5)
        assert uncaught == []
    finally:
        threading.excepthook = hook
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
        d.stop()
