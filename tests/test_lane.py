"""The data-plane fast lane (docs/lane.md) against the real daemon: round trips on the ring are
bit-exact and counted by lane, a hostile ring changes nothing outside itself and stalls no one,
a lane is only its registration's process's, and its release (Unregister, a killed engine, a dead
daemon) frees it on both sides."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from checks import error_of, wait_until
from daemon_proc import DaemonProcess

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys
from kvserver.protocol import ring as R
from kvserver.protocol.fd_socket import TicketRefused, request_lane_ticket, request_ticket
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

LAYOUT, DTYPE, LAYERS, PAGE, TOKENS = KVLayout.mha(2, 8), torch.float16, 4, 16, 256


def register(client: KVClient, pool: ShmKVPool, host_tokens: int = 128):
    return client.register(model="lane", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=host_tokens, page_size=PAGE)


def fill(pool: ShmKVPool, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for buf in layer:
            buf.view(torch.int16).random_(generator=g)
    return [[b.clone() for b in layer] for layer in pool.buffers]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # random bits include NaNs: compare bytes


def wipe(pool: ShmKVPool) -> None:
    for layer in pool.buffers:
        for buf in layer:
            buf.zero_()


def ops(daemon, direction: str, lane: str) -> int:
    return daemon.run(lambda: daemon.daemon.metrics.transfers.ops[direction, lane])


def round_trip(client: KVClient, pool: ShmKVPool) -> None:
    orig = fill(pool, 1)
    host, dev = client.alloc(64), torch.arange(64, 128)
    assert client.write(host_indices=host, device_indices=dev) == 64 * LAYOUT.token_bytes(DTYPE) * 2 * LAYERS
    wipe(pool)
    handle = client.load(host_indices=host, device_indices=dev)
    assert all(handle.wait_layer(layer) for layer in range(LAYERS))
    assert handle.wait() > 0 and not handle.missed
    for layer in range(LAYERS):
        for part, buf in enumerate(pool.buffers[layer]):
            assert torch.equal(raw(buf[64:128]), raw(orig[layer][part][64:128]))
            assert not buf[:64].any() and not buf[128:].any()  # nothing else written


@pytest.mark.parametrize("lane", ["auto", "grpc"])
def test_round_trip_is_bit_exact_and_counted_by_lane(daemon, lane: str) -> None:
    used, other = ("ring", "grpc") if lane == "auto" else ("grpc", "ring")
    before = {(d, ln): ops(daemon, d, ln) for d in ("write", "load") for ln in ("ring", "grpc")}
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address, lane=lane) as client:
        register(client, pool)
        assert (client.lane is not None) == (lane == "auto")
        round_trip(client, pool)
        if client.lane is not None:
            assert client.lane.calls == 2
        client.unregister()
    for d in ("write", "load"):
        assert ops(daemon, d, used) == before[d, used] + 1
        assert ops(daemon, d, other) == before[d, other]


def test_put_and_get_on_the_ring(daemon) -> None:
    keys = page_keys(range(3 * PAGE), PAGE)
    before = (ops(daemon, "put", "ring"), ops(daemon, "get", "ring"))
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, host_tokens=0)
        orig = fill(pool, 2)
        assert client.put(keys, [0, 1, 2]).stored == 3
        handle = client.get(keys, [8, 9, 10])
        assert handle.pages() == 3
        assert all(handle.wait_layer(layer) for layer in range(LAYERS))
        handle.wait()
        for layer in range(LAYERS):
            for part, buf in enumerate(pool.buffers[layer]):
                assert torch.equal(raw(buf[8 * PAGE:11 * PAGE]), raw(orig[layer][part][:3 * PAGE]))
        assert client.get(page_keys([7] * PAGE, PAGE), [4]).pages() == 0  # nothing stored: one answer
        assert client.lane is not None and client.lane.calls == 3
        client.unregister()
    assert (ops(daemon, "put", "ring"), ops(daemon, "get", "ring")) == (before[0] + 1, before[1] + 1)


def test_lookup_on_the_ring_answers_as_grpc(daemon) -> None:
    keys = page_keys(range(3 * PAGE), PAGE)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, host_tokens=0)
        lane = client.lane
        assert lane is not None and lane.rpc_mask == R.RPC_MASK and lane.serves("Lookup")
        assert client.put(keys[:32], [0, 1]).stored == 2
        calls = lane.calls
        found = client.lookup(keys, pin_ms=5000)
        assert (found.pages, len(found.lease_id)) == (2, 32)
        assert lane.calls == calls + 1
        assert client.release([found.lease_id]) == 1  # the lease the lane's Lookup made is the daemon's
        assert client.lookup(keys[32:]).pages == 0 and lane.calls == calls + 2
        # A daemon older than rpc_mask serves no Lookup on the lane: the call takes gRPC, same answer.
        lane.rpc_mask = R.OLD_RPC_MASK
        assert client.lookup(keys).pages == 2 and lane.calls == calls + 2
        client.unregister()


def test_a_daemon_that_names_no_rpc_mask_gets_lookups_on_grpc(daemon, monkeypatch) -> None:
    monkeypatch.setattr(R, "RPC_MASK", 0)  # what a daemon older than the field answers
    keys = page_keys(range(PAGE), PAGE)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, host_tokens=0)
        lane = client.lane
        assert lane is not None and lane.rpc_mask == R.OLD_RPC_MASK and not lane.serves("Lookup")
        assert client.put(keys, [0]).stored == 1 and lane.calls == 1  # the rest is on the lane
        assert client.lookup(keys).pages == 1 and lane.calls == 1
        client.unregister()


def test_a_lookup_given_up_on_the_ring_ends_and_takes_no_lease(daemon) -> None:
    """On the lane no gRPC deadline ends a Lookup: its timeout_ms does, before it pins anything."""
    keys = page_keys(range(PAGE), PAGE)
    ops = daemon.daemon.servicer.cache
    real, seen = ops.lookup, []
    real_now = ops.lookup_now  # a Lookup that may wait is one a task serves (a cluster's, say)

    async def late(req):  # the Lookup waits (as behind a slow tier) before it looks
        seen.append(req.timeout_ms)
        await asyncio.sleep(1.0)
        return await real(req)

    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
        register(client, pool, host_tokens=0)
        assert client.put(keys, [0]).stored == 1
        ops.lookup, ops.lookup_now = late, lambda req: None
        try:
            lane, misses = client.lane, client.misses
            assert client.lookup(keys, pin_ms=30_000, timeout=0.2).pages == 0  # a miss: best effort
            assert seen == [200] and client.misses == misses + 1
            # The daemon ended it at its timeout (the slot is answered, if the client gave up first),
            # and it took no lease, not even once the wait it was in is over.
            wait_until(lambda: all(lane._state(i) == R.DONE for i in lane._abandoned), 5, "the answer")
            time.sleep(1.0)
            assert daemon.run(lambda: len(daemon.core.cache.leases.leases)) == 0
        finally:
            ops.lookup, ops.lookup_now = real, real_now
        assert client.lookup(keys, pin_ms=1000).pages == 1
        client.unregister()


# ---- a raw peer: its own ring, written by hand -----------------------------------------------------


def raw_ring_fd(slots: int) -> int:
    """A lane's ring of ``slots`` slots: a sealed memfd, its header written."""
    fd = os.memfd_create("raw-lane", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, R.ring_bytes(slots))
    os.pwrite(fd, R.header(slots), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


class RawRing:
    """A lane made without the library: the ring, the doorbells, and OpenLane."""

    def __init__(self, address: str, client_id: str = "", slots: int = 8, *, space_id: str = "",
                 metadata: tuple = (),
                 own_doorbells: Callable[[list[socket.socket]], list[socket.socket]] | None = None) -> None:
        """``own_doorbells``: the doorbells are made here, and what it returns, given their other
        ends, is sent with the ring as the daemon's ends (they are connected to the fd socket
        otherwise)."""
        self.slots = slots
        fd = raw_ring_fd(slots)
        self.mm = mmap.mmap(fd, R.ring_bytes(slots))
        self.submit, self.done = None, []
        others: list[socket.socket] = []
        try:
            path = address[len("unix://"):] + ".fd"
            if own_doorbells is None:
                ticket, ends = request_lane_ticket(path, [fd], 1 + slots)
            else:
                pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(1 + slots)]
                ends, others = [a for a, _ in pairs], [b for _, b in pairs]
                sent = own_doorbells(others)
                ticket = request_ticket(path, [fd] + [b.fileno() for b in sent])
            self.submit, self.done = ends[0], ends[1:]
            with grpc.insecure_channel(address) as ch:
                pb_grpc.KVServerStub(ch).OpenLane(
                    pb.OpenLaneRequest(client_id=client_id, space_id=space_id, peer_ticket=ticket),
                    timeout=5, metadata=metadata)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)
            for b in others:
                b.close()

    def put(self, i: int, rpc: int, data: bytes, length: int | None = None, state: int = R.SUBMITTED) -> None:
        off = R.slot_offset(i)
        self.mm[off + R.REQUEST_AT: off + R.REQUEST_AT + len(data)] = data
        R.CALL.pack_into(self.mm, off + R.RPC_AT, rpc, i, len(data) if length is None else length)
        R.U32.pack_into(self.mm, off + R.STATE, state)

    def ring(self, times: int = 1) -> int:
        sent = 0
        for _ in range(times):
            try:
                self.submit.send(b"x", socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            sent += 1
        return sent

    def state(self, i: int) -> int:
        return R.U32.unpack_from(self.mm, R.slot_offset(i) + R.STATE)[0]

    def answer(self, i: int) -> tuple[grpc.StatusCode, str]:
        off = R.slot_offset(i)
        code, _, m = R.RESULT.unpack_from(self.mm, off + R.CODE_AT)
        status = next(c for c in grpc.StatusCode if c.value[0] == code)
        return status, bytes(self.mm[off + R.ERROR_AT: off + R.ERROR_AT + m]).decode()

    def close(self) -> None:
        for s in ([self.submit] if self.submit is not None else []) + self.done:
            s.close()
        self.mm.close()


def test_the_planes_bookkeeping_of_one_uids_pools_is_capped(daemon) -> None:
    """The data plane keeps 8 bytes per device token of a pool it serves (its write marks and a
    request's scratch), in the daemon's own memory, written as requests name tokens: a pool of a
    billion one-byte tokens, which its engine never touches, cost the daemon 8 GiB. One uid's
    pools get the plane up to a share of the node's memory; past it their lanes are served on the
    loop, which keeps its marks per device page, and the booking is given back at release."""
    lanes = daemon.daemon.servicer.lanes
    if daemon.core.plane is None:
        pytest.skip("the compiled data plane is not built")
    one = daemon.run(lambda: lanes.max_plane_bytes_per_uid)
    assert 0 < one <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 16
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as a, ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as b, \
            KVClient(daemon.address) as first, KVClient(daemon.address) as second:
        ra = register(first, a)
        booked = daemon.run(lambda: dict(lanes._plane_bytes_per_uid))
        cost = booked[os.geteuid()]
        assert cost >= 8 * TOKENS
        assert daemon.run(lambda: daemon.core.client(ra.client_id).gate) is not None
        daemon.run(lambda: setattr(lanes, "max_plane_bytes_per_uid", cost + cost // 2))
        rb = register(second, b)
        assert second.lane is not None  # a lane still, on the loop
        assert daemon.run(lambda: daemon.core.client(rb.client_id).gate) is None
        round_trip(second, b)
        first.unregister()
        assert daemon.run(lambda: dict(lanes._plane_bytes_per_uid)) == {}
        second.unregister()
        rc = register(second, b)
        assert daemon.run(lambda: daemon.core.client(rc.client_id).gate) is not None
        second.unregister()
    daemon.run(lambda: setattr(lanes, "max_plane_bytes_per_uid", one))


def test_lane_descriptors_are_capped_per_uid(daemon) -> None:
    """The descriptors of one uid's open lanes are capped (the ring's mapping's copy of its fd, and
    1 + one per slot doorbells each): past the cap a lane is refused and the engine's calls go over
    gRPC, as they would without a lane."""
    lanes = daemon.daemon.servicer.lanes
    daemon.run(lambda: setattr(lanes, "max_fds_per_uid", 10))  # one lane of the default 8 slots
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as a, ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as b, \
            KVClient(daemon.address) as first, KVClient(daemon.address) as second:
        register(first, a)
        register(second, b)
        assert first.lane is not None and second.lane is None
        round_trip(second, b)  # over gRPC
        first.unregister()  # its lane's descriptors are given back
        assert daemon.run(lambda: dict(lanes._fds_per_uid)) == {}
        second.unregister()
        register(second, b)
        assert second.lane is not None
        second.unregister()


def test_a_hostile_ring_hurts_only_itself(daemon) -> None:
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as raw_pool, \
            ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
            KVClient(daemon.address, lane="grpc") as raw_client, KVClient(daemon.address) as engine:
        raw_reg = register(raw_client, raw_pool)
        register(engine, pool)
        ring = RawRing(daemon.address, raw_reg.client_id)
        try:
            host = raw_client.alloc(16)
            good = pb.WriteRequest(client_id=raw_reg.client_id, host_indices=host.tolist(),
                                   device_indices=list(range(16)))
            theirs = pb.WriteRequest(client_id=engine.client_id, host_indices=host.tolist(),
                                     device_indices=list(range(16)))
            ring.put(0, 99, good.SerializeToString())  # no such rpc
            ring.put(1, R.RPC_WRITE, good.SerializeToString(), length=(1 << 32) - 1)  # a length past the slot
            ring.put(2, R.RPC_LOAD, b"\xff" * 64)  # not a LoadRequest
            ring.put(3, R.RPC_WRITE, theirs.SerializeToString())  # another registration's id
            ring.put(4, R.RPC_WRITE, good.SerializeToString(), state=0xDEADBEEF)  # no state the daemon knows
            ring.put(5, R.RPC_WRITE, good.SerializeToString())  # a good one
            parts = pb.GetRequest(client_id=raw_reg.client_id, key_bytes=16,
                                  parts=[pb.GetPart(keys=b"k" * 16, device_pages=[0])])
            ring.put(6, R.RPC_GET, parts.SerializeToString())  # parts: gRPC only
            assert ring.ring(100_000) > 0  # the doorbell, rung until its queue is full
            wait_until(lambda: all(ring.state(i) == R.DONE for i in (0, 1, 2, 3, 5, 6)), 10,
                       "the ring's answers")
            inv = grpc.StatusCode.INVALID_ARGUMENT
            assert ring.answer(0) == (inv, "unknown lane rpc id 99")
            assert ring.answer(1)[0] == inv and "request_len" in ring.answer(1)[1]
            assert ring.answer(2)[0] == inv and "LoadRequest" in ring.answer(2)[1]
            assert ring.answer(3)[0] == grpc.StatusCode.PERMISSION_DENIED
            assert ring.answer(5)[0] == grpc.StatusCode.OK
            assert ring.answer(6)[0] == inv and "not carried by the lane" in ring.answer(6)[1]
            assert ring.state(4) == 0xDEADBEEF  # ignored
            # The slots stay DONE (never freed): resubmitting one is ignored until the peer frees it.
            # Of the header the daemon writes only its awake and plane words (docs/lane.md, "Ringing
            # only a sleeper" and "Ringing ahead").
            head = R.header(8)
            assert bytes(ring.mm[: len(head)]) == head
            assert R.U32.unpack_from(ring.mm, R.AWAKE_AT)[0] in (0, 1)
            assert R.U32.unpack_from(ring.mm, R.PLANE_AT)[0] in (0, R.PLANE_ASLEEP, R.PLANE_RUNNING)
            assert not any(ring.mm[R.PLANE_AT + 4: R.HEADER_BYTES])
            assert not any(ring.mm[R.slot_offset(7): R.ring_bytes(8)])  # nor any slot it was not asked to
            # Meanwhile another engine is served on its own lane.
            round_trip(engine, pool)
            assert engine.lane is not None and engine.lane.calls == 2
            raw_client.unregister()  # the daemon closes the raw lane: its doorbells read end-of-file
            ring.done[0].settimeout(10)
            while ring.done[0].recv(16):
                pass
        finally:
            ring.close()


def test_a_lookup_on_a_ring_is_its_own_registration_s(daemon) -> None:
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as raw_pool, \
            ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
            KVClient(daemon.address, lane="grpc") as raw_client, KVClient(daemon.address) as engine:
        raw_reg = register(raw_client, raw_pool, host_tokens=0)
        register(engine, pool, host_tokens=0)
        keys = page_keys(range(PAGE), PAGE)
        assert engine.put(keys, [0]).stored == 1
        ring = RawRing(daemon.address, raw_reg.client_id)
        try:
            mine = pb.LookupRequest(client_id=raw_reg.client_id, keys=keys, key_bytes=16)
            ring.put(0, R.RPC_LOOKUP, pb.LookupRequest(space_id="f" * 32, keys=keys, key_bytes=16)
                     .SerializeToString())
            ring.put(1, R.RPC_LOOKUP, pb.LookupRequest(client_id=engine.client_id, keys=mine.keys,
                                                       key_bytes=16).SerializeToString())
            ring.put(2, R.RPC_LOOKUP, mine.SerializeToString())
            assert ring.ring() == 1
            wait_until(lambda: all(ring.state(i) == R.DONE for i in range(3)), 10, "the ring's answers")
            code, message = ring.answer(0)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "no space_id" in message
            assert ring.answer(1)[0] == grpc.StatusCode.PERMISSION_DENIED
            assert ring.answer(2)[0] == grpc.StatusCode.OK
            off = R.slot_offset(2)
            _, n, _ = R.RESULT.unpack_from(ring.mm, off + R.CODE_AT)
            # The page the other engine stored: the same model, rank and layers, so the same part.
            found = pb.LookupResponse.FromString(bytes(ring.mm[off + R.RESPONSE_AT: off + R.RESPONSE_AT + n]))
            assert found.pages == engine.lookup(keys).pages == 1
        finally:
            ring.close()
        raw_client.unregister()
        engine.unregister()


# Another process (torch-free, so it starts fast) opening a lane of one slot and printing OK or
# the status: argv address, "client_id" or "space_id", the id, and "ends-live-on" to leave its
# doorbells' ends open in a child it starts (no end-of-file comes when it exits; the child's pid
# is printed first).
OPEN_LANE = """
import fcntl, os, socket, subprocess, sys, grpc
from kvserver.protocol import ring as R
from kvserver.protocol.fd_socket import request_lane_ticket
from kvserver.v1 import kvserver_pb2 as pb, kvserver_pb2_grpc as pb_grpc
address, field, value = sys.argv[1:4]
fd = os.memfd_create("other-lane", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, R.ring_bytes(1))
os.pwrite(fd, R.header(1), 0)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
ticket, ends = request_lane_ticket(address[len("unix://"):] + ".fd", [fd], 2)
if sys.argv[4:] == ["ends-live-on"]:
    child = subprocess.Popen(["sleep", "60"], pass_fds=[e.fileno() for e in ends],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
with grpc.insecure_channel(address) as ch:
    try:
        pb_grpc.KVServerStub(ch).OpenLane(pb.OpenLaneRequest(peer_ticket=ticket, **{field: value}), timeout=5)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name)
"""


def test_only_the_registering_process_opens_its_lane(daemon) -> None:
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address, lane="grpc") as client:
        reg = register(client, pool)
        out = subprocess.run([sys.executable, "-c", OPEN_LANE, daemon.address, "client_id", reg.client_id],
                             check=True, capture_output=True, text=True, timeout=60).stdout.split()
        assert out == ["PERMISSION_DENIED"]
        with pytest.raises(grpc.RpcError) as err:
            RawRing(daemon.address, "f" * 32)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        client.unregister()


# ---- lifecycle, with the daemon in its own process ---------------------------------------------------

ENGINE = """
import sys, time, torch
from kvclient import KVClient, KVLayout, ShmKVPool
pool = ShmKVPool(KVLayout.mha(2, 8), torch.float16, 4, 256)
client = KVClient(sys.argv[1])
client.register(model="killed", pool=pool, start_layer=0, end_layer=4, num_layers=4, host_tokens=64,
                page_size=16)
assert client.lane is not None
print("ready", flush=True)
time.sleep(60)
"""


def lane_maps(d: DaemonProcess) -> list[str]:
    return [m for m in d.shm_maps() if "kvclient-lane" in m]


def all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(s == "T" for s in states)


def test_the_lane_is_freed_and_reopened_with_its_registration(socket_dir: str) -> None:
    """Unregister and a killed engine free the daemon's half; a daemon killed mid-call wakes the
    waiting call (a miss, before its deadline); the restarted daemon gets a new lane."""
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=2.0) as client:
            register(client, pool)
            assert client.lane is not None and len(lane_maps(d)) == 1
            held = d.num_fds()  # the lane's doorbells among them (its ring is mapped, not held)
            client.unregister()
            wait_until(lambda: d.num_fds() <= held - 1 - R.DEFAULT_SLOTS and not lane_maps(d), 10,
                       "the lane's release")
            base = d.num_fds()
            engine = subprocess.Popen([sys.executable, "-c", ENGINE, d.address], stdout=subprocess.PIPE,
                                      text=True)
            try:
                assert engine.stdout.readline().strip() == "ready"
                assert len(lane_maps(d)) == 1
                engine.send_signal(signal.SIGKILL)
                engine.wait(30)
            finally:
                engine.kill()
                engine.stdout.close()
            wait_until(lambda: d.num_fds() <= base and not lane_maps(d) and d.stats().num_clients == 0, 20,
                       "the killed engine's lane to be freed")

            register(client, pool)
            first = client.lane
            host, dev = client.alloc(16), torch.arange(16)
            assert client.write(host_indices=host, device_indices=dev) > 0 and first.calls == 1
            os.kill(d.pid, signal.SIGSTOP)  # the call waits on a daemon that answers nothing
            # The stop reaches every thread only once the thread the kernel gave the signal runs;
            # until then another (the data plane's) may still answer: wait until all are stopped.
            wait_until(lambda: all_stopped(d.pid), 10, "every thread of the daemon to stop")
            got: list = []
            writer = threading.Thread(target=lambda: got.append(
                (client.write(host_indices=host, device_indices=dev), time.monotonic())))
            writer.start()
            time.sleep(0.2)
            killed = time.monotonic()
            d.kill()
            writer.join(client._core.job_deadline + 5)
            assert not writer.is_alive(), "the call hung on a dead daemon"
            assert got[0][0] == 0 and client.misses >= 1  # a miss, as on gRPC
            assert got[0][1] - killed < client._core.job_deadline  # woken by the daemon's death
            d.start()
            wait_until(lambda: client.connected and client.lane is not None and client.lane is not first,
                       20, "re-registration and a new lane")
            host = client.alloc(16)
            assert client.write(host_indices=host, device_indices=dev) > 0
            assert client.lane.calls == 1 and client.lane.reg is client.registration
    finally:
        d.stop()


def test_a_lost_registrations_lane_lets_a_call_in_flight_run_to_the_daemons_answer(daemon) -> None:
    """The session can end while the daemon still runs a lane call (the client closes the lane
    without waking it): the call is answered as the daemon answers it, never reported missed
    while the copy may still land."""
    layout = KVLayout.mha(8, 64)  # 2 KiB a token and part: 1 MiB a layer of 256 tokens, never inline
    with ShmKVPool(layout, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address) as client:
        client.register(model="lane", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                        host_tokens=TOKENS, page_size=PAGE)
        assert client.lane is not None
        dev = torch.arange(TOKENS)
        host = client.alloc(TOKENS)
        assert client.write(host_indices=host, device_indices=dev) > 0
        queue = daemon.core.copier._executor
        gate, started = threading.Event(), threading.Barrier(queue.threads + 1)

        def hold() -> None:
            started.wait(10)
            gate.wait(30)

        for _ in range(queue.threads):
            queue.submit_as(True, hold)
        started.wait(10)
        plane = daemon.core.plane  # the compiled data plane copies lane calls: held too
        if plane is not None:
            plane.engine.pause(True)
        try:
            handle = client.load(host_indices=host, device_indices=dev)
            client._close_lane(client.lane.reg, wake=False)  # what a lost session does
            with pytest.raises(TimeoutError):  # nothing to report before the daemon answers
                handle.wait_layer(0, timeout=0.3)
            assert not handle.missed
        finally:
            gate.set()
            if plane is not None:
                plane.engine.pause(False)
        assert handle.wait(timeout=30) > 0, "the daemon's answer was not the call's"


def _binary_write(pages: int) -> bytes:
    """A lane WriteB request of ``pages`` host pages and as many device runs, all starting at 0."""
    from kvserver.protocol import lane_request as L

    starts = bytes(8 * pages)
    return L.HEADER.pack(L.MAGIC, L.VERSION, L.KIND_WRITE, L.DEV_RUNS, pages, pages, 0, 0, 0, 0, 0) \
        + starts + starts


def test_a_binary_request_naming_too_many_indices_is_refused_before_it_is_expanded(daemon) -> None:
    """A slot's 64 KiB of page starts name 4093 pages; at 4096 tokens a page that is 16.7 M host and
    device indices each, 268 MB once expanded. The daemon refuses it (RESOURCE_EXHAUSTED, as
    ``--max-request-indices`` says) from its counts, before making a single index."""
    import tracemalloc

    ps = 4096
    pages = (R.REQUEST_BYTES - 40) // 16
    with ShmKVPool(KVLayout.mha(1, 8), torch.float16, 1, ps) as pool, \
            KVClient(daemon.address, lane="grpc") as client:
        reg = client.register(model="amp", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                              host_tokens=ps, page_size=ps)
        ring = RawRing(daemon.address, reg.client_id)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            ring.put(0, R.RPC_WRITE_B, _binary_write(pages))
            ring.ring()
            wait_until(lambda: ring.state(0) == R.DONE, 30, "the answer")
            peak = tracemalloc.get_traced_memory()[1]
            code, text = ring.answer(0)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, text)
            assert f"{pages * ps} indices in one request" in text, text
            assert peak < 16 << 20, f"{peak >> 20} MiB allocated to refuse it"
        finally:
            tracemalloc.stop()
            ring.close()


