"""The fast lane's doorbells are rung only for a peer that sleeps (docs/lane.md, "Ringing only a sleeper"): a
submit skips the submit doorbell while the data plane says it is awake, and the plane rings a quiet
ring's done doorbell only while the client says it waits there. No wake-up is lost when both sides
go to sleep at once, and a client without the compiled calls (rung always) is served alike. Real
daemon, real client, real shared memory."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from checks import wait_until
from conftest import DaemonThread

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient._transport import lane as lane_mod
from kvserver.config import ServerConfig
from kvserver.protocol import lane_request
from kvserver.protocol import ring as R

wire = pytest.importorskip("kvserver.protocol._wire", reason="the compiled client calls are not built")
# How a waiter spins, rings and is rung, whatever else the CPUs run meanwhile.
pytestmark = pytest.mark.usefixtures("spins_kept")

LAYERS, PAGE, TOKENS = 2, 16, 256
LAYOUT, DTYPE = KVLayout.mha(2, 32), torch.bfloat16
KEY = b"quiet-ring-key".ljust(16, b".")


def plane_daemon(socket_dir: str, spin: float, host_memory: int = 64 << 20) -> DaemonThread:
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, f"bells{spin}.sock"),
                                  host_memory=host_memory, plane_spin=spin))
    if d.core.plane is None:
        d.stop()
        if os.environ.get("KVSERVER_EXPECT_PLANE"):  # scripts/sanitize.sh: a skip would hide the job
            pytest.fail("the compiled data plane is not running")
        pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
    return d


def client(d: DaemonThread, pool: ShmKVPool) -> KVClient:
    c = KVClient(d.address, timeout=5, resilient=False)
    c.register(model="bells", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
               host_tokens=TOKENS, page_size=PAGE)
    assert c.lane is not None
    return c


def awake(lane: lane_mod.ClientLane) -> int:
    return R.U32.unpack_from(lane._mm, R.AWAKE_AT)[0]


def pending(sock: socket.socket) -> int:
    """Messages waiting on a doorbell end, read now."""
    n = 0
    try:
        while sock.recv(16, socket.MSG_DONTWAIT):
            n += 1
    except BlockingIOError:
        pass
    return n


def test_a_submit_rings_only_a_daemon_that_sleeps() -> None:
    lane = lane_mod.ClientLane.standalone(slots=2)
    try:
        assert R.U32.unpack_from(lane._mm, R.FEATURES_AT)[0] == R.FEATURE_QUIET_DONE
        daemon_end = socket.socket(fileno=os.dup(lane.daemon_fds()[1]))
        daemon_end.setblocking(False)
        R.U32.pack_into(lane._mm, R.AWAKE_AT, 1)
        assert lane._begin("WriteB", b"x") is not None
        assert pending(daemon_end) == 0  # awake: it finds the slot by looking
        R.U32.pack_into(lane._mm, R.AWAKE_AT, 0)
        assert lane._begin("WriteB", b"y") is not None
        assert pending(daemon_end) == 1  # asleep: rung
        assert lane._state(0) == lane._state(1) == R.SUBMITTED
        daemon_end.close()
    finally:
        lane.close()


def test_the_plane_says_it_is_awake_while_it_spins_and_then_sleeps(socket_dir) -> None:
    d = plane_daemon(socket_dir, 0.01)  # looks for 10 ms after each request
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            seen = 0
            for _ in range(50):  # looked for within 5 ms of an answer (a busy CI may miss some)
                c.write(host_indices=host, device_indices=dev)
                until = time.monotonic() + 0.005
                while not awake(c.lane) and time.monotonic() < until:
                    pass
                seen += awake(c.lane)
            assert seen > 0, "the plane never said it was awake just after answering"
            wait_until(lambda: awake(c.lane) == 0, 2, "the plane to say it sleeps once its spin ran out")
            served = d.core.plane.engine.served
            c.write(host_indices=host, device_indices=dev)  # rung: it wakes
            assert d.core.plane.engine.served == served + 1
    finally:
        d.stop()


def test_a_quiet_ring_is_rung_only_for_a_client_that_sleeps(socket_dir, monkeypatch) -> None:
    """Whoever answers (the plane, or the event loop a request was handed over to), a quiet ring's
    done doorbell is rung only for a client asleep on it; a ring whose client waits in Python is
    rung for every answer."""
    d = plane_daemon(socket_dir, 0.0)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            c.lane.spin = 0.01  # it waits by looking, for up to 10 ms: never in poll
            for _ in range(20):
                c.write(host_indices=host, device_indices=dev)
            assert sum(pending(s) for s in c.lane._done) == 0
            # The event loop's answers (a Put, which the plane hands over; the first Lookup, after
            # which the plane serves them itself) alike.
            assert c.put([KEY], torch.tensor([0])).stored == 1
            for _ in range(10):
                assert c.lookup([KEY]).pages == 1
                assert c.put([KEY], torch.tensor([1])).present == 1
            assert sum(pending(s) for s in c.lane._done) == 0
            c.lane.spin = 0.0  # it sleeps at once: rung (else each call would wait for its deadline)
            t = time.monotonic()
            for _ in range(20):
                c.write(host_indices=host, device_indices=dev)
            assert time.monotonic() - t < 2.0
            assert sum(pending(s) for s in c.lane._done) == 0  # drained as it woke
        # A lane whose client waits in Python is rung for every answer.
        monkeypatch.setattr(lane_mod, "_wire", None)
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            assert R.U32.unpack_from(c.lane._mm, R.FEATURES_AT)[0] == 0
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            c.lane.spin = 0.01
            for _ in range(5):
                c.write(host_indices=host, device_indices=dev)
            for _ in range(3):
                assert c.lookup([KEY]).pages == 1
            assert sum(pending(s) for s in c.lane._done) == 8
    finally:
        d.stop()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_the_client_without_its_compiled_calls_is_served_alike(socket_dir, monkeypatch, compiled) -> None:
    if not compiled:
        monkeypatch.setattr(lane_mod, "_wire", None)
        monkeypatch.setattr(lane_request, "_wire", None)
    d = plane_daemon(socket_dir, 0.0001)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            assert (c.lane._c is not None) == compiled
            g = torch.Generator().manual_seed(3)
            for layer in pool.buffers:
                for buf in layer:
                    buf.view(torch.int16).copy_(torch.randint(-30000, 30000, buf.shape, generator=g,
                                                              dtype=torch.int16))
            want = [buf.view(torch.int16).clone() for layer in pool.buffers for buf in layer]
            host, dev = c.alloc(TOKENS // 2), torch.randperm(TOKENS)[: TOKENS // 2]
            served = d.core.plane.engine.served
            assert c.write(host_indices=host, device_indices=dev) > 0
            for layer in pool.buffers:
                for buf in layer:
                    buf[dev] = 0
            handle = c.load(host_indices=host, device_indices=dev)
            assert handle.wait_layer(0) and handle.wait() > 0
            got = [buf.view(torch.int16) for layer in pool.buffers for buf in layer]
            assert all(bool((a == b).all()) for a, b in zip(got, want, strict=True))
            assert d.core.plane.engine.served == served + 2 and c.lane.calls == 2
    finally:
        d.stop()


@pytest.mark.parametrize("plane_spin,client_spin", [(0.0, 0.0), (0.000002, 0.0), (0.000002, 0.000002),
                                                    (0.00005, 0.000001)])
def test_no_wake_up_is_lost_when_both_sides_go_to_sleep(socket_dir, plane_spin, client_spin) -> None:
    """Spins of a few microseconds put both sides at the edge of sleep on almost every call; two
    engines at once make the plane change its word while the other's call is in flight. A lost
    wake-up would hold a call to its 5 s deadline (DEADLINE_EXCEEDED)."""
    d = plane_daemon(socket_dir, plane_spin)
    errors: list[BaseException] = []
    slowest = [0.0, 0.0]

    def engine(k: int, pool: ShmKVPool) -> None:
        try:
            with client(d, pool) as c:
                c.lane.spin = client_spin
                host, dev = c.alloc(PAGE), torch.arange(PAGE)
                for _ in range(400):
                    t = time.monotonic()
                    c.write(host_indices=host, device_indices=dev, layers=[0])
                    c.load(host_indices=host, device_indices=dev).wait()
                    slowest[k] = max(slowest[k], time.monotonic() - t)
                assert c.lane.calls == 800
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as a, ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as b:
            threads = [threading.Thread(target=engine, args=(k, p)) for k, p in enumerate((a, b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert not errors, errors
        assert max(slowest) < 2.0, slowest  # nothing waited for a deadline, or near one
    finally:
        d.stop()


@pytest.mark.parametrize("text,want", [("0", 0.0), ("150", 150e-6), ("10000", 0.01), ("-1", 30e-6),
                                       ("10001", 30e-6), ("fast", 30e-6), ("nan", 30e-6)])
def test_a_spin_from_the_environment_is_checked(monkeypatch, caplog, text, want) -> None:
    monkeypatch.setenv("KVCLIENT_LANE_SPIN_US", text)
    assert lane_mod._spin_seconds("KVCLIENT_LANE_SPIN_US", 30) == pytest.approx(want)
    assert ("is not a number of microseconds" in caplog.text) == (want == 30e-6)


def test_a_load_s_waiter_spins_long_only_while_its_steps_come_fast() -> None:
    lane = lane_mod.ClientLane.standalone(slots=1, spin=30e-6, load_spin=200e-6)
    try:
        src = lane_mod.LaneStream(lane, 0, time.monotonic() + 5)
        assert src.spin() == 200e-6  # the first layer: no pace known yet
        src.gap = 40e-6  # a small load's layers
        assert src.spin() == 200e-6
        src.gap = 400e-6  # a large load's: looking that long between them costs the copy
        assert src.spin() == 30e-6
    finally:
        lane.close()


def test_a_stream_the_event_loop_serves_waits_for_its_first_step_with_the_short_spin(socket_dir) -> None:
    # A Get is served on the daemon's event loop: its first step comes hundreds of microseconds
    # later, and a long spin would cost the engine that much CPU for nothing.
    lane = lane_mod.ClientLane.standalone(slots=1, spin=30e-6, load_spin=200e-6)
    try:
        get = lane_mod.LaneStream(lane, 0, time.monotonic() + 5, on_plane=False)
        assert get.spin() == 30e-6
        get.gap = 40e-6  # its steps turn out to come fast: it looks longer for them
        assert get.spin() == 200e-6
        assert lane_mod.LaneStream(lane, 0, time.monotonic() + 5).spin() == 200e-6
    finally:
        lane.close()
    d = plane_daemon(socket_dir, 50e-6)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            pool.buffers[0][0].view(torch.int16)[:PAGE] = 7
            assert c.put([b"k" * 16], torch.tensor([0])).stored == 1
            handle = c.get([b"k" * 16], torch.tensor([1]))
            assert handle._source is not None and handle._source.spin() == c.lane.spin < c.lane.load_spin
            handle.wait()
            assert handle.pages() == 1
            assert (pool.buffers[0][0].view(torch.int16)[PAGE:2 * PAGE] == 7).all()
    finally:
        d.stop()


def test_a_call_refused_before_its_submit_gives_its_slot_back_and_the_lane_still_closes() -> None:
    """Never submitted, the slot is not the daemon's: it comes back at once, not abandoned."""
    with pytest.raises(ValueError, match="spin"):
        lane_mod.ClientLane.standalone(slots=1, spin=0.02)
    lane = lane_mod.ClientLane.standalone(slots=1)
    lane.spin = 0.02  # set after: a spin the compiled wait refuses, before the slot is touched
    with pytest.raises(ValueError, match="spin"):
        lane.unary("WriteB", b"x", 1.0)
    assert lane._users == 0 and lane._free == [0] and not lane._abandoned
    assert R.U32.unpack_from(lane._mm, R.slot_offset(0) + R.STATE)[0] == R.FREE
    lane.close()
    assert lane._released


