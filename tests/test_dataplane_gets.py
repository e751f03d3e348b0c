"""A lane Get served whole on the data plane's thread: its request read in C, its keys walked in the
cache's index and its pages held under the cache's lock, copied and answered there, its end settled
on the event loop (docs/design.md, "A Get on the data plane"). The same answers as the gRPC Get, bit
exact; whatever the plane does not take (a bad request, a lock the loop holds) is the loop's, with
the loop's answer; a page the plane holds is never evicted under it; a deadline, a release and a
closing lane end it and let its pages go. Real daemon, real client, real shared memory."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch
from checks import loop_held
from test_dataplane import DTYPE, LAYERS, LAYOUT, PAGE, START, TOKENS, _client, _fill
from test_dataplane_alone import _readers, _until, _zero
from test_dataplane_cache import PAGES, _keys, _pages_of

from kvclient import KVClient, KVClientError, ShmKVPool
from kvclient.load_handle import LoadHandle
from kvserver.core import cache_ops
from kvserver.lane import plane as plane_mod
from kvserver.protocol import ring
from kvserver.store.lock import CacheLock
from kvserver.store.pages import PageTable
from kvserver.v1 import kvserver_pb2 as pb


def _warm(c: KVClient, tag: str) -> None:
    """A client's first Get is the loop's, which gives its gate a cache part: later ones are the plane's."""
    assert c.get([f"warm-{tag}".encode().ljust(16, b".")], torch.arange(1)).wait(timeout=10) == 0


def _served(d) -> int:
    return d.core.plane.plane_gets


def _taken(gate, rpc: int, plain: bytes, crafted: list[bytes], seed: int) -> list[bytes]:
    """Of 600 random mutations of ``plain`` (bit flips, bytes set to edge values or tags, cuts,
    inserted bytes), the requests the plane's reader and check take (``Gate.check_call``); none
    of ``crafted``, forms protobuf reads otherwise or refuses, may be taken."""
    rng = np.random.default_rng(seed)
    edges = [0, 1, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A, 0x20, 0x22, 0x28, 0x2A, 0x30]
    taken = []
    for _ in range(600):
        data = bytearray(plain)
        for _ in range(int(rng.integers(0, 4))):
            at = int(rng.integers(0, len(data)))
            op = int(rng.integers(0, 4))
            if op == 0:
                data[at] ^= 1 << int(rng.integers(0, 8))
            elif op == 1:
                data[at] = int(rng.choice(edges))
            elif op == 2:
                del data[at:]
            else:
                data[at:at] = bytes(rng.integers(0, 256, int(rng.integers(1, 12)), dtype=np.uint8))
            if not data:
                break
        if gate.check_call(rpc, bytes(data)):
            taken.append(bytes(data))
    for form in crafted:
        assert not gate.check_call(rpc, form), f"the plane took a form it must hand over: {form!r}"
    assert len(taken) > 50, len(taken)
    return taken


