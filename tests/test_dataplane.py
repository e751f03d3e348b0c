"""The compiled data plane (kvserver/lane/csrc/kvlane.c): the lane's binary Writes and Loads are
checked and copied on its own thread; everything it does not take is answered by the daemon's one
validation, so both paths answer alike. Real daemon, real client, real shared memory."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch
from checks import loop_held
from test_core_deadlines import BusyWorker

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvserver.core import epochs
from kvserver.errors import KVError
from kvserver.protocol import lane_request as LR
from kvserver.protocol import ring as R
from kvserver.v1 import kvserver_pb2 as pb

LAYERS, START, PAGE, TOKENS = 4, 2, 16, 512
LAYOUT, DTYPE = KVLayout.mha(2, 32), torch.bfloat16


def _client(d, pool: ShmKVPool, **kw) -> KVClient:
    c = KVClient(d.address, timeout=10, resilient=False, **kw)
    c.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
               num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
    return c


def _fill(pool: ShmKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for buf in layer:
            buf.view(torch.int16).copy_(torch.randint(-30000, 30000, buf.view(torch.int16).shape, generator=g,
                                                      dtype=torch.int16))


def _snapshot(pool: ShmKVPool) -> list[torch.Tensor]:
    return [buf.view(torch.int16).clone() for layer in pool.buffers for buf in layer]  # bits: NaNs compare


def test_binary_calls_are_served_on_the_plane_bit_exact(plane_daemon) -> None:
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        assert c.lane is not None and c.lane.request_format == LR.VERSION
        _fill(pool, 1)
        want = _snapshot(pool)
        host = c.alloc(TOKENS)
        dev = torch.randperm(TOKENS)
        served = d.core.plane.engine.served
        nbytes = TOKENS * LAYOUT.token_bytes(DTYPE) * 2 * LAYERS
        assert c.write(host_indices=host, device_indices=dev) == nbytes
        for buf in (b for layer in pool.buffers for b in layer):
            buf.zero_()
        handle = c.load(host_indices=host[: 4 * PAGE], device_indices=dev[: 4 * PAGE],
                        layers=[START + 1, START + 3])
        assert handle.wait() > 0 and handle.landed(START + 1) and handle.landed(START + 3)
        c.load(host_indices=host, device_indices=dev).wait()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(pool), want, strict=True))
        assert d.core.plane.engine.served - served == 3, "the calls did not run on the plane"
        st = c.stats().clients[0]  # the plane's work is in the client's counters
        assert st.transfers.write_ops == 1 and st.transfers.load_ops == 2


def test_a_lookup_on_the_lane_keeps_no_copy_of_its_registration_off_the_plane(plane_daemon) -> None:
    """The loop serves a lane's Lookup; it copies nothing, so the registration's Writes and Loads
    meanwhile stay the plane's (a request the loop serves for it otherwise holds them off)."""
    d = plane_daemon
    ops = d.daemon.servicer.cache
    real, entered, go = ops.lookup, threading.Event(), threading.Event()

    async def held(req):
        entered.set()
        while not go.is_set():
            await asyncio.sleep(0.005)
        return await real(req)

    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host, dev = c.alloc(PAGE), torch.arange(PAGE)
        real_now = ops.lookup_now
        ops.lookup, ops.lookup_now = held, lambda req: None  # one that waits: a task serves it
        looker = threading.Thread(target=lambda: c.lookup([b"k" * 16]))
        try:
            looker.start()
            assert entered.wait(5), "the Lookup did not reach the daemon"
            served = d.core.plane.engine.served
            for _ in range(5):
                c.write(host_indices=host, device_indices=dev)
            c.load(host_indices=host, device_indices=dev).wait()
            assert d.core.plane.engine.served - served == 6, "the copies went to the loop"
        finally:
            go.set()
            looker.join(10)
            ops.lookup, ops.lookup_now = real, real_now


