"""A unary lane call in one compiled call (``_wire.call``: submit, wait, answer), and the client's
Write and Load sent on the lane without the Op a call is planned as (docs/lane.md, "One compiled
call"). The compiled call is driven on a client's own ring, a thread standing in for the daemon
where its timing must be chosen; the client's calls run against a real daemon."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
import torch
from checks import wait_until
from test_lane_ahead import answer, daemon_end, word
from test_lane_doorbells import DTYPE, LAYERS, LAYOUT, PAGE, TOKENS, client, plane_daemon

from kvclient import KVClient, KVClientError, ShmKVPool
from kvclient._transport import lane as lane_mod
from kvclient.core import ClientCore
from kvserver.protocol import ring as R

wire = pytest.importorskip("kvserver.protocol._wire", reason="the compiled client calls are not built")
# How a waiter spins, rings and is rung, whatever else the CPUs run meanwhile.
pytestmark = pytest.mark.usefixtures("spins_kept")

WRITE_B = R.RPC_IDS["WriteB"]


def test_one_call_submits_waits_and_reads_the_answer() -> None:
    lane = lane_mod.ClientLane.standalone(slots=2)
    try:
        R.U32.pack_into(lane._mm, R.slot_offset(1) + R.BUSY_AT, 99)  # a last call's: cleared at submit
        doorbell = daemon_end(lane, 0)
        t = answer(lane, 1, response=b"\x08\x40", busy=1234, flags=R.FLAG_DONE, after=0.05)
        got = wire.call(lane._address, 1, WRITE_B, 77, b"request", lane._submit_fd, lane._done_fds[1], 0.0,
                        time.monotonic() + 30, 0.0)
        t.join()
        assert got == (0, b"\x08\x40", b"", R.FLAG_DONE, 1234, 1)  # asleep (no spin) when it came
        off = R.slot_offset(1)
        assert R.CALL.unpack_from(lane._mm, off + R.RPC_AT) == (WRITE_B, 77, 7)
        assert bytes(lane._mm[off + R.REQUEST_AT: off + R.REQUEST_AT + 7]) == b"request"
        assert word(lane, 1, R.WAITING_AT) == 0
        assert doorbell.recv(16) == b"s"  # no plane looks at the slots unrung here: the submit rang
        doorbell.close()
    finally:
        lane.close()


def test_one_call_answers_an_error_unrung_and_ends_at_its_deadline_or_a_closed_doorbell() -> None:
    lane = lane_mod.ClientLane.standalone(slots=2)
    try:
        # Left unrung while the caller looks (its spin): seen without the doorbell. An answer
        # that came after the spin (a busy machine) is rung, as the daemon rings a sleeper; one
        # of a few tries must have been seen unrung.
        rang: list[bool] = []
        for seq in range(1, 6):
            t = answer(lane, 0, code=5, message=b"no such pages", ring=None, rang=rang)
            t0 = time.monotonic()
            got = wire.call(lane._address, 0, WRITE_B, seq, b"x", lane._submit_fd, lane._done_fds[0], 0.01,
                            t0 + 20, 0.0)
            t.join()
            # Slept: it was asleep when the answer came (rung), not looking (seen unrung).
            assert got == (5, b"", b"no such pages", 0, 0, int(rang[-1])) and time.monotonic() - t0 < 10
            R.U32.pack_into(lane._mm, R.slot_offset(0) + R.STATE, R.FREE)
            if not rang[-1]:
                break
        assert not rang[-1], "the spin never saw an unrung answer"
        t0 = time.monotonic()
        got = wire.call(lane._address, 0, WRITE_B, 9, b"x", lane._submit_fd, lane._done_fds[0], 0.0,
                        t0 + 0.05, 0.0)
        assert got == lane_mod._TIMEOUT and 0.05 <= time.monotonic() - t0 < 5
        end = daemon_end(lane, 2)
        lane.handed_over()  # only the daemon's end (here: ours) keeps slot 1's doorbell open
        threading.Timer(0.02, end.close).start()
        t0 = time.monotonic()
        got = wire.call(lane._address, 1, WRITE_B, 3, b"x", lane._submit_fd, lane._done_fds[1], 0.0,
                        t0 + 30, t0 + 20)  # napping: the closed doorbell ends the nap too
        assert got == lane_mod._CLOSED and time.monotonic() - t0 < 5
    finally:
        lane.close()


def test_one_call_refuses_what_it_cannot_send_before_touching_the_slot() -> None:
    lane = lane_mod.ClientLane.standalone(slots=2)
    try:
        now, big = time.monotonic(), b"x" * (R.REQUEST_BYTES + 1)

        def args(slot=0, data=b"x", spin=0.0, deadline=now + 1, nap=0.0):
            fds = lane._submit_fd, lane._done_fds[0]
            return lane._address, slot, WRITE_B, 1, data, *fds, spin, deadline, nap

        bad = [(args(slot=2), "no such slot"), (args(slot=-1), "no such slot"),
               (args(data=big), "larger than a slot"), (args(spin=0.02), "spin must be"),
               (args(deadline=float("nan")), "spin must be"), (args(nap=float("inf")), "spin must be")]
        for given, match in bad:
            with pytest.raises(ValueError, match=match):
                wire.call(*given)
        assert word(lane, 0, R.STATE) == R.FREE and word(lane, 1, R.STATE) == R.FREE
        assert R.CALL.unpack_from(lane._mm, R.slot_offset(0) + R.RPC_AT) == (0, 0, 0)
    finally:
        lane.close()


def test_a_signal_that_raises_during_a_unary_call_abandons_its_slot() -> None:
    """The slot was submitted: the daemon may still answer it, so it is not reused until DONE."""

    class Alarm(Exception):
        pass

    def handler(signum, frame):
        raise Alarm

    lane = lane_mod.ClientLane.standalone(slots=1)  # no daemon: never answered
    old = signal.signal(signal.SIGALRM, handler)
    main = threading.main_thread().ident

    def alarm_once_asleep() -> None:  # the signal comes while the call sleeps on its doorbell
        deadline = time.monotonic() + 20
        while not word(lane, 0, R.WAITING_AT) and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGALRM)

    try:
        threading.Thread(target=alarm_once_asleep, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(Alarm):
            lane.unary("WriteB", b"x", 30.0)
        assert time.monotonic() - t0 < 20
        assert lane._abandoned == {0} and not lane._free and lane._users == 0
        assert lane.unary("WriteB", b"x", 1.0) is None  # no free slot: the caller takes gRPC
    finally:
        signal.signal(signal.SIGALRM, old)
        lane.close()


def test_a_stream_whose_submit_raises_gives_its_slot_back_and_the_lane_still_closes(monkeypatch) -> None:
    class Interrupted(Exception):
        pass

    def interrupted(*args):
        raise Interrupted

    lane = lane_mod.ClientLane.standalone(slots=1)
    monkeypatch.setattr(lane, "_put", interrupted)  # as a signal's handler raising before the submit
    with pytest.raises(Interrupted):
        lane.stream("LoadB", b"x", 1.0)
    assert lane._free == [0] and not lane._abandoned and not lane._streams and lane._users == 0
    lane.close()
    assert lane._released


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_lane_writes_and_loads_plan_no_op(socket_dir, monkeypatch, compiled) -> None:
    """A Write or Load sent on the lane builds neither its Op nor its protobuf request, whether
    it is served or refused; indices that are not whole pages go as the planned protobuf call."""
    if not compiled:
        monkeypatch.setattr(lane_mod, "_wire", None)
    planned = []
    for name in ("write", "load"):
        real = getattr(ClientCore, name)

        def counted(self, *args, _real=real, _name=name):
            planned.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(ClientCore, name, counted)
    d = plane_daemon(socket_dir, 0.0001)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, client(d, pool) as c:
            assert (c.lane._c is not None) == compiled
            host, dev = c.alloc(2 * PAGE), torch.arange(2 * PAGE)
            calls = c.lane.calls
            assert c.write(host_indices=host, device_indices=dev, layers=iter([0])) > 0
            assert c.load(host_indices=host, device_indices=dev, layers=iter([0])).wait() > 0
            # Refused by the daemon (a layer outside the registration): raised, not a miss.
            for call in (lambda: c.write(host_indices=host, device_indices=dev, layers=[LAYERS]),
                         lambda: c.load(host_indices=host, device_indices=dev, layers=[LAYERS]).wait()):
                with pytest.raises(KVClientError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
            assert c.lane.calls == calls + 4 and planned == [] and c.misses == 0
            # Host indices that are not whole pages: the planned call, whose answer says so.
            for call in (lambda: c.write(host_indices=host[1:PAGE + 1], device_indices=dev[:PAGE]),
                         lambda: c.load(host_indices=host[1:PAGE + 1], device_indices=dev[:PAGE]).wait()):
                with pytest.raises(KVClientError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert planned == ["write", "load"]
            # No slot free: the planned call on gRPC, its layers still those an iterator gave.
            monkeypatch.setattr(c.lane, "_take", lambda data: None)
            one = c.write(host_indices=host, device_indices=dev, layers=[0])
            assert c.write(host_indices=host, device_indices=dev, layers=iter([1])) == one
            assert c.load(host_indices=host, device_indices=dev, layers=(x for x in [1])).wait() == one
            assert planned == ["write", "load", "write", "write", "load"]
    finally:
        d.stop()


def test_lane_writes_and_loads_fail_as_planned_calls_do(socket_dir, monkeypatch) -> None:
    """The failures of a Write or Load sent on the lane in its binary format are judged as any
    call's: a deadline is a miss once the job is confirmed stopped, and a closed lane is a miss
    whose registration is made again; the engine keeps serving."""
    d = plane_daemon(socket_dir, 0.0001)
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=5) as c:
            c.register(model="calls", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                       host_tokens=TOKENS, page_size=PAGE)
            dev = torch.arange(PAGE)
            confirmed, real_confirm = [], c._confirm_stopped
            monkeypatch.setattr(c, "_confirm_stopped", lambda reg: confirmed.append(reg) or real_confirm(reg))

            def deadline(*args):
                raise KVClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane call deadline exceeded")

            lane, first, host = c.lane, c._core.registration, c.alloc(PAGE)
            monkeypatch.setattr(lane, "unary", deadline)
            assert c.write(host_indices=host, device_indices=dev) == 0
            assert confirmed == [first] and c.misses == 1  # confirmed stopped: then registered anew
            wait_until(lambda: c.lane is not None and c.lane is not lane, 10, "a lane of a new registration")
            lane, host = c.lane, c.alloc(PAGE)
            monkeypatch.setattr(lane, "_put", lambda *args: None)  # never submitted: never answered
            monkeypatch.setattr(lane, "_wait", lambda *args, **kwargs: lane_mod._CLOSED)
            handle = c.load(host_indices=host, device_indices=dev)
            assert handle.wait() == 0 and handle.missed and c.misses == 2 and confirmed == [first]
            assert lane._abandoned == set() and len(lane._free) == lane.slots  # the slot came back
            wait_until(lambda: c.lane is not None and c.lane is not lane, 10, "a lane of a new registration")
            host = c.alloc(PAGE)
            assert c.write(host_indices=host, device_indices=dev) > 0
            assert c.load(host_indices=host, device_indices=dev).wait() > 0
    finally:
        d.stop()