def test_a_lane_get_is_served_whole_by_the_plane_as_the_rpc_serves_it(plane_daemon) -> None:
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 41)
        src, dst = torch.randperm(PAGES), torch.arange(PAGES, 2 * PAGES)
        want = _pages_of(pool, src[:20])
        assert c.put(_keys("g")[:20], src[:20]).stored == 20
        _warm(c, "a")
        _zero(pool)
        served, before = _served(d), c.stats().clients[0].transfers
        handle = c.get(_keys("g"), dst)  # 20 of 32 stored: the leading 20 load
        assert handle.pages(timeout=10) == 20 and handle.wait(timeout=10) > 0
        assert _served(d) == served + 1, "the Get was not served whole on the plane"
        got = _pages_of(pool, dst[:20])
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        assert not any(x.any() for x in _pages_of(pool, dst[20:])), "a page past the hit was written"
        _until(lambda: _readers(d) == (0, 0))  # its end settled on the loop: the holds went
        after = c.stats().clients[0].transfers
        loaded = (after.load_ops - before.load_ops, after.bytes_loaded - before.bytes_loaded)
        assert loaded == (1, 20 * 16 * 1024)
        # The gRPC Get of the same keys: the same pages, the same bytes.
        _zero(pool)
        assert g.get(_keys("g"), dst).wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, dst[:20]), got, strict=True))
        # Some layers: those asked for land, the others are left alone.
        _zero(pool)
        handle = c.get(_keys("g")[:20], dst[:20], layers=[START + 1, START + 3])
        assert handle.wait(timeout=10) > 0 and handle.landed(START + 3)
        for i, (x, y) in enumerate(zip(_pages_of(pool, dst[:20]), got, strict=True)):
            assert torch.equal(x, y) if i // 2 in (1, 3) else not x.any()
        # Nothing stored: no page, done at once, the misses counted as the loop counts them (and
        # settled before a Stats that follows the answer).
        def misses() -> int:
            return sum(s.counters.misses for s in c.stats().spaces)

        before_misses = misses()
        miss = c.get([b"never-stored-key", b"never-stored-2.."], dst[:2])
        assert miss.pages(timeout=10) == 0 and miss.wait(timeout=10) == 0
        assert _served(d) == served + 3
        assert misses() == before_misses + 2
        # The client learnt that its Gets are the plane's: their first step is looked for, not slept on.
        assert c.lane.plane_gets