def test_what_the_plane_refuses_is_answered_by_the_one_validation(plane_daemon) -> None:
    """A request the compiled check does not take goes to the Python validation: the same status
    and message the gRPC call gets, and nothing changes."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(2 * PAGE)
        dev = torch.arange(2 * PAGE)
        oor, inv = grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT
        cases = [
            (host, torch.arange(TOKENS - 8, TOKENS + 24), None, oor, "outside the device"),
            (host[:PAGE], dev, None, inv, "16 host indices but 32 device"),
            (host, dev, [START - 1], oor, "layer 1 is outside this client's layer range"),
            (host, torch.zeros(2 * PAGE, dtype=torch.int64), None, inv, "same slot"),
            (host.flip(0), dev, None, inv, "whole, aligned pages"),
        ]
        other = host[PAGE:] ^ (1 << 40)  # another registration epoch's host indices
        cases.append((torch.cat([host[:PAGE], other]), dev, None, grpc.StatusCode.FAILED_PRECONDITION,
                      "registration epoch"))
        for h, dv, layers, code, text in cases:
            for op in ("write", "load"):
                with pytest.raises(KVClientError) as exc:
                    if op == "write":
                        c.write(host_indices=h, device_indices=dv, layers=layers)
                    else:
                        c.load(host_indices=h, device_indices=dv, layers=layers).wait()
                assert exc.value.code == code and text in exc.value.message, (op, exc.value)
        # a malformed binary request, sent raw
        with pytest.raises(KVClientError) as exc:
            c.lane.unary("WriteB", b"KVR1" + b"\0" * 10, 5)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "malformed Write" in exc.value.message
        assert c.stats().clients[0].transfers.write_ops == 0


def test_the_loop_serves_the_call_the_plane_handed_over_not_one_rewritten_since(plane_daemon) -> None:
    """A peer that rewrites a slot's call id after the plane handed the slot over (a Lookup it
    refused, which holds no copy of the registration off the plane) cannot have the loop serve a
    Write there: the loop serves the call the plane read, never reads the id from the ring again."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host, dev = c.alloc(PAGE), torch.arange(PAGE)
        lane, core = c.lane, c._core
        data = core.write_packed(core.registration, host, dev, list(range(START, START + LAYERS)), None)
        engine = d.core.plane.engine
        with loop_held(d.loop):  # the loop takes nothing meanwhile
            handed = engine.handed
            i = lane._take(data)
            lane._put(i, "Lookup", data)  # not a LookupRequest: the plane hands it over, not counted
            deadline = time.monotonic() + 5
            while engine.handed == handed:
                assert time.monotonic() < deadline, "the plane did not hand the slot over"
                time.sleep(0.001)
            off = R.slot_offset(i)
            _, seq, n = R.CALL.unpack_from(lane._mm, off + R.RPC_AT)
            R.CALL.pack_into(lane._mm, off + R.RPC_AT, R.RPC_IDS["WriteB"], seq, n)
        assert lane._wait(i, time.monotonic() + 10) is not None
        code, _response, message, _ = lane._result(i)
        lane._end(i, done=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (code, message)
        assert c.stats().clients[0].transfers.write_ops == 0, "the loop served the rewritten Write"


@pytest.mark.parametrize("spin", [0.0, 50e-6])
def test_a_command_cuts_the_plane_s_round_of_slots_short_and_every_slot_is_served(daemon_factory,
                                                                                  spin) -> None:
    """The loop waits for each command it gives the plane's thread (a lane added or removed, a gate
    closed): the thread runs it before it takes another slot, not after a round of every lane's
    (peers may keep them all full), and takes the slots it left after it, from where it stopped:
    none is left unserved, whether the thread spins (looking at every slot) or sleeps between
    requests (then only its doorbells and the scan after a command find them)."""
    d = daemon_factory(plane_spin=spin)
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
    engine = d.core.plane.engine
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS))
        clients = [stack.enter_context(_client(d, pool)) for _ in range(6)]
        keys = [bytes([k]) * 16 for k in range(30)]
        assert clients[0].put(keys, torch.arange(30)).stored == 30
        requests = {}
        for c in clients:
            assert c.lookup(keys[:1]).pages == 1  # the loop's: it gives the gate its part
            real = c.lane.unary

            def spy(rpc, data, timeout, real=real, lane=c.lane):
                requests[lane] = data
                return real(rpc, data, timeout)

            c.lane.unary = spy
            assert c.lookup(keys * 34).pages == 1020  # the plane's, as every one below
            c.lane.unary = real
        slots = []
        for c in clients:
            while (i := c.lane._take(requests[c.lane])) is not None:
                slots.append((c.lane, i))
        stop, served = threading.Event(), [0]

        def flood() -> None:
            for lane, i in slots:
                lane._put(i, "Lookup", requests[lane])
            while not stop.is_set():
                for lane, i in slots:
                    if lane._state(i) == R.DONE:
                        served[0] += 1
                        lane._put(i, "Lookup", requests[lane])

        peer = threading.Thread(target=flood)
        peer.start()
        cuts, deadline = engine.command_cuts, time.monotonic() + 20

        def more() -> bool:
            return engine.command_cuts < cuts + 20 or served[0] < 4 * len(slots)

        try:
            while more() and time.monotonic() < deadline:
                engine.pause(False)  # a command that changes nothing
        finally:
            stop.set()
            peer.join(10)
        assert engine.command_cuts >= cuts + 20, "the scans were not cut short for the commands"
        assert served[0] >= 4 * len(slots), "the slots were not served meanwhile"
        deadline = time.monotonic() + 10
        for lane, i in slots:  # every slot submitted is answered, the ones a cut left too
            while lane._state(i) != R.DONE:
                assert time.monotonic() < deadline, "a slot left for a command was never served"
                time.sleep(0.001)
            assert lane._result(i)[0] == 0
            lane._end(i, done=True)


