"""A lane call rings a sleeping data plane ahead of its request, and a long Write naps until just
before its expected end (docs/lane.md, "Ringing ahead" and "Napping through a long write"). Real
daemon, real client, real shared memory; the compiled wait is driven directly on a client's own
ring where a daemon's timing cannot be chosen."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
from checks import wait_until
from conftest import DaemonThread
from test_lane_doorbells import DTYPE, LAYERS, LAYOUT, PAGE, TOKENS, awake, client, pending, plane_daemon

from kvclient import KVClient, ShmKVPool
from kvclient._transport import lane as lane_mod
from kvserver.config import ServerConfig
from kvserver.protocol import ring as R

wire = pytest.importorskip("kvserver.protocol._wire", reason="the compiled client calls are not built")
# How a waiter spins, rings and is rung, whatever else the CPUs run meanwhile.
pytestmark = pytest.mark.usefixtures("spins_kept")


def plane_word(lane: lane_mod.ClientLane) -> int:
    return R.U32.unpack_from(lane._mm, R.PLANE_AT)[0]


def busy_word(lane: lane_mod.ClientLane, slot: int) -> int:
    return R.U32.unpack_from(lane._mm, R.slot_offset(slot) + R.BUSY_AT)[0]


def daemon_end(lane: lane_mod.ClientLane, which: int) -> socket.socket:
    """The daemon's end of doorbell ``which`` (0: submit, 1 + i: slot i's done), as the daemon holds it."""
    s = socket.socket(fileno=os.dup(lane.daemon_fds()[1 + which]))
    s.setblocking(False)
    return s


@pytest.mark.parametrize("compiled", [True, False])
def test_a_nudge_rings_only_a_plane_that_reads_the_doorbell_and_sleeps(compiled, monkeypatch) -> None:
    lane = lane_mod.ClientLane.standalone(slots=2)
    if not compiled:
        monkeypatch.setattr(lane, "_c", None)
    try:
        end = daemon_end(lane, 0)
        lane.nudge()
        assert pending(end) == 0  # no plane reads it (a daemon without one: the loop would scan)
        R.U32.pack_into(lane._mm, R.PLANE_AT, R.PLANE_RUNNING)
        lane.nudge()
        assert pending(end) == 0  # it runs (copies, looks, serves): it reads the doorbell anyway
        R.U32.pack_into(lane._mm, R.PLANE_AT, R.PLANE_ASLEEP)
        lane.nudge()
        assert pending(end) == 1  # asleep: rung
        lane.close()
        lane.nudge()  # closed: nothing, and no error
        end.close()
    finally:
        lane.close()


def test_the_plane_says_it_reads_a_lane_and_wakes_for_a_nudge(socket_dir) -> None:
    d = plane_daemon(socket_dir, 0.01)  # looks for 10 ms (the most) after each doorbell or copy
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            lane = c.lane
            assert plane_word(lane) in (R.PLANE_ASLEEP, R.PLANE_RUNNING)
            seen = 0
            for _ in range(20):  # looked for within 5 ms of the nudge (a busy CI may miss some)
                wait_until(lambda: plane_word(lane) == R.PLANE_ASLEEP, 2, "the plane to sleep")
                assert awake(lane) == 0
                lane.nudge()  # it wakes, then looks at the slots for its spin
                until = time.monotonic() + 0.005
                while not awake(lane) and time.monotonic() < until:
                    pass
                seen += awake(lane) and plane_word(lane) == R.PLANE_RUNNING
            assert seen > 0, "the plane never woke for a nudge"
            wait_until(lambda: plane_word(lane) == R.PLANE_ASLEEP, 2, "the plane to sleep again")
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            c.write(host_indices=host, device_indices=dev)  # a nudged call is served as any other
            assert d.core.plane.engine.served >= 1
            # Calls back to back find it running, and ring nothing ahead.
            rung = []
            real = wire.nudge
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(lane, "_c", _Nudges(real, rung))
                for _ in range(20):
                    c.write(host_indices=host, device_indices=dev)
                    c.load(host_indices=host, device_indices=dev).wait()
            # A call more than the spin after the last (a slow machine) finds it asleep: rare.
            assert len(rung) == 40 and sum(rung) <= len(rung) // 4, rung
    finally:
        d.stop()


def test_the_plane_unwatching_a_lane_clears_its_plane_word(socket_dir) -> None:
    d = plane_daemon(socket_dir, 0.0)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            assert plane_word(c.lane) in (R.PLANE_ASLEEP, R.PLANE_RUNNING)
            d.core.plane.engine.unwatch_all()
            assert plane_word(c.lane) == 0
            time.sleep(0.03)  # the plane sleeps again meanwhile: an unwatched lane's word stays 0
            assert plane_word(c.lane) == 0
    finally:
        d.stop()


def test_the_plane_thread_clears_its_words_as_it_stops(socket_dir) -> None:
    """Stopped with a lane still watched (the daemon's shutdown, after its drain), the thread's
    last act says so in that lane: no plane reads it, none looks at its slots."""
    d = plane_daemon(socket_dir, 0.01)  # looks for 10 ms after each call: the words are set
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            lane = c.lane
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            c.write(host_indices=host, device_indices=dev)
            assert plane_word(lane) in (R.PLANE_ASLEEP, R.PLANE_RUNNING)
            d.core.plane.stop()
            assert plane_word(lane) == 0 and awake(lane) == 0
    finally:
        d.stop()


def test_a_plane_write_says_how_long_it_took_and_the_client_learns_its_pace(socket_dir) -> None:
    d = plane_daemon(socket_dir, 0.0)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            lane = c.lane
            host, dev = c.alloc(4 * PAGE), torch.arange(4 * PAGE)
            assert lane.write_pace is None
            for _ in range(3):
                c.write(host_indices=host, device_indices=dev)
            busy = [busy_word(lane, i) for i in range(lane.slots)]
            assert max(busy) > 0  # microseconds, of at least one slot's last write
            assert lane.write_pace is not None and 0 < lane.write_pace < 1.0 / (4 * LAYERS)
            # A Lookup's slot (the client's first, which the event loop answers: the plane serves the
            # next ones) says nothing: the submit cleared the word.
            for i in range(lane.slots):
                R.U32.pack_into(lane._mm, R.slot_offset(i) + R.BUSY_AT, 12345)
            c.lookup([b"k" * 16])
            assert 12345 in [busy_word(lane, i) for i in range(lane.slots)]
            assert 0 in [busy_word(lane, i) for i in range(lane.slots)]
    finally:
        d.stop()


def test_a_write_naps_only_when_its_expected_copy_is_long() -> None:
    lane = lane_mod.ClientLane.standalone(slots=1)
    try:
        lane.reg = type("Reg", (), {"start_layer": 4, "end_layer": 8})()
        data = lane_mod._COUNTS.pack(3, 3, 0).rjust(24, b"\0") + b"\0" * 16  # 3 pages, every layer
        units = lane._write_units(data)
        assert units == 3 * 4
        assert lane._nap(100.0, units) == (0.0, None)  # nothing learned yet
        lane._learn(units, 0)
        assert lane.write_pace is None  # 0: not the plane's copy
        lane._learn(units, 12_000)  # 12 ms for 12 (page, layer)s
        assert lane.write_pace == pytest.approx(1e-3)
        nap, spin = lane._nap(100.0, units)
        assert nap == pytest.approx(100.0 + 12e-3 - lane.nap_lead)
        assert spin == pytest.approx(min(5 * lane.nap_lead, lane.nap_lead + 12e-3 / 8))
        lane.nap_lead = 1e-3
        assert lane._nap(100.0, units)[1] == pytest.approx(1e-3 + 12e-3 / 8)  # under five leads
        lane.nap_lead = lane_mod.NAP_LEAD_SECONDS
        pace, lane.write_pace = lane.write_pace, 2.5e-4
        assert lane._nap(100.0, 1) == (0.0, None)  # 250 us: under NAP_MIN_SECONDS, it spins
        lane.nap_lead, lane.write_pace = 2e-4, 3.5e-4
        assert lane._nap(100.0, 1) == (0.0, None)  # 350 us: under two leads
        assert lane._nap(100.0, 2)[0] == pytest.approx(100.0 + 7e-4 - 2e-4)
        lane.nap_lead, lane.write_pace = lane_mod.NAP_LEAD_SECONDS, pace
        # The estimate is the least of the last PACE_WRITES paces: a slow copy does not lengthen
        # the next nap, a faster one shortens it at once, and a slow spell takes over once the fast
        # pace is that many answers old.
        lane._learn(units, 24_000)
        assert lane.write_pace == pytest.approx(1e-3)
        lane._learn(units, 6_000)
        assert lane.write_pace == pytest.approx(0.5e-3)
        for _ in range(lane_mod.PACE_WRITES - 1):
            lane._learn(units, 24_000)
        assert lane.write_pace == pytest.approx(0.5e-3)
        lane._learn(units, 18_000)
        assert lane.write_pace == pytest.approx(1.5e-3)
        lane.nap_lead = 0.0
        assert lane._nap(100.0, units) == (0.0, None)  # napping off
    finally:
        lane.close()


def word(lane: lane_mod.ClientLane, slot: int, at: int) -> int:
    return R.U32.unpack_from(lane._mm, R.slot_offset(slot) + at)[0]


def answer(lane: lane_mod.ClientLane, slot: int, code: int = 0, response: bytes = b"", message: bytes = b"",
           busy: int = 0, flags: int = 0, ring: bool | None = True, after: float = 0.0,
           rang: list[bool] | None = None, when_asleep: bool = False) -> threading.Thread:
    """Answers ``slot`` as the daemon would once it is SUBMITTED (``when_asleep``: once its caller
    says it sleeps there, its waiting word): its result, busy and flags words, DONE (release order
    is moot in one process), then its done doorbell if ``ring``; ``ring`` None: only if the caller
    sleeps by then, as a quiet lane's daemon does, noted in ``rang``."""
    end = daemon_end(lane, 1 + slot)
    off = R.slot_offset(slot)

    def run() -> None:
        nonlocal ring
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if word(lane, slot, R.WAITING_AT) if when_asleep else word(lane, slot, R.STATE) == R.SUBMITTED:
                break
            time.sleep(0.0005)
        time.sleep(after)
        mm = lane._mm
        mm[off + R.RESPONSE_AT: off + R.RESPONSE_AT + len(response)] = response
        mm[off + R.ERROR_AT: off + R.ERROR_AT + len(message)] = message
        R.RESULT.pack_into(mm, off + R.CODE_AT, code, len(response), len(message))
        R.U32.pack_into(mm, off + R.PROGRESS_AT + 28, flags)
        R.U32.pack_into(mm, off + R.BUSY_AT, busy)
        R.U32.pack_into(mm, off + R.STATE, R.DONE)
        if ring is None:
            ring = bool(word(lane, slot, R.WAITING_AT))
        if rang is not None:
            rang.append(ring)
        if ring:
            end.send(b"d")
        end.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _submitted(lane: lane_mod.ClientLane) -> int:
    i = lane._begin("WriteB", b"x")
    assert i is not None
    return i


def test_a_napping_wait_wakes_when_rung_before_its_nap_ends() -> None:
    lane = lane_mod.ClientLane.standalone(slots=1)
    try:
        i = _submitted(lane)
        t = answer(lane, i, ring=True, when_asleep=True)
        t0 = time.monotonic()
        got = lane._wait(i, t0 + 60, spin=0.0, nap=t0 + 30)
        took = time.monotonic() - t0
        t.join()
        assert got == lane_mod._OPEN and lane._state(i) == R.DONE
        assert took < 20, f"a rung nap should end at the answer, not at its end ({took:.3f} s)"
        assert R.U32.unpack_from(lane._mm, R.slot_offset(i) + R.WAITING_AT)[0] == 0
    finally:
        lane.close()


def test_a_napping_wait_looks_when_its_nap_ends() -> None:
    """An answer stored unrung while the client naps (as the plane leaves one for a client that
    says it looks) is seen once the nap ends; a wait that slept on the doorbell instead would
    reach its deadline."""
    lane = lane_mod.ClientLane.standalone(slots=1)
    try:
        i = _submitted(lane)
        t = answer(lane, i, ring=False, when_asleep=True)
        t0 = time.monotonic()
        got = lane._wait(i, t0 + 30, spin=0.01, nap=t0 + 0.3)
        took = time.monotonic() - t0
        t.join()
        assert got == lane_mod._OPEN and lane._state(i) == R.DONE
        assert 0.29 <= took < 10, took
    finally:
        lane.close()


def test_a_signal_during_a_nap_runs_its_handler_and_one_that_raises_ends_the_wait() -> None:
    import signal

    class Alarm(Exception):
        pass

    calls = []

    def handler(signum, frame):
        calls.append(time.monotonic())
        if len(calls) > 1:
            raise Alarm

    lane = lane_mod.ClientLane.standalone(slots=1)  # no daemon: the slot is never answered
    old = signal.signal(signal.SIGALRM, handler)
    try:
        i = _submitted(lane)
        signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)  # twice during the nap: the second raises
        t0 = time.monotonic()
        with pytest.raises(Alarm):
            lane._wait(i, t0 + 30, spin=0.0, nap=t0 + 20)
        assert len(calls) == 2 and time.monotonic() - t0 < 10, "the nap outlived its signals"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        lane.close()