def test_a_signal_during_the_spin_runs_its_handler_before_the_wait_sleeps() -> None:
    import signal

    class Alarm(Exception):
        pass

    def raise_alarm(signum, frame):
        raise Alarm

    lane = lane_mod.ClientLane.standalone(slots=1, spin=0.005)  # no daemon: the slot is never answered
    old = signal.signal(signal.SIGALRM, raise_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001)  # lands during the 5 ms spin
        t = time.monotonic()
        with pytest.raises(Alarm):
            lane.unary("WriteB", b"x", 5.0)
        assert time.monotonic() - t < 1.0, "the handler waited for the call's deadline"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        lane.close()


def test_the_plane_looks_unrung_only_at_a_few_lanes(socket_dir) -> None:
    """Past 256 watched slots (33 lanes of 8) a look at every slot would be long: the plane stops
    saying it is awake, and everyone rings; below it again, it says so again."""
    d = plane_daemon(socket_dir, 0.005, host_memory=80 << 20)  # a 2 MiB region each
    clients: list[KVClient] = []
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool:
            for _ in range(33):
                clients.append(client(d, pool))
            c = clients[0]
            host, dev = c.alloc(PAGE), torch.arange(PAGE)

            def seen_awake() -> int:
                n = 0
                for _ in range(30):
                    c.write(host_indices=host, device_indices=dev)
                    n += awake(c.lane)
                return n

            assert seen_awake() == 0
            for other in clients[-2:]:
                other.close()
            del clients[-2:]
            wait_until(lambda: seen_awake() > 0, 10, "the plane to look unrung again at 31 lanes")
    finally:
        for c in clients:
            c.close()
        d.stop()