def test_the_compiled_check_never_takes_what_the_validation_refuses(plane_daemon) -> None:
    """Differential: random requests, well formed and mutated; whatever Gate.check takes,
    KVCore.prepare (the one validation) takes too."""
    d = plane_daemon
    rnd = random.Random(7)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS // 2).numpy()
        c.free(host[-PAGE:].copy())
        cid = c.client_id
        client = d.run(lambda: d.core.client(cid))
        epoch = client.epoch

        def request() -> tuple[np.ndarray, np.ndarray, list[int]]:
            pages = rnd.randint(1, 6)
            rows = host.reshape(-1, PAGE)
            h = np.concatenate([rows[rnd.randrange(len(rows))] for _ in range(pages)])
            dv = np.array(rnd.sample(range(TOKENS), pages * PAGE), dtype=np.int64)
            layers = sorted(rnd.sample(range(START, START + LAYERS), rnd.randint(0, 2)))
            for _ in range(rnd.randint(0, 2)):
                what = rnd.randrange(6)
                if what == 0:
                    h[rnd.randrange(h.size)] += rnd.choice([-1, 1, PAGE, TOKENS])
                elif what == 1:
                    dv[rnd.randrange(dv.size)] = rnd.choice([-1, TOKENS, int(dv[0]), 1 << 40])
                elif what == 2:
                    layers = layers + [rnd.choice([START - 1, START + LAYERS, START])]
                elif what == 3:
                    h[rnd.randrange(h.size)] ^= 1 << (epochs.EPOCH_SHIFT + rnd.randrange(3))
                elif what == 4:
                    dv = dv[:-1]
                else:
                    h = np.concatenate([h, h[:PAGE]])
                    dv = np.concatenate([dv, dv[:PAGE] + 1])
            return h, dv, layers

        taken = refused = 0
        for _ in range(400):
            h, dv, layers = request()
            data = LR.pack(LR.KIND_WRITE, h, dv, layers, PAGE)
            if data is None:  # not whole pages: sent as protobuf, never seen by the plane
                continue

            def judge(h=h, dv=dv, layers=layers, data=data) -> tuple[bool, str]:
                ok = client.gate.check(data)
                try:
                    d.core.prepare(cid, h, dv, layers)
                except KVError as exc:
                    return ok, str(exc)
                return ok, ""

            ok, error = d.run(judge)
            assert not (ok and error), f"the compiled check took {h.tolist()} {dv.tolist()} {layers}: {error}"
            taken += ok
            refused += not ok
        assert taken > 50 and refused > 50  # both sides of the check were exercised
        assert epoch == client.epoch


