"""A scheduler's lane of a KV space (docs/lane.md, "A space's lane") against the real daemon: a
CacheView's Lookups take it and answer as gRPC does; only a process of the space's tenant opens
one, for a space the daemon knows; it carries only that space's Lookups; it closes when its
process closes its end or dies, and at the daemon's stop, and the view opens a new one for the
space it opens again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest
import torch
from checks import error_of, wait_until
from daemon_proc import DaemonProcess
from test_lane import OPEN_LANE, RawRing, lane_maps

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool, view_lane
from kvclient.keys import page_keys
from kvserver.protocol import ring as R
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

LAYOUT, DTYPE, LAYERS, PAGE, TOKENS = KVLayout.mha(2, 8), torch.float16, 4, 16, 256
MODEL = "view-lane"
KEYS = page_keys(range(3 * PAGE), PAGE)  # three 16-byte keys


def view(address: str, **kw) -> CacheView:
    return CacheView(address, model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=LAYERS,
                     **kw)


def store_two(engine: KVClient, pool: ShmKVPool) -> None:
    engine.register(model=MODEL, pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS, host_tokens=0,
                    page_size=PAGE)
    assert engine.put(KEYS[:32], [0, 1]).stored == 2


def books(daemon) -> tuple[int, dict, dict]:
    lanes = daemon.daemon.servicer.lanes
    return daemon.run(lambda: (len(lanes.space_lanes), dict(lanes._fds_per_uid),
                               dict(lanes._space_lanes_per_uid)))


def test_a_views_lookups_take_its_spaces_lane_and_answer_as_grpc(daemon) -> None:
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as engine, \
            view(daemon.address) as v, view(daemon.address, lane="grpc") as g:
        store_two(engine, pool)
        _, engine_fds, _ = books(daemon)
        assert v.lane is None  # opened on the first Lookup
        found = v.lookup(KEYS, pin_ms=5000)
        lane = v.lane
        assert lane is not None and lane.calls == 1 and lane.rpc_mask == R.SPACE_RPC_MASK
        assert (found.pages, len(found.lease_id)) == (2, 32)
        assert g.lookup(KEYS).pages == 2 and g.lane is None  # the same answer on gRPC
        assert v.release(found.lease_id) == 1  # the lease the lane's Lookup took is the daemon's
        ops, plane = daemon.daemon.servicer.cache, daemon.core.plane

        def at_once() -> int:  # on the data plane's thread where it runs, else on the loop without a task
            return ops.lookups_now + (plane.plane_space_lookups if plane is not None else 0)

        now = at_once()
        assert v.lookup(KEYS[32:]).pages == 0 and v.lookup(KEYS[16:]).pages == 1 and lane.calls == 3
        assert at_once() == now + 2
        uid = os.getuid()
        # its ring's mapping's copy of the ring's fd, its submit doorbell, its two slots' doorbells
        assert books(daemon) == (1, {uid: engine_fds[uid] + 2 + 2}, {uid: 1})
        v.close()  # its end closes: the daemon closes the lane and gives its descriptors back
        wait_until(lambda: books(daemon) == (0, engine_fds, {}), 10, "the space lane's close")
        engine.unregister()


def refused_on_a_space_lane(ring: RawRing, engine_id: str, keys: bytes) -> None:
    """On a space's lane of 4 slots: a Write, another space's Lookup, an engine's Lookup and bytes
    that are no LookupRequest, each answered as the loop answers them (the same whether or not the
    data plane watches the lane, and whether or not its gate has the space's parts)."""
    ring.put(0, R.RPC_WRITE_B, b"\x00" * 64)  # not a Lookup
    ring.put(1, R.RPC_LOOKUP, pb.LookupRequest(space_id="f" * 32, keys=keys, key_bytes=16)
             .SerializeToString())  # another space's
    ring.put(2, R.RPC_LOOKUP, pb.LookupRequest(client_id=engine_id, keys=keys, key_bytes=16)
             .SerializeToString())  # an engine's
    ring.put(3, R.RPC_LOOKUP, b"\xff" * 40)  # not a LookupRequest
    assert ring.ring() == 1
    wait_until(lambda: all(ring.state(i) == R.DONE for i in range(4)), 10, "the ring's answers")
    inv = grpc.StatusCode.INVALID_ARGUMENT
    assert ring.answer(0) == (inv, "a space's lane carries only Lookups, not WriteB")
    assert ring.answer(1)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert ring.answer(2)[0] == inv and "no client_id" in ring.answer(2)[1]
    assert ring.answer(3)[0] == inv and "LookupRequest" in ring.answer(3)[1]


def test_a_spaces_lane_carries_only_its_spaces_lookups(daemon) -> None:
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as engine, \
            view(daemon.address, lane="grpc") as v:
        store_two(engine, pool)
        sid = v.open()
        code, message = error_of(lambda: RawRing(daemon.address, space_id=sid, slots=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 4 slots" in message
        ring = RawRing(daemon.address, space_id=sid, slots=4)
        try:
            lookup = pb.LookupRequest(space_id=sid, keys=KEYS, key_bytes=16)
            refused_on_a_space_lane(ring, engine.client_id, KEYS)
            inv = grpc.StatusCode.INVALID_ARGUMENT
            ring.put(0, 99, lookup.SerializeToString())  # no such rpc
            ring.put(1, R.RPC_LOOKUP, lookup.SerializeToString())
            assert ring.ring() == 1
            wait_until(lambda: all(ring.state(i) == R.DONE for i in range(2)), 10, "the ring's answers")
            assert ring.answer(0) == (inv, "unknown lane rpc id 99")
            assert ring.answer(1)[0] == grpc.StatusCode.OK
            off = R.slot_offset(1)
            _, n, _ = R.RESULT.unpack_from(ring.mm, off + R.CODE_AT)
            found = pb.LookupResponse.FromString(bytes(ring.mm[off + R.RESPONSE_AT: off + R.RESPONSE_AT + n]))
            assert found.pages == 2
            assert books(daemon)[0] == 1
        finally:
            ring.close()  # the peer's end closes: the daemon closes the lane
        wait_until(lambda: books(daemon)[0] == 0 and books(daemon)[2] == {}, 10, "the raw lane's close")
        engine.unregister()


def test_a_spaces_lane_is_its_tenants_and_for_a_space_the_daemon_knows(daemon_factory, tmp_path) -> None:
    tokens = tmp_path / "tenants"
    tokens.write_text("other tok-other-0123456789\n")
    d = daemon_factory(tenant_tokens=str(tokens))
    other = (("x-kvserver-tenant", "tok-other-0123456789"),)
    with view(d.address, lane="grpc") as mine, \
            view(d.address, lane="grpc", tenant_token=other[0][1]) as theirs:
        sid, their_sid = mine.open(), theirs.open()
        assert sid != their_sid and theirs.tenant == "other"
        fds = len(os.listdir("/proc/self/fd"))  # the daemon runs in this process
        code, message = error_of(lambda: RawRing(d.address, space_id=their_sid))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "tenant" in message
        assert error_of(lambda: RawRing(d.address, space_id="0" * 32))[0] == grpc.StatusCode.NOT_FOUND
        code, message = error_of(lambda: RawRing(d.address, "1" * 32, space_id=sid))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exactly one" in message
        # Every refused ticket's descriptors are closed, not kept until the ticket's expiry.
        wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds, 10, "the refused tickets' descriptors")
        ring = RawRing(d.address, slots=2, space_id=their_sid, metadata=other)  # the tenant's token: its own
        ring.close()
        ring = RawRing(d.address, slots=2, space_id=sid)
        ring.close()
    wait_until(lambda: books(d) == (0, {}, {}), 10, "every space lane's close")


def test_the_daemons_stop_closes_its_space_lanes_and_opens_no_more(daemon_factory) -> None:
    d = daemon_factory()
    with view(d.address, timeout=2.0) as v, view(d.address, lane="grpc") as late:
        assert v.lookup(KEYS).pages == 0 and v.lane is not None
        lanes = d.daemon.servicer.lanes
        assert books(d)[0] == 1
        sid = late.open()
        d.run(lambda: setattr(lanes, "stopping", True))  # as drain sets it, first thing
        fds = len(os.listdir("/proc/self/fd"))
        code, message = error_of(lambda: RawRing(d.address, slots=2, space_id=sid))
        assert code == grpc.StatusCode.UNAVAILABLE and "stopping" in message
        wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds, 10, "the refused ticket's descriptors")
        d.stop()
        assert lanes.stopping and not lanes.space_lanes and not lanes._space_lanes_per_uid
        assert v.lookup(KEYS).pages == 0 and v.misses == 1  # the daemon is gone: a miss
        assert v.lane is None


def test_space_lanes_are_capped_per_uid_and_a_refused_view_stays_on_grpc(daemon, monkeypatch) -> None:
    lanes = daemon.daemon.servicer.lanes
    daemon.run(lambda: setattr(lanes, "max_space_lanes_per_uid", 1))
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as engine, \
            view(daemon.address) as first, view(daemon.address) as second:
        store_two(engine, pool)
        assert first.lookup(KEYS).pages == 2 and first.lane is not None
        for _ in range(3):  # refused once: the view asks no more for this space id
            assert second.lookup(KEYS).pages == 2
        assert second.lane is None and second._lane.refusals == 1 and second.misses == 0
        first.close()
        wait_until(lambda: books(daemon)[0] == 0, 10, "the first view's lane to close")
        monkeypatch.setattr(view_lane, "RETRY_SECONDS", 0.0)  # it asks again once the pause is over
        assert second.lookup(KEYS).pages == 2 and second.lane is not None and second.lane.calls == 1
        engine.unregister()


def test_a_close_during_the_lanes_own_close_waits_for_it_to_end(daemon, monkeypatch) -> None:
    """The lane closes itself when its peer goes; a Lookup it cancels takes 0.5 s to end. A close
    meanwhile (the daemon's stop) returns only once everything is released."""
    ops = daemon.daemon.servicer.cache
    real, started = ops.lookup, []

    async def slow_to_cancel(req):
        started.append(1)
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.shield(asyncio.sleep(0.5))  # its cleanup outlasts the cancellation
        return await real(req)

    lanes = daemon.daemon.servicer.lanes
    with view(daemon.address, lane="grpc") as v:
        sid = v.open()
        ring = RawRing(daemon.address, slots=2, space_id=sid)
        (lane,) = daemon.run(lambda: list(lanes.space_lanes))
        monkeypatch.setattr(ops, "lookup", slow_to_cancel)
        monkeypatch.setattr(ops, "lookup_now", lambda req: None)  # one that waits: a task serves it
        ring.put(0, R.RPC_LOOKUP, pb.LookupRequest(space_id=sid, keys=KEYS, key_bytes=16).SerializeToString())
        assert ring.ring() == 1
        wait_until(lambda: started, 10, "the Lookup to start")
        ring.close()  # the peer goes: the lane begins its own close
        wait_until(lambda: daemon.run(lambda: lane._closed), 10, "the lane's own close to begin")
        assert daemon.run(lambda: lane in lanes.space_lanes)  # not closed yet: its Lookup is ending
        daemon.call(lane.close())
        assert daemon.run(lambda: lane._ended.done() and lane not in lanes.space_lanes)


def test_the_daemon_caps_its_space_lanes_whatever_the_uid(daemon) -> None:
    lanes = daemon.daemon.servicer.lanes
    daemon.run(lambda: setattr(lanes, "max_space_lanes", 1))
    with view(daemon.address) as first, view(daemon.address) as second:
        assert first.lookup(KEYS).pages == 0 and first.lane is not None
        assert second.lookup(KEYS).pages == 0 and second.lane is None and second._lane.refusals == 1
        sid = second.space_id
        code, message = error_of(lambda: RawRing(daemon.address, slots=2, space_id=sid))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space lanes open" in message


def test_threads_share_a_views_lane(daemon) -> None:
    """Lookups from several threads at once, the lane opened by whichever comes first: every
    answer right (calls finding both slots busy, or the lane still opening, take gRPC), one lane
    in the daemon; then, with no more threads than slots, every call on the lane."""
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as engine, \
            view(daemon.address) as v:
        store_two(engine, pool)
        answers: list[int] = []
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                for _ in range(50):
                    answers.append(v.lookup(KEYS).pages)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        def round_of(n: int) -> None:
            threads = [threading.Thread(target=ask) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)

        round_of(4)
        assert not errors, errors
        assert answers == [2] * 200 and v.misses == 0
        assert v.lane is not None and v.lane.calls >= 1 and books(daemon)[0] == 1
        lane, before = v.lane, v.lane.calls
        round_of(view_lane.SLOTS)
        assert not errors, errors
        assert answers == [2] * (200 + 50 * view_lane.SLOTS) and v.misses == 0
        assert v.lane is lane and lane.calls == before + 50 * view_lane.SLOTS and books(daemon)[0] == 1
        engine.unregister()


def test_a_spaces_lane_closes_when_its_process_exits_though_its_doorbell_lives_on(daemon) -> None:
    with view(daemon.address, lane="grpc") as v:
        sid = v.open()
        # Its doorbells' ends live on in a child it leaves behind: no end-of-file comes when the
        # process exits (at once).
        argv = [sys.executable, "-c", OPEN_LANE, daemon.address, "space_id", sid, "ends-live-on"]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout.split()
        try:
            assert out[1:] == ["OK"]
            wait_until(lambda: books(daemon) == (0, {}, {}), 10, "the exited process's lane to close")
        finally:
            os.kill(int(out[0]), signal.SIGKILL)


# A process that takes a ticket for a space's lane (its ring; its doorbells connected)
# and exits without redeeming it.
TICKET = """
import fcntl, os, sys
from kvserver.protocol import ring as R
from kvserver.protocol.fd_socket import request_lane_ticket
fd = os.memfd_create("ticket-lane", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, R.ring_bytes(1))
os.pwrite(fd, R.header(1), 0)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
print(request_lane_ticket(sys.argv[1][len("unix://"):] + ".fd", [fd], 2)[0])
"""


def test_a_space_lane_watches_the_process_that_connected_not_whoever_has_its_pid_now(daemon) -> None:
    """The ticket's process exits before its lane is opened, and its pid may name another, live
    process by then (a pid reused): the lane is never opened for a process that did not ask for
    it. The daemon watches the process that connected to its fd socket (a pidfd taken then), not a
    pid: its ticket expires when that process exits, so the OpenLane finds none."""
    with view(daemon.address, lane="grpc") as v:
        sid = v.open()
        ticket = subprocess.run([sys.executable, "-c", TICKET, daemon.address], check=True,
                                capture_output=True, text=True, timeout=60).stdout.strip()
        book = daemon.core.tickets
        wait_until(lambda: daemon.run(lambda: ticket not in book._tickets), 5,
                   "the ticket to expire with its process")
        with grpc.insecure_channel(daemon.address) as ch:
            code, message = error_of(lambda: pb_grpc.KVServerStub(ch).OpenLane(
                pb.OpenLaneRequest(space_id=sid, peer_ticket=ticket), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "expired" in message, (code, message)
        assert books(daemon) == (0, {}, {})


# A scheduler's process (kvclient imports torch: it takes a few seconds to start).
SCHEDULER = f"""
import sys, time, torch
from kvclient import CacheView, KVLayout
v = CacheView(sys.argv[1], model="{MODEL}", layout=KVLayout.mha(2, 8), dtype=torch.float16, page_size={PAGE},
              num_layers={LAYERS})
v.lookup(b"k" * 16)
print("ready" if v.lane is not None else "no lane", flush=True)
time.sleep(600)
"""


def test_a_spaces_lane_closes_with_its_process_and_is_opened_again_after_a_restart(socket_dir: str) -> None:
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        base = d.num_fds()
        sched = subprocess.Popen([sys.executable, "-c", SCHEDULER, d.address], stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert sched.stdout.readline().strip() == "ready"
            assert len(lane_maps(d)) == 1 and d.num_fds() >= base + 1 + 2  # its doorbells (and gRPC's)
            sched.send_signal(signal.SIGKILL)
            sched.wait(30)
        finally:
            sched.kill()
            sched.stdout.close()
        wait_until(lambda: not lane_maps(d) and d.num_fds() <= base, 10, "the dead scheduler's lane to close")

        with view(d.address, timeout=2.0) as v:
            assert v.lookup(KEYS).pages == 0
            first, sid = v.lane, v.space_id
            assert first is not None and first.calls == 1
            d.stop()  # the stop closes the lane: the view's next Lookup takes gRPC
            d.start()
            # The new daemon forgot the space: the view opens it again, and a lane for its new id.
            assert v.lookup(KEYS).pages == 0 and v.misses == 0
            assert v.space_id != sid and v.lane is not None and v.lane is not first and v.lane.calls == 1
            assert len(lane_maps(d)) == 1
    finally:
        d.stop()


def test_the_daemon_is_told_to_end_a_lookup_before_the_view_gives_up() -> None:
    assert view_lane.daemon_timeout_ms(5.0) == 4980  # 20 ms before
    assert view_lane.daemon_timeout_ms(0.04) == 30  # a quarter of a short wait
    assert view_lane.daemon_timeout_ms(0.0001) == 1
    assert view_lane.daemon_timeout_ms(float("inf")) == view_lane.daemon_timeout_ms(1e12) == 0xFFFFFFFF


@pytest.mark.parametrize("mode", ["auto", "grpc"])
def test_a_view_takes_only_auto_or_grpc(mode: str) -> None:
    v = view("unix:///nonexistent/kv.sock", lane=mode)
    v.close()
    with pytest.raises(ValueError, match="lane must be"):
        view("unix:///nonexistent/kv.sock", lane="ring")


def test_the_pidfd_check_takes_any_descriptor_number_and_closes_what_it_refuses() -> None:
    """A daemon holding many descriptors hands out pidfds past 1024 (where select() cannot look):
    the check still answers, and a pidfd of an exited process, or a ticket whose process was gone
    at the fd socket, is refused with nothing left open."""
    import resource
    import types

    from kvserver.errors import FailedPrecondition
    from kvserver.lane import book
    from kvserver.peers.tickets import PEER_GONE

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1600:
        pytest.skip("cannot have descriptors past 1500 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    try:
        def ticket(fd: int) -> types.SimpleNamespace:
            t = types.SimpleNamespace(pidfd=fd, peer=types.SimpleNamespace(pid=os.getpid()))
            t.take_pidfd = lambda: (t.pidfd, setattr(t, "pidfd", -1))[0]
            return t

        def high(pid: int, at: int) -> int:
            fd = os.pidfd_open(pid)
            os.dup2(fd, at)
            os.close(fd)
            return at

        assert book._pidfd(ticket(high(os.getpid(), 1500))) == 1500
        os.close(1500)
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        gone = high(child.pid, 1501)
        child.wait(30)
        with pytest.raises(FailedPrecondition, match="exited"):
            book._pidfd(ticket(gone))
        with pytest.raises(OSError):
            os.fstat(1501)  # closed
        with pytest.raises(FailedPrecondition, match="exited"):
            book._pidfd(ticket(PEER_GONE))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
