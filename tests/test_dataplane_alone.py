"""A Get or Put on the lane of a registration the data plane serves, served without a task while
nothing else of its client is in flight: the event loop checks and plans it where the plane hands
it over (the RPC's own checks and plan) and the plane's thread copies it; a Get's copy also
answers its slot (``CacheOps.get_on_plane``, ``DataPlane.copy`` with an ``Answer``), a Put is
answered by the loop once its pages are committed (``put_on_plane``). The same answers as the
gRPC calls, bit exact; never ahead of an earlier copy of the registration; a deadline, the
client's release and a lane closing mid-copy end it and let its pages go. Real daemon, real
client, real shared memory. The plane's thread serving a Get whole (test_dataplane_gets.py) is off
here: these are the Gets it hands over (the first of each client, and any it does not take)."""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import pytest
import torch
from checks import being_written, wait_until
from test_dataplane import DTYPE, LAYERS, LAYOUT, PAGE, START, TOKENS, _client, _fill
from test_dataplane_cache import PAGES, _keys, _pages_of, _zero
from test_lane_doorbells import pending

from kvclient import KVClient, KVClientError, ShmKVPool
from kvserver.store.pages import WRITING


@pytest.fixture(autouse=True)
def _gets_on_the_loop(monkeypatch) -> None:
    monkeypatch.setattr("kvserver.lane.plane.GETS", False)


def _readers(d) -> tuple[int, int]:
    """Pages being read, and holds of their slabs: none left once every call ended. (Free pages
    set aside for the data plane's Puts, each a hold of its slab, are not counted: being written,
    in no part.)"""
    def read() -> tuple[int, int]:
        p = d.core.cache.pages
        stashed = int(((p.state == WRITING) & (p.part == -1)).sum())
        return int(p.readers.sum()), int(p.slab_holds.sum()) - stashed

    return d.run(read)


def test_a_lane_get_is_answered_by_the_plane_as_the_rpc_answers_it(plane_daemon) -> None:
    d = plane_daemon
    plane = d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        assert c.lane is not None
        _fill(pool, 31)
        src, dst = torch.randperm(PAGES), torch.arange(PAGES, 2 * PAGES)
        want = _pages_of(pool, src)
        assert c.put(_keys("g")[:20], src[:20]).stored == 20
        answered = plane.answered
        _zero(pool)
        handle = c.get(_keys("g"), dst)  # 20 of 32 stored: the leading 20 load
        assert handle.pages(timeout=10) == 20 and handle.wait(timeout=10) > 0
        assert plane.answered == answered + 1, "the Get did not take the plane's path"
        got = _pages_of(pool, dst[:20])
        assert all(torch.equal(x, y) for x, y in zip(got, _pages_of_want(want, 20), strict=True))
        assert not any(x.any() for x in _pages_of(pool, dst[20:])), "a page past the hit was written"
        # The same request over gRPC: the same pages, the same bytes.
        _zero(pool)
        other = g.get(_keys("g"), dst)
        assert other.pages(timeout=10) == 20 and other.wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, dst[:20]), got, strict=True))
        # Some layers: those asked for land, the others are left alone.
        _zero(pool)
        handle = c.get(_keys("g")[:20], dst[:20], layers=[START + 1, START + 3])
        assert handle.wait(timeout=10) > 0 and handle.landed(START + 3)
        for i, (x, y) in enumerate(zip(_pages_of(pool, dst[:20]), got, strict=True)):
            assert torch.equal(x, y) if i // 2 in (1, 3) else not x.any()
        # Nothing stored: no page, done at once; and a key of another width stores nothing either.
        miss = c.get([b"never-stored-key"], dst[:1])
        assert miss.pages(timeout=10) == 0 and miss.wait(timeout=10) == 0
        assert plane.answered == answered + 2
        # What the checks refuse comes back with the RPC's status, the request untouched.
        with pytest.raises(KVClientError) as exc:
            c.get(_keys("g")[:2], torch.tensor([1, 1])).wait(timeout=10)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value
        with pytest.raises(KVClientError) as exc:
            c.get(_keys("g")[:1], torch.tensor([10_000])).wait(timeout=10)
        assert exc.value.code == grpc.StatusCode.OUT_OF_RANGE, exc.value
    assert _readers(d) == (0, 0), "a page is still held as being read"