def test_grpc_and_lane_copies_of_one_client_keep_their_order(plane_daemon) -> None:
    """A Write on gRPC held in the copy queue, then a Load of the same pages on the lane: the
    Load reads what the Write stores (the plane hands it to the loop while the Write runs)."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)  # 512 KiB: queued, never copied inline
        a, b = torch.arange(TOKENS), torch.arange(TOKENS, 2 * TOKENS)
        _fill(pool, 4)
        want = [buf.view(torch.int16)[a].clone() for layer in pool.buffers for buf in layer]
        busy = BusyWorker(d)  # the copy workers (and the plane) held
        req = pb.WriteRequest(client_id=c.client_id, host_indices=host.tolist(), device_indices=a.tolist())
        writer = threading.Thread(target=lambda: c._stub.Write(req, timeout=30))  # the same registration
        try:
            writer.start()
            while d.run(lambda: d.core.copier.queued) < 1:  # the Write waits behind the held workers
                time.sleep(0.001)
            handle = c.load(host_indices=host, device_indices=b)  # the pages the Write stores
            time.sleep(0.3)
            assert not handle.landed(START), "the Load overtook the Write of its pages"
        finally:
            busy.release()
        writer.join(30)
        assert handle.wait(timeout=30) > 0
        got = [buf.view(torch.int16)[b] for layer in pool.buffers for buf in layer]
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_free_waits_for_the_planes_copy_of_its_pages(plane_daemon) -> None:
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)
        dev = torch.arange(TOKENS)
        plane = d.core.plane
        plane.engine.pause(True)
        try:
            handle = c.load(host_indices=host, device_indices=dev)
            # Taken by the plane first (held there): a Free that reaches the loop before the plane
            # has seen the load frees the pages, and the load is refused; lane and gRPC calls
            # keep no order between them that the daemon has not seen.
            deadline = time.monotonic() + 10
            while plane.engine.jobs < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert plane.engine.jobs == 1
            freed = {}
            t = threading.Thread(target=lambda: freed.setdefault("n", c.free(host)))
            t.start()
            time.sleep(0.3)
            assert "n" not in freed, "Free returned while the plane's copy still reads the pages"
        finally:
            plane.engine.pause(False)
        t.join(10)
        assert handle.wait(timeout=10) > 0 and freed["n"] == TOKENS
        assert c.alloc(TOKENS).numel() == TOKENS  # the pages came back


def test_unregister_stops_the_planes_copies_and_frees_everything(plane_daemon) -> None:
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)
        dev = torch.arange(TOKENS)
        d.core.plane.engine.pause(True)
        try:
            handle = c.load(host_indices=host, device_indices=dev)
            time.sleep(0.1)
            c.unregister()
        finally:
            d.core.plane.engine.pause(False)
        with pytest.raises(KVClientError) as exc:  # stopped, and said so (or the lane closed under it)
            handle.wait(timeout=10)
        assert exc.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.UNAVAILABLE), exc.value
        left = d.run(lambda: (len(d.core.clients), d.core.arena.reserved, d.core.plane.engine.jobs))
        assert left == (0, 0, 0)


BIG_LAYOUT, BIG_TOKENS = KVLayout.mha(8, 128), 16384  # 2 KiB a token and part: 64 MiB in one layer


@contextlib.contextmanager
def two_engines(d, small_layers: int = 1, big_host: bool = True) -> Iterator[tuple[KVClient, KVClient]]:
    """Two engines on the daemon, registered: a big one (one layer of 64 MiB, and a region as
    large where ``big_host``) and a small one (64 tokens of ``small_layers`` layers)."""
    with ShmKVPool(BIG_LAYOUT, torch.float16, 1, BIG_TOKENS) as pool, KVClient(d.address) as big, \
            ShmKVPool(BIG_LAYOUT, torch.float16, small_layers, 64) as small_pool, \
            KVClient(d.address) as small:
        big.register(model="big", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                     host_tokens=BIG_TOKENS if big_host else 0, page_size=16)
        small.register(model="small", pool=small_pool, start_layer=0, end_layer=small_layers,
                       num_layers=small_layers, host_tokens=64, page_size=16)
        yield big, small


def held_in_order(engine, *calls: Callable[[], object]) -> float:
    """With the plane held, starts each call (a ``timed`` starter) once the plane holds the copies
    of the ones before; then lets the plane go, and returns when it did."""
    engine.pause(True)
    try:
        for n, call in enumerate(calls, 1):
            call()
            while engine.jobs < n:
                time.sleep(0.001)
    finally:
        start = time.monotonic()
        engine.pause(False)
    return start


def timed(ended: dict[str, float], name: str, fn: Callable[[], object]) -> Callable[[], threading.Thread]:
    """A starter of ``fn`` in a thread that notes in ``ended[name]`` when ``fn`` returned."""
    def run() -> None:
        fn()
        ended[name] = time.monotonic()

    def start() -> threading.Thread:
        t = threading.Thread(target=run)
        t.start()
        ended.setdefault("threads", []).append(t)
        return t

    return start


def joined(ended: dict) -> dict[str, float]:
    for t in ended.pop("threads", []):
        t.join(60)
    return ended


def test_on_the_plane_a_small_load_overtakes_a_large_offload(plane_daemon) -> None:
    """The plane copies loads before writes, in pieces: held while another engine's 64 MiB
    offload and then a 1-page load queue up, the load ends long before the offload does."""
    d = plane_daemon
    with two_engines(d) as (big, small):
        host_small, host_big = small.alloc(16), big.alloc(BIG_TOKENS)
        assert small.write(host_indices=host_small, device_indices=torch.arange(16)) > 0
        ended: dict = {}
        held_in_order(d.core.plane.engine,
                      timed(ended, "offload", lambda: big.write(host_indices=host_big,
                                                                device_indices=torch.arange(BIG_TOKENS))),
                      timed(ended, "load", lambda: small.load(host_indices=host_small,
                                                              device_indices=torch.arange(16, 32)).wait(30)))
        ended = joined(ended)
        assert ended["load"] < ended["offload"], "the load waited for the whole offload"


def test_on_the_plane_a_stream_of_loads_never_starves_a_write(plane_daemon) -> None:
    """Loads go first, but a write waiting behind 16 MiB of loads in a row gets a turn: held while
    one engine's 64 MiB load and then another engine's 1-page write queue up, the write takes a
    turn and ends before the load does."""
    d = plane_daemon
    with two_engines(d) as (big, small):
        host_small, host_big = small.alloc(16), big.alloc(BIG_TOKENS)
        engine = d.core.plane.engine
        turns, ended = engine.write_turns, {}
        held_in_order(engine,
                      timed(ended, "load", lambda: big.load(host_indices=host_big,
                                                            device_indices=torch.arange(BIG_TOKENS)).wait(30)),
                      timed(ended, "write", lambda: small.write(host_indices=host_small,
                                                                device_indices=torch.arange(16))))
        ended = joined(ended)
        # Its turn came after 16 MiB of the load's 64: a write piece ran while the load waited.
        assert engine.write_turns > turns and ended["write"] < ended["load"], ended


def test_on_the_plane_a_write_of_many_layers_is_not_starved_by_a_long_load(plane_daemon) -> None:
    """A write's turn is counted in bytes too: another engine's 1-page write of 32 layers (64
    pieces of one (layer, part) each, 2 MiB) queued behind a held 64 MiB load ends before the load
    does (it used to get one piece per 16 MiB of loads: 4 of its 64 before the load ended)."""
    d = plane_daemon
    with two_engines(d, small_layers=32) as (big, small):
        host_small, host_big = small.alloc(16), big.alloc(BIG_TOKENS)
        ended: dict = {}
        held_in_order(d.core.plane.engine,
                      timed(ended, "load", lambda: big.load(host_indices=host_big,
                                                            device_indices=torch.arange(BIG_TOKENS)).wait(30)),
                      timed(ended, "write", lambda: small.write(host_indices=host_small,
                                                                device_indices=torch.arange(16))))
        ended = joined(ended)
        assert ended["write"] < ended["load"], ended


def test_on_the_plane_a_small_load_of_many_layers_lets_no_waiting_write_in(plane_daemon) -> None:
    """A write's turn comes after 16 MiB of loads in a row, not after a count of pieces: a 2 MiB
    load of 32 layers (64 pieces of one (layer, part) each) queued behind another engine's held
    64 MiB offload runs whole before any piece of it."""
    d = plane_daemon
    with two_engines(d, small_layers=32) as (big, small):
        host_small, host_big = small.alloc(16), big.alloc(BIG_TOKENS)
        engine = d.core.plane.engine
        turns, ended = engine.write_turns, {}
        held_in_order(engine,
                      timed(ended, "offload", lambda: big.write(host_indices=host_big,
                                                                device_indices=torch.arange(BIG_TOKENS))),
                      timed(ended, "load", lambda: small.load(host_indices=host_small,
                                                              device_indices=torch.arange(16)).wait(30)))
        ended = joined(ended)
        assert {"offload", "load"} <= ended.keys()
        assert engine.write_turns == turns, "a write piece ran in the middle of a 2 MiB load"


def test_on_the_plane_a_registrations_load_never_overtakes_its_earlier_load(plane_daemon) -> None:
    """A load may overtake its registration's earlier writes of other pages, never its earlier
    loads: a load held behind a write of its pages holds a later load of other pages too, which so
    ends after the write (the plane marks what may run in one pass over its jobs)."""
    d = plane_daemon
    with two_engines(d) as (big, _):
        host = big.alloc(BIG_TOKENS)
        n = BIG_TOKENS
        engine = d.core.plane.engine
        ended: dict = {}
        held_in_order(
            engine,
            timed(ended, "write", lambda: big.write(host_indices=host[:16], device_indices=torch.arange(16))),
            # 64 MiB that reads the write's host pages: held behind it.
            timed(ended, "load1", lambda: big.load(host_indices=host[: n - 32],
                                                   device_indices=torch.arange(16, n - 16)).wait(30)),
            # Nothing of the write's: free to overtake it, not the load before it.
            timed(ended, "load2", lambda: big.load(host_indices=host[n - 16:],
                                                   device_indices=torch.arange(n - 16, n)).wait(30)))
        ended = joined(ended)
        assert {"write", "load1", "load2"} <= ended.keys()
        assert ended["write"] < ended["load2"], "a load overtook its registration's earlier load"


def test_on_the_plane_a_load_after_a_write_of_the_same_pages_reads_what_it_stored(plane_daemon) -> None:
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)
        a, b = torch.arange(TOKENS), torch.arange(TOKENS, 2 * TOKENS)
        _fill(pool, 9)
        want = [buf.view(torch.int16)[a].clone() for layer in pool.buffers for buf in layer]
        engine = d.core.plane.engine
        engine.pause(True)
        try:
            t = threading.Thread(target=lambda: c.write(host_indices=host, device_indices=a))
            t.start()
            while engine.jobs < 1:
                time.sleep(0.001)
            handle = c.load(host_indices=host, device_indices=b)
            while engine.jobs < 2:
                time.sleep(0.001)
        finally:
            engine.pause(False)
        t.join(30)
        assert handle.wait(timeout=30) > 0
        got = [buf.view(torch.int16)[b] for layer in pool.buffers for buf in layer]
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), "the load overtook the write"


def _grpc_write(c: KVClient, host, dev) -> threading.Thread:
    """A Write of ``c``'s registration sent on gRPC from a thread (its outcome in ``t.result``)."""
    req = pb.WriteRequest(client_id=c.client_id, host_indices=host.tolist(), device_indices=dev.tolist())

    def run() -> None:
        try:
            t.result = c._stub.Write(req, timeout=30)
        except grpc.RpcError as exc:
            t.result = exc

    t = threading.Thread(target=run)
    t.result = None
    t.start()
    return t