def test_what_the_plane_does_not_take_the_loop_answers_as_the_rpc_does(plane_daemon) -> None:
    """Bad Gets (a device page outside the pool or named twice, keys of no whole width, a layer
    outside the range) are handed to the loop, which answers them as the gRPC call does; a Get
    naming another client is the loop's too."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 42)
        assert c.put(_keys("b")[:4], torch.arange(4)).stored == 4
        _warm(c, "b")
        served = _served(d)
        cases = [
            dict(keys=_keys("b")[:2], device_pages=torch.tensor([0, 10_000])),
            dict(keys=_keys("b")[:2], device_pages=torch.tensor([3, 3])),
            dict(keys=_keys("b")[:2], device_pages=torch.tensor([-1, 3])),
            dict(keys=_keys("b")[:2], device_pages=torch.tensor([1])),
            dict(keys=_keys("b")[:2], device_pages=torch.tensor([1, 2]), layers=[START + LAYERS]),
            dict(keys=_keys("b")[:2], device_pages=torch.tensor([1, 2]), layers=[START + 1, START]),
        ]
        for case in cases:
            got = []
            for client in (c, g):
                try:
                    client.get(case["keys"], case["device_pages"], layers=case.get("layers")).wait(timeout=10)
                    got.append(None)
                except KVClientError as exc:
                    got.append((exc.code, exc.message))
            assert got[0] == got[1], (case, got)
        assert _served(d) == served, "the plane took a Get its checks should refuse"
        # A well formed Get in the plane's form, on this lane, naming another registration: the
        # loop's, which refuses it; nothing of the other registration is read or written.
        req = pb.GetRequest(client_id=g.client_id, keys=b"".join(_keys("b")[:1]), key_bytes=16,
                            device_pages=[5])
        source = c.lane.stream("Get", req.SerializeToString(), 10)
        handle = LoadHandle(list(range(START, START + LAYERS)), get=True)
        source.handle, handle._source = handle, source
        with pytest.raises(KVClientError) as exc:
            handle.wait(timeout=10)
        assert exc.value.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT), \
            exc.value
        assert _served(d) == served
        _until(lambda: _readers(d) == (0, 0))


def test_a_get_finding_the_lock_taken_is_served_by_the_loop(plane_daemon) -> None:
    d = plane_daemon
    lock = d.core.cache.lock
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 43)
        src = torch.randperm(PAGES)
        want = _pages_of(pool, src)
        assert c.put(_keys("k"), src).stored == PAGES
        _warm(c, "k")
        served, handed = _served(d), d.core.plane.engine.handed
        d.run(lock.__enter__)  # the loop holds it, as through a change: the plane only tries it
        result: dict = {}
        getter = threading.Thread(target=lambda: result.setdefault(
            "n", c.get(_keys("k"), torch.arange(PAGES, 2 * PAGES)).wait(timeout=20)))
        getter.start()
        try:
            getter.join(30)  # handed over: the loop (which holds the lock) serves it
        finally:
            d.run(lambda: lock.__exit__(None, None, None))
        assert result["n"] > 0 and _served(d) == served, "the plane walked a cache whose lock it did not hold"
        assert d.core.plane.engine.handed == handed + 1
        got = _pages_of(pool, torch.arange(PAGES, 2 * PAGES))
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        # The lock free again, the next Get is the plane's.
        assert c.get(_keys("k"), torch.arange(PAGES, 2 * PAGES)).wait(timeout=10) > 0
        assert _served(d) == served + 1
        _until(lambda: _readers(d) == (0, 0))


def test_a_page_the_plane_holds_is_never_evicted_under_it(daemon_factory, monkeypatch) -> None:
    """One slab's quota: while the plane holds a Get's pages (its copy held back), Puts that fill
    the tenant's slab evict everything else but them; the Get then copies the bytes it found. (No
    pages set aside for the plane's Puts, which would evict ahead: this counts pages evicted.)"""
    monkeypatch.setattr(cache_ops, "STASH_PAGES", 0)
    d = daemon_factory(tenant_quota=str(8 << 20))
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
    engine = d.core.plane.engine
    slab_pages = (8 << 20) // (16 * 1024)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            KVClient(d.address, timeout=0.3, resilient=False) as hasty:
        hasty.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 44)
        src = torch.randperm(PAGES)
        want = _pages_of(pool, src)
        assert c.put(_keys("h"), src).stored == PAGES  # the least recently used of the slab
        for k in range(slab_pages // PAGES - 1):  # the rest of it
            assert c.put(_keys(f"f{k}"), torch.arange(PAGES)).stored == PAGES
        assert c.put(_keys("over"), torch.arange(PAGES)).stored == PAGES  # the quota binds: evicts
        assert c.lookup(_keys("h")).pages == 0 and c.lookup(_keys("f0")).pages == PAGES
        _fill(pool, 45)
        want = _pages_of(pool, src)
        assert c.put(_keys("h"), src).stored == PAGES  # again: the newest, then made the oldest
        for k in range(slab_pages // PAGES - 1):
            c.lookup(_keys(f"f{k}"))
        assert c.lookup(_keys("over")).pages == PAGES
        _warm(c, "h")
        served = _served(d)
        engine.pause(True)
        try:
            handle = c.get(_keys("h"), torch.arange(PAGES, 2 * PAGES))
            assert handle.pages(timeout=5) == PAGES  # found and held; its copy waits
            assert _served(d) == served + 1 and _readers(d)[0] == PAGES
            # A Put that must evict (its copy held back too, and stopped at its deadline): the
            # least recently used pages go, but not those the plane holds.
            with pytest.raises(KVClientError):
                hasty.put(_keys("new"), torch.arange(PAGES, 2 * PAGES))
            assert c.lookup(_keys("h")).pages == PAGES, "a page the plane held was evicted"
        finally:
            engine.pause(False)
        assert handle.wait(timeout=10) > 0
        got = _pages_of(pool, torch.arange(PAGES, 2 * PAGES))
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), "the Get copied other bytes"
        _until(lambda: _readers(d) == (0, 0))


def test_a_plane_get_past_its_deadline_or_released_lets_its_pages_go(plane_daemon) -> None:
    d = plane_daemon
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            KVClient(d.address, timeout=0.3, resilient=False) as hasty:
        hasty.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 45)
        assert c.put(_keys("d"), torch.arange(PAGES)).stored == PAGES
        _warm(hasty, "d1")
        _warm(c, "d2")
        served = _served(d)
        engine.pause(True)
        try:
            late = hasty.get(_keys("d"), torch.arange(PAGES, 2 * PAGES))
            assert late.pages(timeout=5) == PAGES
            assert _served(d) == served + 1
            time.sleep(0.5)
        finally:
            engine.pause(False)
        with pytest.raises(KVClientError) as exc:
            late.wait(timeout=10)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value
        _until(lambda: _readers(d) == (0, 0))
        hasty.unregister()
        engine.pause(True)
        try:
            handle = c.get(_keys("d"), torch.arange(PAGES, 2 * PAGES))
            assert handle.pages(timeout=5) == PAGES and _served(d) == served + 2
            cid = c.client_id
            gate = d.run(lambda: d.core.client(cid).gate)
            gone = threading.Thread(target=lambda: d.call(d.core.unregister(cid)))
            gone.start()
            _until(lambda: gate.closed)  # its copy stops at the next layer boundary
        finally:
            engine.pause(False)
        gone.join(30)
        with pytest.raises(KVClientError) as exc:
            handle.wait(timeout=10)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND, exc.value
    _until(lambda: _readers(d) == (0, 0))
    assert d.run(lambda: (len(d.core.clients), d.core.plane.engine.jobs)) == (0, 0)