def test_a_large_binary_request_is_expanded_off_the_event_loop(daemon, monkeypatch) -> None:
    """A request of more than 64 Ki indices is expanded on the parse threads, as a large gRPC
    request is read (api/wire.py), not on the event loop."""
    from kvserver.protocol import lane_request as L

    ps = 64
    pages = (R.REQUEST_BYTES - 40) // 16  # 262 Ki indices
    threads: list[str] = []
    parse = L.parse

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return parse(*args, **kwargs)

    monkeypatch.setattr(L, "parse", spy)
    with ShmKVPool(KVLayout.mha(1, 8), torch.float16, 1, pages * ps) as pool, \
            KVClient(daemon.address, lane="grpc") as client:
        reg = client.register(model="big", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                              host_tokens=ps, page_size=ps)
        ring = RawRing(daemon.address, reg.client_id)
        try:
            ring.put(0, R.RPC_WRITE_B, _binary_write(pages))
            ring.ring()
            wait_until(lambda: ring.state(0) == R.DONE, 30, "the answer")
            code, text = ring.answer(0)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, text)  # pages it does not own
        finally:
            ring.close()
    assert threads and all(t.startswith("kvserver-parse") for t in threads), threads


def passrights_supported() -> bool:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        try:
            a.setsockopt(socket.SOL_SOCKET, 83, 0)  # SO_PASSRIGHTS (Linux 6.16)
        except OSError:
            return False
    return True