@contextlib.contextmanager
def _bare_engine() -> Iterator[tuple[Any, Any, np.ndarray, int, list[int]]]:
    """A data plane's engine of its own (no daemon): (engine, a gate, a 2-slot ring, a submit
    doorbell's fd, its done doorbells' fds); stopped, and the doorbells closed, after."""
    from kvserver.lane.plane import _kvlane

    if _kvlane is None:
        pytest.skip("the compiled data plane is not built")
    engine = _kvlane.Engine(0.0, [], 0.0)
    ring = np.zeros(R.HEADER_BYTES + 2 * R.SLOT_BYTES, np.uint8)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        yield engine, _kvlane.space_gate(), ring, pairs[0][0].fileno(), [p[0].fileno() for p in pairs[1:]]
    finally:
        engine.stop()
        for a, b in pairs:
            a.close()
            b.close()


def _add(engine: Any, key: int, gate: Any, ring: np.ndarray, submit: int, done: list[int]) -> int:
    """A lane made and watched, as DataPlane.add has it (there, watched on its command thread)."""
    handle = engine.new_lane(key, gate, ring.ctypes.data, 2, submit, done, False)
    engine.watch_lane(handle)
    return handle


def test_a_lane_whose_doorbell_the_plane_cannot_watch_is_refused_and_never_taken() -> None:
    """epoll refusing a lane's submit doorbell (ENOMEM or ENOSPC on a node at its watch limit, which
    cannot be made here without starving every other test; a regular file gives EPERM at the same
    call) made a lane the plane kept but was never rung for: its calls waited for their timeouts.
    Now the plane takes no such lane and says why, and goes on serving the lanes it can watch."""
    with _bare_engine() as (engine, gate, ring, submit, done), tempfile.TemporaryFile() as not_pollable:
        with pytest.raises(OSError) as refused:
            _add(engine, 1, gate, ring, not_pollable.fileno(), done)
        assert refused.value.errno == errno.EPERM
        assert not ring.any(), "the refused lane's ring was written"
        with pytest.raises(KeyError):  # not among the plane's lanes
            engine.remove_lane(1)
        engine.remove_lane(_add(engine, 2, gate, ring, submit, done))