def test_the_pages_and_index_change_only_under_the_cache_lock() -> None:
    """Every change the plane's walk reads checks the lock: a path that forgets it raises."""
    table = PageTable(1 << 10)
    table.lock = CacheLock()
    ids = table.take(4)
    with pytest.raises(RuntimeError, match="outside its lock"):
        table.write(ids)
    with table.lock:
        table.write(ids)
        table.commit(ids)
        table.hold(ids)
    with pytest.raises(RuntimeError, match="outside its lock"):
        table.hold(ids, -1)
    assert int(np.sum(table.readers)) == 4


def test_a_lane_closed_mid_get_ends_the_plane_s_copy_and_lets_its_pages_go(plane_daemon) -> None:
    d = plane_daemon
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 46)
        assert c.put(_keys("l"), torch.arange(PAGES)).stored == PAGES
        _warm(c, "l")
        served = _served(d)
        engine.pause(True)
        try:
            handle = c.get(_keys("l"), torch.arange(PAGES, 2 * PAGES))
            assert handle.pages(timeout=5) == PAGES and _served(d) == served + 1
            assert _readers(d)[0] == PAGES
            lane = d.run(lambda: d.core.client(c.client_id).lane)
            d.call(lane.close())  # the plane lets go of the ring: the job ends with it, unanswered
        finally:
            engine.pause(False)
        _until(lambda: _readers(d) == (0, 0) and engine.jobs == 0)