@pytest.mark.skipif(not passrights_supported(), reason="the kernel has no SO_PASSRIGHTS")
def test_a_lanes_doorbells_take_no_descriptors(daemon) -> None:
    """The daemon's ends of a lane's doorbells refuse descriptors (SO_PASSRIGHTS off): the loop and
    the data plane read them without a control buffer, and a descriptor dropped there would be
    released on their thread (for a file on FUSE, maybe waiting on its server)."""
    import array

    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(daemon.address, lane="grpc") as client:
        reg = register(client, pool)
        ring = RawRing(daemon.address, reg.client_id)
        r, w = os.pipe()
        try:
            for end in (ring.submit, *ring.done):
                with pytest.raises(PermissionError):
                    end.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
            assert ring.ring() == 1  # a plain ring still goes through
        finally:
            os.close(r)
            os.close(w)
            ring.close()


@pytest.mark.parametrize("kind", ["a pair", "listening", "holding messages"])
def test_a_lane_takes_no_doorbell_its_peer_sent(daemon, kind) -> None:
    """A lane's doorbells are connections the engine makes to the fd socket, whose accepts are the
    daemon's ends: a peer that sent its own kept a copy of the daemon's end, and so could hold its
    read lock (a read into a page on a FUSE file system whose server never answers) or take
    descriptors down it again (SO_PASSRIGHTS on), and the loop or the plane's thread would wait on
    them; it could also send a listening socket (read as rung for ever) or one full of messages.
    Any doorbell a peer sends is refused, unread; the registration serves on over gRPC, and a lane
    whose doorbells were connected opens."""
    import array

    r, w = os.pipe()
    kept: list[socket.socket] = []

    def spoil(others: list[socket.socket]) -> list[socket.socket]:
        if kind == "listening":  # a connection waits on it: it reads as rung for ever
            end = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            end.bind(f"\0kvtest-listening-doorbell-{os.getpid()}")
            end.listen(1)
            knock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            knock.connect(end.getsockname())
            kept.extend((end, knock))
            return [end, *others[1:]]
        if kind == "holding messages":
            sender = socket.socket(fileno=os.dup(others[0].fileno()))  # a copy the peer keeps
            kept.append(sender)
            for _ in range(16):
                others[0].sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", [r] * 253))])
        return others

    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
                KVClient(daemon.address, lane="grpc") as client:
            reg = register(client, pool)
            with pytest.raises(TicketRefused) as err:  # at the fd socket, before a ticket holds them
                RawRing(daemon.address, reg.client_id, own_doorbells=spoil).close()
            assert err.value.code == "INVALID_ARGUMENT" and "descriptor 1 is a socket" in err.value.message
            assert daemon.run(lambda: daemon.core.tickets.num_fds) == 0
            round_trip(client, pool)
            RawRing(daemon.address, reg.client_id).close()
    finally:
        os.close(r)
        os.close(w)
        for each in kept:
            each.close()


