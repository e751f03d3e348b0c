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
from test_lane_ahead import daemon_end
from test_lane_doorbells import DTYPE, LAYERS, LAYOUT, PAGE, TOKENS, plane_daemon

from kvclient import KVClient, KVClientError, ShmKVPool
from kvclient._transport import lane as lane_mod
from kvclient.core import ClientCore
from kvserver.protocol import ring as R

wire = pytest.importorskip("kvserver.protocol._wire", reason="the compiled client calls are not built")

WRITE_B = R.RPC_IDS["WriteB"]


def word(lane: lane_mod.ClientLane, slot: int, at: int) -> int:
    return R.U32.unpack_from(lane._mm, R.slot_offset(slot) + at)[0]


def answer(lane: lane_mod.ClientLane, slot: int, code: int = 0, response: bytes = b"", message: bytes = b"",
           busy: int = 0, flags: int = 0, ring: bool = True, after: float = 0.0) -> threading.Thread:
    """Answers ``slot`` as the daemon would once it is SUBMITTED: its result, busy and flags words,
    DONE (release order is moot in one process), then its done doorbell if ``ring``."""
    end = daemon_end(lane, 1 + slot)
    off = R.slot_offset(slot)

    def run() -> None:
        deadline = time.monotonic() + 30
        while word(lane, slot, R.STATE) != R.SUBMITTED and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(after)
        mm = lane._mm
        mm[off + R.RESPONSE_AT: off + R.RESPONSE_AT + len(response)] = response
        mm[off + R.ERROR_AT: off + R.ERROR_AT + len(message)] = message
        R.RESULT.pack_into(mm, off + R.CODE_AT, code, len(response), len(message))
        R.U32.pack_into(mm, off + R.PROGRESS_AT + 28, flags)
        R.U32.pack_into(mm, off + R.BUSY_AT, busy)
        R.U32.pack_into(mm, off + R.STATE, R.DONE)
        if ring:
            end.send(b"d")
        end.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_one_call_submits_waits_and_reads_the_answer() -> None:
    lane = lane_mod.ClientLane(slots=2)
    try:
        R.U32.pack_into(lane._mm, R.slot_offset(1) + R.BUSY_AT, 99)  # a last call's: cleared at submit
        doorbell = daemon_end(lane, 0)
        t = answer(lane, 1, response=b"\x08\x40", busy=1234, flags=R.FLAG_DONE, after=0.05)
        got = wire.call(lane._address, 1, WRITE_B, 77, b"request", lane._submit_fd, lane._done_fds[1], 0.0,
                        time.monotonic() + 30, 0.0)
        t.join()
        assert got == (0, b"\x08\x40", b"", R.FLAG_DONE, 1234)
        off = R.slot_offset(1)
        assert R.CALL.unpack_from(lane._mm, off + R.RPC_AT) == (WRITE_B, 77, 7)
        assert bytes(lane._mm[off + R.REQUEST_AT: off + R.REQUEST_AT + 7]) == b"request"
        assert word(lane, 1, R.WAITING_AT) == 0
        assert doorbell.recv(16) == b"s"  # no plane looks at the slots unrung here: the submit rang
        doorbell.close()
    finally:
        lane.close()


def test_one_call_answers_an_error_unrung_and_ends_at_its_deadline_or_a_closed_doorbell() -> None:
    lane = lane_mod.ClientLane(slots=2)
    try:
        # Left unrung while the caller looks (its spin): seen without the doorbell.
        t = answer(lane, 0, code=5, message=b"no such pages", ring=False)
        got = wire.call(lane._address, 0, WRITE_B, 1, b"x", lane._submit_fd, lane._done_fds[0], 0.01,
                        time.monotonic() + 30, 0.0)
        t.join()
        assert got == (5, b"", b"no such pages", 0, 0)
        R.U32.pack_into(lane._mm, R.slot_offset(0) + R.STATE, R.FREE)
        t0 = time.monotonic()
        got = wire.call(lane._address, 0, WRITE_B, 2, b"x", lane._submit_fd, lane._done_fds[0], 0.0,
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
    lane = lane_mod.ClientLane(slots=2)
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

    lane = lane_mod.ClientLane(slots=1)  # no daemon: never answered
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        t0 = time.monotonic()
        with pytest.raises(Alarm):
            lane.unary("WriteB", b"x", 30.0)
        assert time.monotonic() - t0 < 10
        assert lane._abandoned == {0} and not lane._free and lane._users == 0
        assert lane.unary("WriteB", b"x", 1.0) is None  # no free slot: the caller takes gRPC
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        lane.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_lane_writes_and_loads_plan_no_op_unless_they_fail(socket_dir, monkeypatch, compiled) -> None:
    """A Write or Load sent on the lane builds neither its Op nor its protobuf request; one the
    daemon refuses fails as it does on gRPC, and one whose daemon is gone is a miss."""
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
    stopped = False
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=5) as c:
            c.register(model="calls", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                       host_tokens=TOKENS, page_size=PAGE)
            assert (c.lane._c is not None) == compiled
            host, dev = c.alloc(PAGE), torch.arange(PAGE)
            calls = c.lane.calls
            assert c.write(host_indices=host, device_indices=dev) > 0
            assert c.load(host_indices=host, device_indices=dev).wait() > 0
            assert c.lane.calls == calls + 2 and planned == []
            # Refused by the daemon (a layer outside the registration): raised, not a miss.
            for call in (lambda: c.write(host_indices=host, device_indices=dev, layers=[LAYERS]),
                         lambda: c.load(host_indices=host, device_indices=dev, layers=[LAYERS]).wait()):
                with pytest.raises(KVClientError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
            assert planned == ["write", "load"] and c.misses == 0
            # The daemon gone: a miss each, as on gRPC (the lane closes with it).
            d.stop()
            stopped = True
            assert c.write(host_indices=host, device_indices=dev) == 0
            handle = c.load(host_indices=host, device_indices=dev)
            assert handle.wait() == 0 and handle.missed
            assert c.misses >= 2
    finally:
        if not stopped:
            d.stop()