def test_what_the_plane_s_get_check_takes_the_loop_takes_alike(plane_daemon) -> None:
    """Differential: hundreds of random and mutated GetRequests; whatever the plane's reader and
    check take (``Gate.check_call``), protobuf parses to the same request and the loop's checks
    take too."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _warm(c, "x")
        client = d.run(lambda: d.core.client(c.client_id))
        gate = client.gate
        assert gate.cache_gid >= 0
        base = pb.GetRequest(client_id=c.client_id, keys=b"".join(_keys("x")[:3]), key_bytes=16,
                             device_pages=[1, 5, 9], layers=[START, START + 2], timeout_ms=100)
        plain = base.SerializeToString()
        # Forms protobuf reads otherwise or refuses: an over-long tag (6 bytes: refused), a field
        # twice (the last wins), an unpacked repeated field, an unknown field (skipped).
        crafted = [b"\x8a\x80\x80\x80\x80\x00" + plain[1:], plain + plain[:2 + len(c.client_id)],
                   plain + b"\x20\x07", plain + b"\x58\x01"]
        for data in _taken(gate, ring.RPC_GET, plain, crafted, 7):
            parsed = pb.GetRequest.FromString(data)  # protobuf reads what the plane read
            assert parsed.client_id == c.client_id and not parsed.parts and not parsed.lease_id
            assert not parsed.ready_event and not parsed.event_slot
            n = len(parsed.keys) // parsed.key_bytes
            assert 1 <= parsed.key_bytes <= 64 and n * parsed.key_bytes == len(parsed.keys) and n >= 1
            pages = list(parsed.device_pages)
            assert len(pages) == n == len(set(pages)) and all(0 <= p < 2 * TOKENS // PAGE for p in pages)
            layers = list(parsed.layers)
            assert layers == sorted(set(layers)) and all(START <= x < START + LAYERS for x in layers)
            d.run(lambda parsed=parsed: client.spec.layers.select(parsed.layers))  # the loop's layer check


def test_an_engine_s_lookup_is_served_whole_by_the_plane_as_the_rpc_serves_it(plane_daemon) -> None:
    """An engine's Lookup of its own part, walked and answered on the plane's thread: the pages the
    gRPC Lookup finds, the same hits and misses counted, the pages made the most recent; a Lookup
    that pins, asks the whole space, or that the checks refuse is the loop's, answered alike."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 47)
        assert c.put(_keys("q")[:20], torch.arange(20)).stored == 20
        assert c.lookup(_keys("q")[:1]).pages == 1  # the first is the loop's: it gives the gate its part

        def counts(client: KVClient) -> tuple[int, int]:
            spaces = client.stats().spaces
            return sum(s.counters.hits for s in spaces), sum(s.counters.misses for s in spaces)

        lookups = d.core.plane.plane_lookups
        for keys in (_keys("q"), _keys("q")[:20], _keys("z")[:3], _keys("q")[5:9]):
            before = counts(c)
            found = c.lookup(keys).pages
            lane = counts(c)
            assert found == g.lookup(keys).pages
            grpc_counts = counts(g)
            on_lane = (lane[0] - before[0], lane[1] - before[1])
            assert on_lane == (grpc_counts[0] - lane[0], grpc_counts[1] - lane[1])
        assert d.core.plane.plane_lookups == lookups + 4, "the Lookups were not served whole on the plane"
        # The pages it found are the most recent: the first key's page the newest of all.
        assert c.lookup(_keys("q")[3:6]).pages == 3 and d.core.plane.plane_lookups == lookups + 5
        stamps = d.run(lambda: (d.core.plane.settle_gets(), _stamps(d.core.cache, _keys("q")[:20]))[1])
        assert int(np.argmax(stamps)) == 3
        assert stamps[3] > stamps[4] > stamps[5] > max(np.delete(stamps, [3, 4, 5]))
        # More than 127 pages: a two-byte count in the answer.
        for k in range(3):
            assert c.put(_keys(f"m{k}", 60), torch.arange(60)).stored == 60
        many = [key for k in range(3) for key in _keys(f"m{k}", 60)]
        assert c.lookup(many).pages == 180 == g.lookup(many).pages
        assert d.core.plane.plane_lookups == lookups + 6
        # The loop's: a pin (its lease), the whole space, keys of no width the check takes.
        lookups = d.core.plane.plane_lookups
        pinned = c.lookup(_keys("q")[:4], pin_ms=500)
        assert pinned.pages == 4 and pinned.lease_id
        c.release(pinned.lease_id)
        assert c.lookup(_keys("q"), whole_space=True).pages == 20
        wide = [k * 5 for k in _keys("q")[:2]]  # 80 bytes: wider than the index takes
        answers = []
        for client in (c, g):
            try:
                answers.append(client.lookup(wide, key_bytes=80).pages)
            except KVClientError as exc:
                answers.append((exc.code, exc.message))
        assert answers[0] == answers[1], answers
        assert d.core.plane.plane_lookups == lookups


@pytest.mark.parametrize(("batch", "ids", "want"), [(2, 1 << 16, [2, 2, 1]), (256, 5, [2, 2, 1]),
                                                   (256, 3, [1, 1, 1, 1, 1]), (256, 0, [1, 1, 1, 1, 1])])