@pytest.mark.parametrize("case", ["no doorbells", "more than the ring", "too few doorbells"])
def test_a_lane_opens_with_its_ring_alone_and_as_many_connected_doorbells_as_it_has_slots_plus_one(
        daemon, case) -> None:
    ring, other = raw_ring_fd(8), raw_ring_fd(1)
    path = daemon.address[len("unix://"):] + ".fd"
    ends: list[socket.socket] = []
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
                KVClient(daemon.address, lane="grpc") as client:
            reg = register(client, pool)
            if case == "no doorbells":
                ticket, said = request_ticket(path, [ring]), "doorbells the daemon accepted"
            elif case == "more than the ring":
                (ticket, ends), said = request_lane_ticket(path, [ring, other], 9), "its ring alone"
            else:
                (ticket, ends), said = request_lane_ticket(path, [ring], 3), "3 doorbells for a ring of 8"
            with grpc.insecure_channel(daemon.address) as ch:
                code, message = error_of(lambda: pb_grpc.KVServerStub(ch).OpenLane(
                    pb.OpenLaneRequest(client_id=reg.client_id, peer_ticket=ticket), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and said in message, (code, message)
            for end in ends:  # the ticket's doorbells went with it
                assert end.recv(8) == b""
            lanes = daemon.daemon.servicer.lanes
            assert daemon.run(lambda: (daemon.core.tickets.num_fds, len(lanes.lanes))) == (0, 0)
            round_trip(client, pool)
            RawRing(daemon.address, reg.client_id).close()
    finally:
        os.close(ring)
        os.close(other)
        for end in ends:
            end.close()


@pytest.mark.parametrize("plane", ["compiled", "python"])
def test_an_empty_doorbell_message_is_a_ring_not_the_peer_leaving(daemon_factory, monkeypatch, plane) -> None:
    """A zero-length message on the submit doorbell (SOCK_SEQPACKET carries them) read as the
    peer's end of file: the lane was no longer watched, and its next calls waited for their
    deadlines (and cost the engine its registration). The peer's leaving is told by the socket
    (EPOLLRDHUP, POLLRDHUP), not by an empty read; and where it has left, the lane is still let go."""
    from kvserver.lane import plane as plane_mod

    if plane == "python":
        monkeypatch.setattr(plane_mod, "ENABLED", False)
    elif not plane_mod.ENABLED:
        pytest.skip("the compiled data plane is not built")
    d = daemon_factory()
    assert (d.core.plane is not None) == (plane == "compiled")
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
            KVClient(d.address, timeout=2, resilient=False) as client:
        register(client, pool)
        fill(pool, 3)
        client.lane._submit.send(b"")  # an empty ring, then calls that must be taken
        time.sleep(0.1)
        round_trip(client, pool)  # (before: DEADLINE_EXCEEDED, the lane no longer read)
        assert client.lane is not None and not client.lane.closed


def test_a_doorbell_rung_without_calls_is_muted_and_its_calls_still_served(daemon_factory) -> None:
    """A peer ringing its lane's doorbell without end, no call in its slots: each ring woke the
    plane's thread, which then read it, found nothing and went round again, a core's worth of work
    that took another engine's 1-page Loads from 625 k to 40-50 k in 10 s
    (benchmarks/bench_hostile.py --attacks "doorbell flood"). Past 256 rings without a call taken,
    the plane stops watching that doorbell for 10 ms at a time: the flood costs it a wake-up that
    often. The ringing lane's own calls are still served (found within those 10 ms), and the other
    lanes' at once."""
    from kvserver.lane import plane as plane_mod

    if not plane_mod.ENABLED:
        pytest.skip("the compiled data plane is not built")
    d = daemon_factory()
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
            ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as other, \
            KVClient(d.address, timeout=5, resilient=False) as ringer, \
            KVClient(d.address, timeout=5, resilient=False) as victim:
        register(ringer, pool)
        register(victim, other)
        bell = ringer.lane._submit
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                try:
                    bell.send(b"x", socket.MSG_DONTWAIT)
                except BlockingIOError:
                    time.sleep(0.0001)

        before = engine.mutes
        t = threading.Thread(target=flood)
        t.start()
        try:
            wait_until(lambda: engine.mutes > before, 10, "the doorbell muted")
            round_trip(victim, other)  # another lane: served as ever
            round_trip(ringer, pool)  # its own calls too, found while it is muted
        finally:
            stop.set()
            t.join(5)
        assert engine.mutes > before


def test_calls_too_large_for_a_slot_do_not_ring_the_plane(daemon_factory) -> None:
    """A client rang the plane ahead of every call while it slept (a nudge), then sent a Lookup too
    large for a slot over gRPC: a ring without a call, which the plane counts against the lane.
    300 of them (an engine with long prompts) had its doorbell muted, its next lane calls 5-7 ms
    late. A call of more keys than a slot holds no longer rings."""
    from kvserver.lane import plane as plane_mod

    if not plane_mod.ENABLED:
        pytest.skip("the compiled data plane is not built")
    d = daemon_factory()
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
            KVClient(d.address, timeout=5, resilient=False) as client:
        register(client, pool)
        keys = page_keys(range(PAGE * 5000), PAGE)  # 5000 keys: a request larger than a slot
        mutes, calls = engine.mutes, client.lane.calls
        for _ in range(300):
            time.sleep(0.001)  # the plane goes back to sleep between the engine's calls
            assert client.lookup(keys).pages == 0
        assert client.lane.calls == calls  # each over gRPC
        assert engine.mutes == mutes