def test_a_nap_never_outlasts_the_deadline_and_ends_at_a_closed_doorbell() -> None:
    lane = lane_mod.ClientLane.standalone(slots=1)
    try:
        i = _submitted(lane)
        t0 = time.monotonic()
        got = lane._wait(i, t0 + 0.05, spin=0.0, nap=t0 + 30)
        assert got == lane_mod._TIMEOUT and time.monotonic() - t0 < 5
        end = daemon_end(lane, 1 + i)
        lane.handed_over()  # only the daemon's end (here: ours) keeps the doorbell open
        threading.Timer(0.02, end.close).start()
        t0 = time.monotonic()
        got = lane._wait(i, t0 + 30, spin=0.0, nap=t0 + 20)
        assert got in (lane_mod._CLOSED, lane_mod._CUT) and time.monotonic() - t0 < 5
    finally:
        lane.close()


def test_long_writes_nap_and_are_answered_alike(socket_dir, monkeypatch) -> None:
    """With a learned pace, a Write long enough naps (asleep on its doorbell, so the plane rings it
    if it ends first) and gets the same answer; a lead of 0 never naps."""
    d = plane_daemon(socket_dir, 0.0, host_memory=256 << 20)
    tokens = 64 * PAGE
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, tokens) as pool:
            c = KVClient(d.address, timeout=5, resilient=False)
            c.register(model="naps", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                       host_tokens=tokens, page_size=PAGE)
            with c:
                lane = c.lane
                host, dev = c.alloc(tokens), torch.arange(tokens)
                pool.buffers[0][0].view(torch.int16).random_()
                naps = []
                real = lane._c

                class Recording:  # the compiled calls, with each unary call's nap recorded
                    def __getattr__(self, name):
                        return getattr(real, name)

                    def call(self, *args):
                        naps.append(args[9])
                        return real.call(*args)

                monkeypatch.setattr(lane, "_c", Recording())
                nbytes = c.write(host_indices=host, device_indices=dev)
                assert naps == [0.0]  # nothing learned yet
                lane.write_pace = 1.0  # a second per (page, layer): a long nap, rung at the answer
                lane.nap_lead = 1e-4
                # The plane holds its copy until the client sleeps in its nap (its waiting word):
                # the answer then comes while it sleeps, and the call says so.
                engine = d.core.plane.engine
                engine.pause(True)

                def release() -> None:
                    wait_until(lambda: any(word(lane, i, R.WAITING_AT) for i in range(lane.slots)), 10,
                               "the client napping")
                    engine.pause(False)

                releaser = threading.Thread(target=release)
                t0, woken = time.monotonic(), lane.woken
                releaser.start()
                try:
                    assert c.write(host_indices=host, device_indices=dev) == nbytes
                finally:
                    engine.pause(False)
                    releaser.join()
                assert naps[-1] > t0 + 10 and time.monotonic() - t0 < 5
                assert lane.woken == woken + 1  # asleep in its nap when the answer came
                assert lane.write_pace < 1.0  # learned from the answer
                lane.nap_lead = 0.0
                assert c.write(host_indices=host, device_indices=dev) == nbytes
                assert naps[-1] == 0.0
                back = torch.zeros_like(pool.buffers[0][0])
                pool.buffers[0][0].copy_(back)
                c.load(host_indices=host, device_indices=dev).wait()
                assert pool.buffers[0][0].view(torch.int16).any()  # what was written came back
    finally:
        d.stop()


def test_a_daemon_without_the_plane_does_not_invite_nudges(socket_dir, monkeypatch) -> None:
    """Its event loop reads the doorbell: a nudge there would only make it scan the slots."""
    from kvserver.lane import plane

    monkeypatch.setattr(plane, "ENABLED", False)  # as KVSERVER_DATA_PLANE=python at the daemon's start
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "noplane.sock"), host_memory=64 << 20))
    try:
        assert d.core.plane is None
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            assert plane_word(c.lane) == 0
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            assert c.write(host_indices=host, device_indices=dev) > 0
            assert busy_word(c.lane, 0) == 0 and c.lane.write_pace is None  # no plane, no pace
    finally:
        d.stop()



class _Nudges:
    """The compiled calls, with what each nudge rang recorded."""

    def __init__(self, real, rung: list) -> None:
        self._real, self._rung = real, rung

    def nudge(self, address: int, fd: int) -> bool:
        got = self._real(address, fd)
        self._rung.append(got)
        return got

    def __getattr__(self, name: str):
        return getattr(wire, name)