def test_the_loop_settles_the_plane_s_ends_a_batch_a_turn(plane_daemon, monkeypatch, batch, ids,
                                                           want) -> None:
    """Ends the plane posted while the loop was busy (Gets', whose pages it let go) are settled
    ``SETTLE_BATCH`` a turn of the loop, and past the first no more than carry ``SETTLE_IDS`` page
    ids, the rest in the turns after (posting no wake-up of their own), every one of them."""
    d = plane_daemon
    monkeypatch.setattr(plane_mod, "SETTLE_BATCH", batch)
    monkeypatch.setattr(plane_mod, "SETTLE_IDS", ids)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        assert c.put(_keys("b")[:8], torch.arange(8)).stored == 8
        assert c.get(_keys("b")[:1], torch.arange(8, 9)).wait(timeout=10) > 0  # gives the gate its part
        d.run(d.core.plane.settle_gets)
        plane, batches = d.core.plane, []
        real = plane._get_ended

        def settled(ends: list) -> None:
            batches.append(len(ends))
            real(ends)

        monkeypatch.setattr(plane, "_get_ended", settled)
        gets = plane.plane_gets
        with loop_held(d.loop):
            for k in range(5):
                handle = c.get(_keys("b")[k: k + 2], torch.arange(8 + 2 * k, 10 + 2 * k))
                assert handle.pages(timeout=10) == 2 and handle.wait(timeout=10) > 0
        assert plane.plane_gets == gets + 5, "the Gets were not the plane's"
        _until(lambda: sum(batches) == 5)
        assert batches == want, batches
        pages = d.run(lambda: d.core.cache.pages)
        assert not pages.readers.any(), "a Get's pages were not let go"