def test_a_copy_waiting_for_its_turn_keeps_the_clients_order(plane_daemon) -> None:
    """A plane Load runs (held); a gRPC Write of pages P waits for its turn; then a lane Load of P
    is handed to the loop: it waits behind the Write and reads what the Write stored."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 3 * TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)
        first, rest = host[: TOKENS // 2], host[TOKENS // 2:]
        a = torch.arange(TOKENS // 2)
        b = torch.arange(TOKENS, TOKENS + TOKENS // 2)
        _fill(pool, 11)
        want = [buf.view(torch.int16)[a].clone() for layer in pool.buffers for buf in layer]
        engine = d.core.plane.engine
        engine.pause(True)
        try:
            other = torch.arange(2 * TOKENS, 2 * TOKENS + TOKENS // 2)
            held = c.load(host_indices=rest, device_indices=other)
            while engine.jobs < 1:
                time.sleep(0.001)
            writer = _grpc_write(c, first, a)
            time.sleep(0.2)  # the Write waits for the plane's Load to end
            handle = c.load(host_indices=first, device_indices=b)  # handed to the loop, behind the Write
            time.sleep(0.2)
        finally:
            engine.pause(False)
        writer.join(30)
        assert not isinstance(writer.result, grpc.RpcError), writer.result
        assert held.wait(timeout=30) > 0 and handle.wait(timeout=30) > 0
        got = [buf.view(torch.int16)[b] for layer in pool.buffers for buf in layer]
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), "the Load overtook the Write"


def test_a_copy_waiting_for_its_turn_never_runs_after_its_client_is_released(plane_daemon) -> None:
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)
        engine = d.core.plane.engine
        engine.pause(True)
        try:
            held = c.load(host_indices=host[:PAGE], device_indices=torch.arange(PAGE))
            while engine.jobs < 1:
                time.sleep(0.001)
            writer = _grpc_write(c, host[PAGE:], torch.arange(TOKENS, 2 * TOKENS - PAGE))
            time.sleep(0.2)  # waiting for its turn
            cid = c.client_id
            unregister = threading.Thread(target=lambda: d.call(d.core.unregister(cid)))
            unregister.start()
            time.sleep(0.2)
        finally:
            engine.pause(False)
        unregister.join(30)
        writer.join(30)
        assert isinstance(writer.result, grpc.RpcError), "the Write ran for a released client"
        assert writer.result.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(KVClientError):
            held.wait(timeout=10)
        left = d.run(lambda: (len(d.core.clients), d.core.arena.reserved, d.core.plane.engine.jobs))
        assert left == (0, 0, 0)


def test_a_doorbell_rung_without_end_while_the_lane_goes_is_harmless(plane_daemon) -> None:
    """A peer rings its submit doorbell in a loop while its registration is released, again and
    again: the plane's thread never touches a lane it was told to forget."""
    d = plane_daemon
    for _ in range(5):
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
            lane = c.lane
            stop = threading.Event()

            def ring(lane=lane, stop=stop) -> None:
                while not stop.is_set():
                    try:
                        lane._submit.send(b"s", socket.MSG_DONTWAIT)
                    except OSError:
                        time.sleep(0)

            t = threading.Thread(target=ring)
            t.start()
            time.sleep(0.05)
            cid = c.client_id
            d.call(d.core.unregister(cid))
            stop.set()
            t.join(10)
    # the daemon still serves, on the plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(PAGE)
        served = d.core.plane.engine.served
        assert c.lane is not None and c.lane.request_format == LR.VERSION
        assert c.write(host_indices=host, device_indices=torch.arange(PAGE)) > 0
        assert d.core.plane.engine.served == served + 1, (d.core.plane.engine.handed, c.lane.calls)