def _misses(d) -> int:
    tenant = f"uid:{os.getuid()}"
    return d.run(lambda: d.core.cache.tenants.get(tenant).counters.misses)


def _pages_of_want(want: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    # want holds the first put's pages, per (layer, part) buffer, page after page: the first n pages.
    return [w[: n * PAGE] for w in want]


def test_a_lane_get_never_overtakes_an_earlier_write_of_its_device_pages(plane_daemon) -> None:
    """A Write of device pages P queued on the held plane, then a Get into P: the Get's copy, taken
    by the plane, runs after the Write (after every earlier job of its gate), so the Write stores
    P as it was before the Get brought other bytes; a Put behind a copy of the plane's goes to
    the task path, which waits for it."""
    d = plane_daemon
    engine, plane = d.core.plane.engine, d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 32)
        p = torch.arange(PAGES)
        assert c.put(_keys("w"), torch.arange(PAGES, 2 * PAGES)).stored == PAGES  # other bytes
        before = _pages_of(pool, p)
        host = c.alloc(TOKENS)
        answered = plane.answered
        result: dict = {}
        engine.pause(True)
        try:
            writer = threading.Thread(target=lambda: result.setdefault(
                "write", c.write(host_indices=host, device_indices=torch.arange(TOKENS))))
            writer.start()
            while engine.jobs < 1:
                time.sleep(0.001)
            misses = _misses(d)
            handle = c.get(_keys("w")[:28] + _keys("x")[:4], p)  # 4 misses, counted once
            time.sleep(0.2)
            assert not handle.landed(START), "the Get overtook the Write reading its pages"
        finally:
            engine.pause(False)
        writer.join(30)
        assert result["write"] > 0 and handle.wait(timeout=30) > 0 and handle.pages() == 28
        assert plane.answered == answered + 1, "the Get did not go to the plane behind its Write"
        assert _misses(d) == misses + 4, "the Get's misses were counted twice"
        _zero(pool)
        assert c.load(host_indices=host, device_indices=torch.arange(TOKENS)).wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, p), before, strict=True))
        assert c.put(_keys("w")[28:], p[28:]).present == 4  # (the Get did not store)
        assert c.get(_keys("w"), p).wait(timeout=10) > 0 and plane.answered == answered + 2
        # A Put behind a Write of the plane's: not alone, the task path orders it.
        alone = d.core.copier.alone_copies
        engine.pause(True)
        try:
            writer = threading.Thread(target=c.write, kwargs=dict(host_indices=host,
                                                                  device_indices=torch.arange(TOKENS)))
            writer.start()
            while engine.jobs < 1:
                time.sleep(0.001)
            putter = threading.Thread(target=lambda: result.setdefault("put", c.put(_keys("z"), p)))
            putter.start()
            # Held until the Put took its pages on the task path: let go before, a slow machine's Put
            # (the sanitized job's) came after the Write had ended, alone, and the plane copied it.
            wait_until(lambda: being_written(d) == PAGES, 30, "the Put never reached the daemon")
        finally:
            engine.pause(False)
        writer.join(30)
        putter.join(30)
        assert result["put"].stored == PAGES and d.core.copier.alone_copies == alone