def test_a_lookup_the_plane_answers_leaves_the_loop_nothing_to_settle(plane_daemon) -> None:
    """In a cache with no tier below host memory, an engine's Lookup the plane answers makes its
    pages recent in its walk and counts its hits and misses in the gate: with the loop held
    throughout, the pages are the most recent already, the first key's the newest, and no end waits
    for the loop (so none is handed to it for want of room); a Stats then counts every hit and
    miss."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        assert c.put(_keys("r")[:20], torch.arange(20)).stored == 20
        assert c.lookup(_keys("r")[:1]).pages == 1  # the first is the loop's: it gives the gate its part
        plane = d.core.plane
        d.run(plane.settle_gets)
        spaces = c.stats().spaces
        hits, misses = sum(s.counters.hits for s in spaces), sum(s.counters.misses for s in spaces)
        lookups, ends = plane.plane_lookups, plane.engine.ends_waiting
        with loop_held(d.loop):
            for k in (9, 6, 3):  # keys k.. k + 2 of those stored, then two missed
                assert c.lookup(_keys("r")[k: k + 3]).pages == 3
            assert c.lookup([_keys("r")[0], b"missing".ljust(16, b".")]).pages == 1
            assert c.lookup([b"gone".ljust(16, b".")]).pages == 0
            assert plane.plane_lookups == lookups + 5, "the Lookups were not the plane's"
            assert plane.engine.ends_waiting == ends == 0, "a Lookup left the loop an end to settle"
            stamps = _stamps(d.core.cache, _keys("r")[:20])
        assert int(np.argmax(stamps)) == 0  # the last Lookup's first key: the newest of all
        assert stamps[0] > stamps[3] > stamps[4] > stamps[5] > stamps[6] > stamps[7] > stamps[8] > stamps[9]
        assert stamps[9] > stamps[10] > stamps[11] > max(np.delete(stamps, [0, 3, 4, 5, 6, 7, 8, 9, 10, 11]))
        spaces = c.stats().spaces
        assert sum(s.counters.hits for s in spaces) - hits == 10
        assert sum(s.counters.misses for s in spaces) - misses == 2


def test_a_lane_owing_its_turns_credit_is_served_without_a_nap(daemon_factory) -> None:
    """A Lookup of 128 keys costs a lane more than a turn's credit, so the turn after it takes
    nothing of that lane, which stays pending. The thread then runs its next turn at once: it naps
    only for CUDA jobs waiting on the GPU, and this daemon has none. (It napped 1 ms there, until a
    doorbell: the engine's next call, already rung, waited for the nap; every other one of these
    Lookups took over a millisecond instead of tens of microseconds.) The plane never spins here,
    so every call rings and finds the thread asleep."""
    d = daemon_factory(plane_spin=0)
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
    engine = d.core.plane.engine
    keys = [f"owing-{i}".encode().ljust(16, b".") for i in range(128)]
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        assert c.put(keys[:PAGES], torch.arange(PAGES)).stored == PAGES
        assert c.lookup(keys[:1]).pages == 1  # the first is the loop's: it gives the gate its part
        lookups, naps, took = d.core.plane.plane_lookups, engine.naps, []
        for _ in range(40):
            t = time.perf_counter()
            assert c.lookup(keys).pages == PAGES
            took.append(time.perf_counter() - t)
        assert d.core.plane.plane_lookups == lookups + 40, "the Lookups were not the plane's"
        assert engine.naps == naps, f"the thread napped {engine.naps - naps} times with no CUDA job"
        assert sorted(took)[20] < 0.5e-3 or sum(t > 1e-3 for t in took) < 10, took


def test_a_lane_kept_busy_is_taken_no_more_once_the_plane_watches_no_lane(plane_daemon) -> None:
    """At shutdown the plane takes nothing new (``unwatch_all``, the drain's first step): not even
    the slots of a lane its engine keeps full, which was pending in the thread's turns then."""
    d = plane_daemon
    plane = d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        assert c.put(_keys("u")[:8], torch.arange(8)).stored == 8
        assert c.lookup(_keys("u")[:1]).pages == 1  # the first is the loop's: it gives the gate its part
        stop, answered = threading.Event(), []

        def look() -> None:  # back to back, four at a time on the one lane
            while not stop.is_set():
                try:
                    answered.append(c.lookup(_keys("u")[:4], timeout=1).pages)
                except KVClientError:
                    return

        threads = [threading.Thread(target=look) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            _until(lambda: len(answered) >= 200)
            plane.engine.unwatch_all()
            time.sleep(0.05)  # (a call the thread took before it stopped watching is answered)
            taken = plane.plane_lookups
            time.sleep(0.5)
            assert plane.plane_lookups == taken, "the plane took a slot after it stopped watching"
        finally:
            stop.set()
            for t in threads:
                t.join(10)


def _stamps(cache, keys: list[bytes]) -> np.ndarray:
    """The LRU stamps of the pages of ``keys`` (all stored) in their one part of ``cache``."""
    from kvserver.store.keys import as_keys
    (part,) = [p for s in cache._spaces.values() for p in s.parts.values()]
    ids = cache.pages.find(part.gid, as_keys(keys))
    assert (ids >= 0).all()
    return cache.pages.stamp[ids].copy()


def test_what_the_plane_s_lookup_check_takes_the_loop_takes_alike(plane_daemon) -> None:
    """Differential, as for a Get: whatever the plane's Lookup reader and check take
    (``Gate.check_call``), protobuf parses to an engine's plain Lookup of its own part, within
    the keys the loop walks at once."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        assert c.lookup(_keys("y")[:1]).pages == 0
        gate = d.run(lambda: d.core.client(c.client_id).gate)
        assert gate.cache_gid >= 0
        plain = pb.LookupRequest(client_id=c.client_id, keys=b"".join(_keys("y")[:3]), key_bytes=16,
                                 timeout_ms=50).SerializeToString()
        crafted = [b"\x8a\x80\x80\x80\x80\x00" + plain[1:], plain + plain[:2 + len(c.client_id)],
                   plain + b"\x28\x01", plain + b"\x30\x01", plain + b"\x12\x01s", plain + b"\x48\x01",
                   pb.LookupRequest(client_id=c.client_id, keys=b"k" * 130, key_bytes=65).SerializeToString()]
        for data in _taken(gate, ring.RPC_LOOKUP, plain, crafted, 11):
            parsed = pb.LookupRequest.FromString(data)
            assert parsed.client_id == c.client_id and not parsed.space_id
            assert not parsed.pin_ms and not parsed.whole_space
            n = len(parsed.keys) // parsed.key_bytes
            assert 1 <= parsed.key_bytes <= 64 and n * parsed.key_bytes == len(parsed.keys) and n >= 1
            assert n <= 1024


def test_a_put_of_keys_all_stored_is_answered_by_the_plane_as_the_rpc_answers_it(plane_daemon) -> None:
    """A Put whose keys are all stored copies nothing: the plane answers it (present, counted so);
    one with a key not stored, or a device page the checks refuse, is the loop's, answered alike."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 48)
        assert c.put(_keys("p")[:8], torch.arange(8)).stored == 8  # the loop's: gives the gate its part

        def dedup(client: KVClient) -> tuple[int, int, int]:
            stats = client.stats()
            return (sum(s.counters.dedup_pages for s in stats.spaces),
                    sum(s.counters.dedup_bytes for s in stats.spaces),
                    sum(t.counters.dedup_pages for t in stats.tenants))

        puts = d.core.plane.plane_puts
        for keys in (_keys("p")[:8], _keys("p")[2:5], [_keys("p")[1]] * 2):
            before = dedup(c)
            lane = c.put(keys, torch.arange(8, 8 + len(keys)))
            mid = dedup(c)
            rpc = g.put(keys, torch.arange(8, 8 + len(keys)))
            after = dedup(g)
            outcome = (lane.stored, lane.present, lane.dropped, lane.bytes)
            assert outcome == (rpc.stored, rpc.present, rpc.dropped, rpc.bytes) == (0, len(keys), 0, 0)
            counted = tuple(m - b for m, b in zip(mid, before, strict=True))
            assert counted == tuple(a - m for a, m in zip(after, mid, strict=True)) != (0, 0, 0)
        assert d.core.plane.plane_puts == puts + 3, "the Puts were not answered on the plane"
        # The loop's: a key not stored yet (it takes a page), a device page outside the pool.
        got = c.put(_keys("p")[:9], torch.arange(9))
        assert (got.stored, got.present) == (1, 8)
        answers = []
        for client in (c, g):
            try:
                client.put(_keys("p")[:2], torch.tensor([0, 10_000]))
                answers.append(None)
            except KVClientError as exc:
                answers.append((exc.code, exc.message))
        assert answers[0] == answers[1] and answers[0] is not None, answers
        assert d.core.plane.plane_puts == puts + 3
        gate = d.run(lambda: d.core.client(c.client_id).gate)
        plain = pb.PutRequest(client_id=c.client_id, keys=b"".join(_keys("p")[:3]), key_bytes=16,
                              device_pages=[1, 2, 3], timeout_ms=50).SerializeToString()
        unpacked = pb.PutRequest(client_id=c.client_id, keys=_keys("p")[0], key_bytes=16).SerializeToString()
        assert pb.PutRequest.FromString(unpacked + b"\x20\x05").device_pages == [5]  # (protobuf reads it)
        # Differential: what the plane's check takes, protobuf parses to a plain Put whose device
        # pages the loop's checks take. Never: no device page, a ready event, an unpacked page, an
        # over-long tag, an unknown field.
        crafted = [unpacked, plain + b"\x2a\x01e", unpacked + b"\x20\x05",
                   b"\x8a\x80\x80\x80\x80\x00" + plain[1:], plain + b"\x38\x01"]
        for data in _taken(gate, ring.RPC_PUT, plain, crafted, 13):
            parsed = pb.PutRequest.FromString(data)
            assert parsed.client_id == c.client_id and not parsed.ready_event
            n = len(parsed.keys) // parsed.key_bytes
            assert 1 <= parsed.key_bytes <= 64 and n * parsed.key_bytes == len(parsed.keys) and 1 <= n <= 1024
            pages = list(parsed.device_pages)
            assert len(pages) == n == len(set(pages)) and all(0 <= p < 2 * TOKENS // PAGE for p in pages)