def test_a_free_is_not_starved_by_a_stream_of_the_planes_copies(plane_daemon) -> None:
    """Four engine threads load pages P on the lane back to back while a Free of P comes on gRPC:
    the Free ends, with every page, well before the loads would stop by themselves, and the loads
    after it are refused. (While a Free waits, the plane hands the client's new requests to the
    loop, so that a stream of them cannot hold the pages busy for good; this machine's engine
    threads leave gaps between loads either way.)"""
    d = plane_daemon
    threads = 4
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, threads * TOKENS) as pool, _client(d, pool) as c:
        host = c.alloc(TOKENS)
        c.write(host_indices=host, device_indices=torch.arange(TOKENS))
        stop, loaded = threading.Event(), [0]

        def loads(k: int) -> None:
            dev = torch.arange(k * TOKENS, (k + 1) * TOKENS)
            while not stop.is_set():
                try:
                    c.load(host_indices=host, device_indices=dev).wait(timeout=10)
                except KVClientError:  # the pages are freed
                    return
                loaded[0] += 1

        ts = [threading.Thread(target=loads, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        stopper = threading.Timer(8, stop.set)  # the loads end by themselves after 8 s
        stopper.start()
        try:
            while loaded[0] < 20:
                time.sleep(0.001)
            t0 = time.monotonic()
            resp = c._stub.Free(pb.FreeRequest(client_id=c.client_id, host_indices=host.tolist()), timeout=30)
            waited = time.monotonic() - t0
        finally:
            stop.set()
            stopper.cancel()
            for t in ts:
                t.join(30)
        assert resp.freed_tokens == TOKENS and waited < 4, waited


@pytest.mark.parametrize("spin", [0.0, 0.005])
def test_the_plane_serves_whether_its_thread_spins_or_sleeps(socket_dir, spin) -> None:
    """``--plane-spin-us``: 0 sleeps in epoll_wait at once after each request; 5 ms keeps looking
    (yielding) across the engine's next call. Either way every call is served on the plane,
    bit exact, and a call after a long pause (the spin long over) wakes the thread."""
    from conftest import DaemonThread

    from kvserver.config import ServerConfig

    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "spin.sock"), host_memory=64 << 20,
                                  plane_spin=spin))
    try:
        if d.core.plane is None:
            pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
            _fill(pool, 7)
            want = _snapshot(pool)
            host = c.alloc(TOKENS)
            dev = torch.randperm(TOKENS)
            served = d.core.plane.engine.served
            for i in range(20):
                if i == 10:
                    time.sleep(0.05)
                c.write(host_indices=host[:PAGE], device_indices=dev[:PAGE])
                c.load(host_indices=host[:PAGE], device_indices=dev[:PAGE]).wait()
            c.write(host_indices=host, device_indices=dev)
            for buf in (b for layer in pool.buffers for b in layer):
                buf.zero_()
            c.load(host_indices=host, device_indices=dev).wait()
            assert all(torch.equal(a, b) for a, b in zip(_snapshot(pool), want, strict=True))
            assert d.core.plane.engine.served - served == 42, "the calls did not run on the plane"
    finally:
        d.stop()