def test_a_lane_get_past_its_deadline_or_released_ends_and_lets_its_pages_go(plane_daemon) -> None:
    d = plane_daemon
    engine, plane = d.core.plane.engine, d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            KVClient(d.address, timeout=0.3, resilient=False) as hasty:
        hasty.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 33)
        assert c.put(_keys("d"), torch.arange(PAGES)).stored == PAGES
        answered = plane.answered
        engine.pause(True)
        try:
            late = hasty.get(_keys("d"), torch.arange(PAGES, 2 * PAGES))
            assert late.pages(timeout=5) == PAGES  # said before the copy, which the plane holds
            _until(lambda: plane.answered == answered + 1 and _readers(d)[0] == PAGES)
            time.sleep(0.5)
        finally:
            engine.pause(False)
        with pytest.raises(KVClientError) as exc:
            late.wait(timeout=10)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value
        _until(lambda: _readers(d) == (0, 0))
        hasty.unregister()
        # Released mid-copy: NOT_FOUND, and its pages are let go.
        engine.pause(True)
        try:
            handle = c.get(_keys("d"), torch.arange(PAGES, 2 * PAGES))
            assert handle.pages(timeout=5) == PAGES
            _until(lambda: plane.answered == answered + 2)
            cid = c.client_id
            gone = threading.Thread(target=lambda: d.call(d.core.unregister(cid)))
            gone.start()
            time.sleep(0.2)
        finally:
            engine.pause(False)
        gone.join(30)
        with pytest.raises(KVClientError) as exc:
            handle.wait(timeout=10)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND, exc.value
    _until(lambda: _readers(d) == (0, 0))
    assert d.run(lambda: (len(d.core.clients), engine.jobs)) == (0, 0)


def test_a_lane_closed_mid_get_ends_its_copy_and_lets_its_pages_go(plane_daemon) -> None:
    """The engine's lane goes (its process closed its end) while the plane holds its Get's copy:
    the copy ends with the lane, nothing is written to its ring, and the pages are let go."""
    d = plane_daemon
    engine, plane = d.core.plane.engine, d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 34)
        assert c.put(_keys("l"), torch.arange(PAGES)).stored == PAGES
        answered = plane.answered
        engine.pause(True)
        try:
            handle = c.get(_keys("l"), torch.arange(PAGES, 2 * PAGES))
            assert handle.pages(timeout=5) == PAGES
            _until(lambda: plane.answered == answered + 1)
            lane = d.run(lambda: d.core.client(c.client_id).lane)
            d.call(lane.close())
        finally:
            engine.pause(False)
        _until(lambda: d.run(lambda: engine.jobs) == 0 and _readers(d) == (0, 0))
        with pytest.raises(KVClientError):
            handle.wait(timeout=10)


def _until(cond, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def test_a_lane_put_is_copied_alone_and_committed_before_its_answer(plane_daemon) -> None:
    """New keys: stored, committed (a Lookup right after finds them) and bit exact; the same keys
    again: present, nothing copied; some new, some stored: the same counts as a gRPC Put gives."""
    d = plane_daemon
    copier = d.core.copier
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 35)
        src = torch.randperm(PAGES)
        want = _pages_of(pool, src)
        alone = copier.alone_copies
        got = c.put(_keys("p"), src)
        assert (got.stored, got.present, got.dropped) == (PAGES, 0, 0) and got.bytes > 0
        assert copier.alone_copies == alone + 1, "the Put did not take the plane's path alone"
        assert c.lookup(_keys("p")).pages == PAGES  # committed before the answer
        again = c.put(_keys("p"), src)
        assert (again.stored, again.present, again.bytes) == (0, PAGES, 0)
        assert copier.alone_copies == alone + 1  # nothing to copy
        dst = torch.arange(PAGES, 2 * PAGES)
        _zero(pool)
        assert g.get(_keys("p"), dst).wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, dst), want, strict=True))
        # Half new, half stored: the same counts on both lanes (each Put its own new keys).
        mixed = _keys("p")[:8] + _keys("q")[:8]
        on_lane = c.put(mixed, torch.arange(16))
        on_grpc = g.put(_keys("p")[:8] + _keys("r")[:8], torch.arange(16))
        assert (on_lane.stored, on_lane.present) == (on_grpc.stored, on_grpc.present) == (8, 8)
        assert copier.alone_copies == alone + 2
        with pytest.raises(KVClientError) as exc:
            c.put(_keys("s")[:2], torch.tensor([3, 3]))
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value
        assert c.lookup(_keys("s")[:2]).pages == 0
    assert _readers(d) == (0, 0)