def test_the_plane_s_thread_watches_no_lane_after_the_stop_s_unwatching() -> None:
    """After unwatch_all (the daemon's stop) the thread refuses to watch a lane (ESHUTDOWN: an
    opening that waited behind it), frees it, and new_lane's handle names nothing any more."""
    with _bare_engine() as (engine, gate, ring, submit, done):
        handle = engine.new_lane(1, gate, ring.ctypes.data, 2, submit, done, False)
        engine.unwatch_all()
        with pytest.raises(OSError) as refused:
            engine.watch_lane(handle)
        assert refused.value.errno == errno.ESHUTDOWN
        assert not ring.any(), "the refused lane's ring was written"
        with pytest.raises(KeyError):
            engine.watch_lane(handle)
        with pytest.raises(KeyError):
            engine.remove_lane(handle)


def test_a_waiter_for_a_loads_end_is_rung_at_its_end_only(socket_dir) -> None:
    """A load's waiter that sleeps for its end (a handle's wait()) was rung at every progress
    interval, each a system call for the plane and a wake-up for the engine, for nothing (about 3%
    of a 64 MiB load here). It now says so in its waiting word (2), and the plane rings it only at
    the end; a waiter for a layer still says 1, and is rung as its layers land."""
    d = plane_daemon(socket_dir, 0.0)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            host, dev = c.alloc(TOKENS), torch.arange(TOKENS)
            pool.buffers[0][0].view(torch.uint8).fill_(7)
            c.write(host_indices=host, device_indices=dev)
            c.lane.spin = c.lane.load_spin = 0.0  # it sleeps at once
            for how, word in (("end", 2), ("layer", 1)):
                pool.buffers[0][0].view(torch.uint8).zero_()
                d.core.plane.engine.pause(True)  # the load waits: its waiter sleeps
                try:
                    h = c.load(host_indices=host, device_indices=dev)
                    slot = h._source.slot
                    waiter = threading.Thread(target=h.wait if how == "end" else
                                              (lambda h=h: h.wait_layer(LAYERS - 1, timeout=10)))
                    waiter.start()
                    at = R.slot_offset(slot) + R.WAITING_AT
                    wait_until(lambda at=at: R.U32.unpack_from(c.lane._mm, at)[0] != 0, 5,
                               "the waiter asleep")
                    assert R.U32.unpack_from(c.lane._mm, at)[0] == word, how
                finally:
                    d.core.plane.engine.pause(False)
                waiter.join(10)
                assert not waiter.is_alive()
                assert h.wait(timeout=10) > 0 and bool((pool.buffers[0][0].view(torch.uint8) == 7).all())
            # A waiter for the end, then another thread's for a layer: the steps are rung again
            # (the first waiter, in slices of END_SLICE, pumps step by step while another waits).
            d.core.plane.engine.pause(True)
            try:
                h = c.load(host_indices=host, device_indices=dev)
                at = R.slot_offset(h._source.slot) + R.WAITING_AT
                first = threading.Thread(target=h.wait)
                first.start()
                wait_until(lambda: R.U32.unpack_from(c.lane._mm, at)[0] == 2, 5, "the end's waiter asleep")
                second = threading.Thread(target=lambda: h.wait_layer(0, timeout=10))
                second.start()
                wait_until(lambda: R.U32.unpack_from(c.lane._mm, at)[0] == 1, 1,
                           "a waiter for the steps again once a layer's waiter came")
            finally:
                d.core.plane.engine.pause(False)
            for t in (first, second):
                t.join(10)
                assert not t.is_alive()
    finally:
        d.stop()