def test_a_spin_out_of_bounds_is_refused() -> None:
    from kvserver.config import ServerConfig
    from kvserver.lane import plane

    with pytest.raises(ValueError, match="plane spin"):
        ServerConfig(socket="/tmp/unused.sock", plane_spin=0.02)
    if plane._kvlane is None:
        pytest.skip("the compiled data plane is not built")
    with pytest.raises(ValueError, match="spin must be between 0 and 10 ms"):
        plane._kvlane.Engine(0.0, [], -1.0)


def test_the_slot_words_read_with_an_acquire_load_are_the_slot_s() -> None:
    from kvserver.protocol import ring as R

    wire = pytest.importorskip("kvserver.protocol._wire")
    from kvclient._transport.lane import ClientLane

    lane = ClientLane.standalone(slots=2)
    try:
        R.U32.pack_into(lane._mm, R.slot_offset(1) + R.STATE, 3)
        R.U32.pack_into(lane._mm, R.slot_offset(1) + R.PROGRESS_AT + 24, 7)
        assert lane._state(1) == 3 and lane._state(0) == 0
        assert lane._progress(1)[6] == 7
        for slot, offset in [(-1, 0), (2, 0), (64, 0), (0, 2), (0, 128), (0, -4)]:
            with pytest.raises(ValueError):
                wire.word(lane._address, slot, offset)
    finally:
        lane.close()