def test_a_lane_put_past_its_deadline_stores_nothing_and_the_next_one_goes_alone(plane_daemon) -> None:
    d = plane_daemon
    engine, copier = d.core.plane.engine, d.core.copier
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            KVClient(d.address, timeout=0.3, resilient=False) as hasty:
        hasty.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 36)
        alone = copier.alone_copies
        engine.pause(True)
        try:
            with pytest.raises(KVClientError) as exc:
                hasty.put(_keys("t"), torch.arange(PAGES))
        finally:
            engine.pause(False)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value
        assert copier.alone_copies == alone + 1
        _until(lambda: d.run(lambda: engine.jobs) == 0)
        assert c.lookup(_keys("t")).pages == 0  # nothing half written is found
        got = hasty.put(_keys("t"), torch.arange(PAGES))  # its count was given back: alone again
        assert got.stored == PAGES and copier.alone_copies == alone + 2
        hasty.unregister()
    assert _readers(d) == (0, 0)


def test_a_lane_lookup_is_answered_at_once_as_the_rpc_answers_it(plane_daemon) -> None:
    """A Lookup on the lane runs whole where the plane hands it over: the same pages as the gRPC
    Lookup (a prefix, a miss, one of more keys than a numpy step takes), a lease that pins what it
    found (a Get names it), and a refusal (pin_ms past its bound) with the RPC's status."""
    d = plane_daemon
    ops = d.daemon.servicer.cache
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 37)
        assert c.put(_keys("k")[:12], torch.arange(12)).stored == 12
        now = ops.lookups_now
        # 3000 keys (more than a step of the numpy walk, one of the compiled walk's): a slot's
        # 48 000 bytes; 5000 (80 000 bytes) go on gRPC, stepped
        for keys in (_keys("k"), _keys("k")[:5], _keys("nope")[:3], [], _keys("k", 3000)):
            assert c.lookup(keys).pages == g.lookup(keys).pages
        assert ops.lookups_now == now + 5, "the lane's Lookups did not run at once"
        assert c.lookup(_keys("k", 5000)).pages == 12 and ops.lookups_now == now + 5
        pinned = c.lookup(_keys("k"), pin_ms=30_000)
        assert pinned.pages == 12 and pinned.lease_id
        assert d.run(lambda: len(d.core.cache.leases.leases)) == 1
        assert c.get(_keys("k")[:12], torch.arange(12, 24), lease_id=pinned.lease_id).wait(timeout=10) > 0
        c.release([pinned.lease_id])
        with pytest.raises(KVClientError) as exc:
            c.lookup(_keys("k"), pin_ms=10**9)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value
    assert _readers(d) == (0, 0)