def test_a_burst_of_handed_over_requests_is_served_a_batch_a_loop_turn(plane_daemon, monkeypatch) -> None:
    """Four lanes of 64 slots each, every slot a Lookup of a whole space (the plane hands those to
    the loop, which serves them at once), all rung together: the loop serves at most HANDOFF_BATCH
    of them a turn, between its other work. Before, it served every request handed over in one
    turn: with 48 such lanes (one tenant may hold 256 registrations) 3072 Lookups of 4 Ki keys held
    the loop 0.3-0.46 s, every other engine's calls with it."""
    from kvclient._transport.fd_socket import lane_ticket_for
    from kvclient._transport.lane import ClientLane
    from kvserver.lane import server as lane_server

    d = plane_daemon
    turn = [0]
    takes: list[int] = []
    take = lane_server.Lane.take

    def counted_take(self, i, rpc, counted=True):
        takes.append(turn[0])
        return take(self, i, rpc, counted)

    monkeypatch.setattr(lane_server.Lane, "take", counted_take)
    ticking = [True]

    def tick() -> None:  # once a turn of the loop, for the turns of the test
        turn[0] += 1
        if ticking[0]:
            d.loop.call_soon(tick)

    lanes: list[ClientLane] = []
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, grpc.insecure_channel(d.address) as ch:
        from ticketing import ticketing_stub

        stub = ticketing_stub(ch, d.address)
        clients = [_client(d, pool, lane="grpc") for _ in range(4)]
        try:
            for c in clients:
                lane = ClientLane(slots=64)
                ticket = lane_ticket_for(d.address, lane)
                stub.OpenLane(pb.OpenLaneRequest(client_id=c.registration.client_id, peer_ticket=ticket),
                              timeout=10)
                lane.handed_over()
                lanes.append(lane)
            requests = [pb.LookupRequest(client_id=c.registration.client_id, keys=os.urandom(16 * 64),
                                         key_bytes=16, whole_space=True).SerializeToString() for c in clients]
            d.loop.call_soon_threadsafe(tick)
            slots = [(lane, lane._begin("Lookup", data)) for lane, data in zip(lanes, requests, strict=True)
                     for _ in range(64)]
            assert all(i is not None for _, i in slots)
            deadline = time.monotonic() + 20
            while not all(lane._state(i) == R.DONE for lane, i in slots) and time.monotonic() < deadline:
                time.sleep(0.005)
            ticking[0] = False
            assert all(lane._state(i) == R.DONE for lane, i in slots)
            assert all(lane._result(i)[0] == 0 for lane, i in slots)  # every Lookup answered OK
        finally:
            ticking[0] = False
            for lane in lanes:
                lane.close()
            for c in clients:
                c.close()
    per_turn = collections.Counter(takes)
    assert len(takes) == 256
    assert max(per_turn.values()) <= 64, sorted(per_turn.values())[-5:]  # plane.HANDOFF_BATCH


def test_a_handed_over_request_that_raises_leaves_the_others_to_the_next_turn(plane_daemon,
                                                                             monkeypatch) -> None:
    """A request whose serving raises (its refusal failing too) ends that turn's batch early: the
    requests queued behind it are served in the next turn of the loop, not left until the plane
    hands something else over (on an idle plane, never)."""
    d = plane_daemon
    plane = d.core.plane
    served: list[int] = []
    pool = ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS)
    client = _client(d, pool)  # a lane: the plane serves on the loop from then on
    assert client.lane is not None

    def serve_one(key, slot, rpc, counted):
        served.append(slot)
        if slot == 0:
            raise RuntimeError("a refusal that failed")

    monkeypatch.setattr(plane, "_serve_one", serve_one)

    def queue_and_serve() -> None:
        plane._handed["lane"] = collections.deque(("lane", i, 0, False) for i in range(3))
        with contextlib.suppress(RuntimeError):
            plane._serve_handed()

    d.run(queue_and_serve)
    deadline = time.monotonic() + 5
    while len(served) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.undo()
    client.close()
    pool.close()
    assert served == [0, 1, 2]