def test_a_call_whose_part_is_refused_is_answered_by_the_task_path_quietly(plane_daemon, caplog) -> None:
    """A registration whose layers clash with its space's part (another range under the same PP
    stage) has every Put and Get refused FAILED_PRECONDITION: the path without a task leaves it to
    the RPC's code, which words the error, and logs nothing about it."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            ShmKVPool(LAYOUT, DTYPE, LAYERS - 1, 2 * TOKENS) as fewer, \
            KVClient(d.address, timeout=10, resilient=False) as clash:
        assert c.put(_keys("c")[:2], torch.arange(2)).stored == 2
        clash.register(model="plane", pool=fewer, start_layer=START, end_layer=START + LAYERS - 1,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        caplog.clear()
        caplog.set_level(logging.ERROR, logger="kvserver")
        for call in (lambda: clash.put(_keys("c")[:2], torch.arange(2)),
                     lambda: clash.get(_keys("c")[:2], torch.arange(2, 4)).wait(timeout=10)):
            with pytest.raises(KVClientError) as exc:
                call()
            assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION, exc.value
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        clash.unregister()


def test_after_a_get_the_plane_takes_the_next_call_without_waiting_for_the_loop(plane_daemon) -> None:
    """The plane gives a Get's count back as soon as it holds the Get's copy: the engine's next
    binary Load is the plane's even while the event loop has not yet settled the Get (held busy
    here for 1.5 s), and lands after the Get."""
    d = plane_daemon
    engine, plane = d.core.plane.engine, d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 38)
        host = c.alloc(TOKENS)
        assert c.write(host_indices=host, device_indices=torch.arange(TOKENS, 2 * TOKENS)) > 0
        assert c.put(_keys("n"), torch.arange(PAGES)).stored == PAGES
        loaded = _pages_of(pool, torch.arange(PAGES, 2 * PAGES))
        answered, result = plane.answered, {}
        engine.pause(True)
        try:
            getter = threading.Thread(target=lambda: result.setdefault(
                "get", c.get(_keys("n"), torch.arange(PAGES)).wait(timeout=10)))
            getter.start()
            _until(lambda: plane.answered == answered + 1)
            d.loop.call_soon_threadsafe(time.sleep, 1.5)  # the loop is busy from here
            time.sleep(0.05)
            held = time.monotonic()
        finally:
            engine.pause(False)
        getter.join(10)
        served = engine.served
        assert result["get"] > 0 and c.load(host_indices=host, device_indices=torch.arange(TOKENS)).wait(
            timeout=10) > 0
        took = time.monotonic() - held
        assert engine.served == served + 1 and took < 1.0, f"the Load waited {took:.2f} s for the loop"
        got = _pages_of(pool, torch.arange(PAGES))
        assert all(torch.equal(x, y) for x, y in zip(got, loaded, strict=True)), "the Load ran before the Get"
        time.sleep(1.5)
    _until(lambda: _readers(d) == (0, 0))


def test_a_small_get_rings_a_sleeping_engine_once_and_a_large_one_for_its_first_step(
        daemon_factory, monkeypatch) -> None:
    """An answering copy of at most 1 MiB publishes its first step (the pages found) without a
    ring: a sleeping engine is woken once, at its end, not also for its first step and layer. A
    larger one rings for its first step, so that an engine asleep learns its hit before the layers
    land. The engine is made to look asleep (its slots' waiting words set before the loop plans
    the Get) and never waits: the rings are counted on its doorbells once the Get is done. The
    progress interval is long (1 s), so that a copy slowed by a busy machine is not rung for a
    layer before its end as well."""
    from kvserver.core.cache_ops import CacheOps
    from kvserver.protocol import ring as R

    d = daemon_factory(progress_interval=1.0)
    if d.core.plane is None:
        if os.environ.get("KVSERVER_EXPECT_PLANE"):  # scripts/sanitize.sh: a skip would hide the job
            pytest.fail("the compiled data plane is not running")
        pytest.skip("the compiled data plane is not built (or KVSERVER_DATA_PLANE=python)")
    tokens = 4096
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, tokens) as pool, \
            KVClient(d.address, timeout=10, resilient=False) as c:
        c.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                   num_layers=START + LAYERS + 2, host_tokens=tokens, page_size=PAGE)
        lane = c.lane
        assert lane is not None and lane._c is not None
        pages = tokens // PAGE  # 256 pages of 16 KiB: 4 MiB
        assert c.put(_keys("r", pages), torch.arange(pages)).stored == pages
        original = CacheOps.get_on_plane

        def asleep(self, req, answer, ended):  # on the loop, before the first step is published
            for i in range(lane.slots):
                R.U32.pack_into(lane._mm, R.slot_offset(i) + R.WAITING_AT, 1)
            return original(self, req, answer, ended)

        monkeypatch.setattr(CacheOps, "get_on_plane", asleep)
        answered, now = d.core.plane.answered, d.core.plane.now
        # 1 and 8 pages (16 and 128 KiB): copied where the loop plans them; 32 (512 KiB): by the
        # plane's thread, its first step unrung; 256 (4 MiB): its first step rung.
        for n, most in ((1, 1), (8, 1), (32, 1), (pages, None)):
            handle = c.get(_keys("r", n), torch.arange(n))
            slot = handle._source.slot
            at = R.slot_offset(slot)
            wait_until(lambda at=at: R.U32.unpack_from(lane._mm, at)[0] == R.DONE, 10, "the Get")
            rings = pending(lane._done[slot])
            if most is not None:
                assert rings == most, f"a Get of {n} pages rang {rings} times"
            else:
                assert rings >= 2, "a large Get did not ring for its first step"
            for i in range(lane.slots):
                R.U32.pack_into(lane._mm, R.slot_offset(i) + R.WAITING_AT, 0)
            assert handle.wait(timeout=10) > 0 and handle.pages() == n
        assert d.core.plane.answered == answered + 4 and d.core.plane.now == now + 2
    assert _readers(d) == (0, 0)


def test_a_small_lane_get_is_copied_and_answered_on_the_loop_where_its_gate_is_idle(
        plane_daemon, monkeypatch) -> None:
    """A Get of at most 256 KiB (INLINE_COPY_BYTES) whose registration has no copy on the plane is
    copied and answered where the loop plans it (``DataPlane.copy``'s now): the same bytes as the
    gRPC Get; a larger one goes to the plane's thread. Past its timeout by the time the loop plans
    it, it is answered DEADLINE_EXCEEDED with nothing written, nothing counted as loaded and its
    pages let go; a Get right after it goes the same way again."""
    from kvserver.core.cache_ops import CacheOps
    from kvserver.core.copier import Copier

    d = plane_daemon
    plane = d.core.plane
    jobs = []  # the copies that took a job (run_alone): a small Get makes none
    run_alone = Copier.run_alone

    def counted(self, job, *args, **kw):
        jobs.append(job)
        return run_alone(self, job, *args, **kw)

    monkeypatch.setattr(Copier, "run_alone", counted)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            KVClient(d.address, timeout=10, resilient=False, lane="grpc") as g, \
            KVClient(d.address, timeout=0.1, resilient=False) as hasty:
        for other in (g, hasty):
            other.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                           num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 41)
        src, dst = torch.randperm(PAGES), torch.arange(PAGES, 2 * PAGES)
        want = _pages_of(pool, src)
        assert c.put(_keys("n")[:20], src[:20]).stored == 20
        now, answered = plane.now, plane.answered
        jobs.clear()  # (the Put's)
        _zero(pool)
        handle = c.get(_keys("n")[:4], dst[:4])  # 4 pages of 16 KiB
        assert handle.wait(timeout=10) > 0 and handle.pages() == 4
        assert (plane.now, plane.answered) == (now + 1, answered + 1), "not copied on the loop"
        assert not jobs, "the small Get took a job"
        got = _pages_of(pool, dst[:4])
        assert all(torch.equal(x, y) for x, y in zip(got, _pages_of_want(want, 4), strict=True))
        _zero(pool)
        assert g.get(_keys("n")[:4], dst[:4]).wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, dst[:4]), got, strict=True))
        handle = c.get(_keys("n")[:20], dst[:20])  # 320 KiB: the plane's thread copies it
        assert handle.wait(timeout=10) > 0 and handle.pages() == 20
        assert (plane.now, plane.answered) == (now + 1, answered + 2)
        assert len(jobs) == 1  # the plane's thread copies it: a job
        # Past its timeout when the loop gets to it: answered, not copied.
        loaded = d.run(lambda: d.core.clients[hasty.client_id].counters.bytes_loaded)
        original = CacheOps.get_on_plane

        def slow(self, req, answer, ended):
            time.sleep(0.15)
            return original(self, req, answer, ended)

        monkeypatch.setattr(CacheOps, "get_on_plane", slow)
        _zero(pool)
        late = hasty.get(_keys("n")[:2], dst[:2])
        with pytest.raises(KVClientError) as exc:
            late.wait(timeout=5)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value
        _until(lambda: plane.now == now + 2)
        _until(lambda: _readers(d) == (0, 0))
        assert not any(x.any() for x in _pages_of(pool, dst[:2])), "a Get past its timeout wrote"
        assert d.run(lambda: d.core.clients[hasty.client_id].counters.bytes_loaded) == loaded
        monkeypatch.setattr(CacheOps, "get_on_plane", original)
        handle = c.get(_keys("n")[:2], dst[:2])
        assert handle.wait(timeout=10) > 0 and plane.now == now + 3
    assert _readers(d) == (0, 0)


def test_a_request_the_loop_fails_to_take_is_answered_internal_and_its_slot_serves_again(
        plane_daemon, monkeypatch, caplog) -> None:
    """A handed-over request whose taking fails (a bug) is answered INTERNAL (``Lane.refuse``),
    and its slot is given back to the plane with the answer: the same slot serves again at once."""
    from kvserver.lane.server import Lane

    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        assert c.put(_keys("t")[:2], torch.arange(2)).stored == 2
        take = Lane.take

        def broken(self, i, counted=True):
            raise RuntimeError("taking it failed")

        monkeypatch.setattr(Lane, "take", broken)
        caplog.set_level(logging.ERROR, logger="kvserver")
        with pytest.raises(KVClientError) as exc:
            c.lookup(_keys("t")[:2])
        assert exc.value.code == grpc.StatusCode.INTERNAL, exc.value
        assert "failed to take" in str(exc.value)
        monkeypatch.setattr(Lane, "take", take)
        t = time.monotonic()
        for _ in range(3):  # the freed slot is the one taken next
            assert c.lookup(_keys("t")[:2]).pages == 2
        assert time.monotonic() - t < 2, "the refused slot was not given back to the plane"
    assert _readers(d) == (0, 0)


@pytest.mark.parametrize("rpc,copy", [("put", "run_alone"), ("get", "run_alone"), ("get", "copy_now")])
def test_a_call_handed_over_after_the_check_does_not_refuse_the_one_planned_before_it(
        plane_daemon, monkeypatch, rpc, copy) -> None:
    """The plane hands the registration's next call over while the loop plans this one (an
    engine putting on one thread and loading on another): this one, found alone when its plan
    began, is still copied alone (by a job, or a small Get at once), never answered UNAVAILABLE
    (which made the client give up a live registration and register again). A later call, handed
    over, counts in the gate's ``py_inflight`` here as the plane's thread counts it."""
    d = plane_daemon
    copier = d.core.copier
    real = getattr(copier, copy)
    handed: list[int] = []

    def later_call_meanwhile(*args):
        gate = (args[0].client if copy == "run_alone" else args[0]).gate
        gate.py_enter()  # the plane's thread hands the next call over now
        handed.append(1)
        try:
            return real(*args)
        finally:
            gate.py_exit()

    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 37)
        src = torch.randperm(PAGES)
        want = _pages_of(pool, src)
        assert c.put(_keys("w")[:4], src[:4]).stored == 4  # the plane serves the registration
        if rpc == "get":
            assert c.put(_keys("h"), src).stored == PAGES
        monkeypatch.setattr(copier, copy, later_call_meanwhile)
        jobs: list[int] = []
        if copy == "run_alone":
            monkeypatch.setattr("kvserver.core.cache_ops.INLINE_COPY_BYTES", 0)  # a Get's copy takes a job
        else:  # copied at once, not handed to a job after copy_now refused it
            run_alone = copier.run_alone
            monkeypatch.setattr(copier, "run_alone", lambda *args: (jobs.append(1), run_alone(*args))[1])
        alone = copier.alone_copies
        reconnects = c.reconnects
        if rpc == "put":
            got = c.put(_keys("h"), src)
            assert (got.stored, got.present, got.dropped) == (PAGES, 0, 0)
            assert c.lookup(_keys("h")).pages == PAGES
        else:
            n = PAGES if copy == "run_alone" else 1  # one page: copied at once
            dst = torch.arange(PAGES, PAGES + n)
            _zero(pool)
            handle = c.get(_keys("h")[:n], dst)
            assert handle.pages(timeout=10) == n and handle.wait(timeout=10) > 0
            got = _pages_of(pool, dst)
            assert all(torch.equal(x, y) for x, y in zip(got, _pages_of_want(want, n), strict=True))
        assert handed and not jobs, f"the call was not copied by {copy}"
        assert copier.alone_copies == alone + 1, "the call did not take the plane's path alone"
        assert c.reconnects == reconnects
    assert _readers(d) == (0, 0)
