"""The cache's copies on the compiled data plane: a Put's and a Get's copy, planned and ordered on
the event loop, run on the plane's thread (``DataPlane.copy``) for a registration the plane serves.
Bit exact both ways; a stop (the deadline) and a release end them at a layer boundary and free
what they held; later copies of the client that must follow one wait for its end; what
``submit_copy`` is given is checked whole before anything is submitted. Real daemon, real client,
real shared memory."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch
from test_dataplane import (
    BIG_TOKENS,
    DTYPE,
    LAYERS,
    LAYOUT,
    PAGE,
    START,
    TOKENS,
    _client,
    _fill,
    held_in_order,
    joined,
    timed,
    two_engines,
)

from kvclient import KVClient, KVClientError, ShmKVPool
from kvserver.copies import transfer
from kvserver.store.pages import WRITING

PAGES = TOKENS // PAGE  # 32 pages of 16 KiB: 512 KiB, never copied inline on the loop


def _keys(tag: str, n: int = PAGES) -> list[bytes]:
    return [f"{tag}-{i:08d}".encode().ljust(16, b".") for i in range(n)]


def _pages_of(pool: ShmKVPool, pages: torch.Tensor) -> list[torch.Tensor]:
    tokens = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    return [buf.view(torch.int16)[tokens].clone() for layer in pool.buffers for buf in layer]


def _zero(pool: ShmKVPool) -> None:
    for layer in pool.buffers:
        for buf in layer:
            buf.zero_()


def _put_then_get(c: KVClient, pool: ShmKVPool, tag: str, src: torch.Tensor, dst: torch.Tensor) -> list:
    """Stores device pages ``src`` under ``tag``'s keys, wipes the pool, and loads them into ``dst``:
    bit exact. Returns what ``src`` held (``_pages_of``)."""
    want = _pages_of(pool, src)
    assert c.put(_keys(tag), src).stored == PAGES
    _zero(pool)
    handle = c.get(_keys(tag), dst)
    assert handle.pages(timeout=10) == PAGES and handle.wait(timeout=10) > 0
    assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, dst), want, strict=True))
    return want


def test_a_put_and_a_get_are_copied_on_the_plane_bit_exact(plane_daemon) -> None:
    d = plane_daemon
    plane = d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 21)
        src, dst = torch.randperm(PAGES), torch.arange(PAGES, 2 * PAGES)
        copies = plane.copies + plane.plane_gets  # (a Get after the first is the plane's own)
        want = _put_then_get(c, pool, "a", src, dst)
        # Some layers (384 KiB: still not copied inline): those asked for land, the others are left alone.
        _zero(pool)
        handle = c.get(_keys("a"), dst, layers=[START, START + 1, START + 3])
        assert handle.wait(timeout=10) > 0 and handle.landed(START + 3)
        got = _pages_of(pool, dst)
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            layer = i // 2
            assert torch.equal(x, y) if layer in (0, 1, 3) else not x.any()
        assert plane.copies + plane.plane_gets - copies == 3, "the cache's copies did not run on the plane"
        gate = d.run(lambda: d.core.client(c.client_id).gate)
        # Both end with the copies (the plane's thread frees a job just after it answers its slot:
        # a moment later, under a sanitizer).
        deadline = time.monotonic() + 5
        while (plane.engine.jobs, gate.x_inflight) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert (plane.engine.jobs, gate.x_inflight) == (0, 0)


def test_a_pool_with_room_between_its_tokens_is_copied_on_the_plane_from_its_pages(plane_daemon,
                                                                                  monkeypatch) -> None:
    """A pool with padding between its tokens has no page rows: the cache's copies of it are planned
    from its pages alone, never as tokens (the largest Put names 8 Mi of them, a pass over which
    held the loop for hundreds of ms), and the plane copies each page's tokens apart, bit exact,
    never writing the padding."""
    d = plane_daemon
    plane = d.core.plane
    device_rows = transfer.CopyPlan.device_rows

    def watched(plan: transfer.CopyPlan) -> np.ndarray:
        assert not plan.of_pages, "a cache copy's tokens were made"
        return device_rows.fget(plan)

    monkeypatch.setattr(transfer.CopyPlan, "device_rows", property(watched))
    pad = 3 * DTYPE.itemsize
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS, token_padding=pad) as pool, _client(d, pool) as c:
        assert d.run(lambda: d.core.client(c.client_id).gate) is not None, "the plane does not serve it"
        _fill(pool, 41)
        src = torch.cat([torch.arange(8, 16), torch.arange(8), torch.arange(16, PAGES).flip(0)])
        copies, gets = plane.copies, plane.plane_gets
        _put_then_get(c, pool, "pad", src, torch.arange(PAGES, 2 * PAGES))
        assert plane.copies - copies == 1, "the Put's copy was not the loop's on the plane"
        assert plane.copies + plane.plane_gets - copies - gets == 2, "the Get did not run on the plane"
        rows = np.frombuffer(pool._shm.mm, np.uint8).reshape(-1, pool.token_stride).copy()
        assert not rows[:, pool.token_stride - pad:].any(), "the padding between tokens was written"


def test_a_stopped_put_frees_its_pages_and_a_released_client_s_copy_ends(plane_daemon) -> None:
    """Held on the plane, a Put past its deadline ends at a layer boundary (DEADLINE_EXCEEDED) and
    stores nothing; a Get whose client is unregistered meanwhile ends too, and nothing is left."""
    d = plane_daemon
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            KVClient(d.address, timeout=0.5, resilient=False) as hasty:
        hasty.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 22)
        engine.pause(True)
        try:
            with pytest.raises(KVClientError) as exc:
                hasty.put(_keys("late"), torch.arange(PAGES))
        finally:
            engine.pause(False)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value
        deadline = time.monotonic() + 10
        while engine.jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.lookup(_keys("late")).pages == 0  # nothing half written is found
        hasty.unregister()
        assert c.put(_keys("ok"), torch.arange(PAGES)).stored == PAGES
        engine.pause(True)
        try:
            handle = c.get(_keys("ok"), torch.arange(PAGES, 2 * PAGES))
            assert handle.pages(timeout=10) == PAGES
            while engine.jobs < 1:
                time.sleep(0.001)
            cid = c.client_id
            gone = threading.Thread(target=lambda: d.call(d.core.unregister(cid)))
            gone.start()
            time.sleep(0.2)
        finally:
            engine.pause(False)
        gone.join(30)
        with pytest.raises(KVClientError):
            handle.wait(timeout=10)
    assert d.run(lambda: (len(d.core.clients), engine.jobs)) == (0, 0)
    pages = d.run(lambda: d.core.cache.pages)  # no page read, written or held any more
    assert not pages.readers.any() and not pages.slab_holds.any() and not (pages.state == WRITING).any()


def test_a_load_behind_a_put_on_the_plane_waits_for_it(plane_daemon) -> None:
    """A Put held on the plane reads device pages P; a Load into P, handed to the loop meanwhile
    (the Put's call holds the plane's turn), waits in the copy queue until the Put's copy ends:
    the Put stores P as it was, and P then holds what the Load brought."""
    d = plane_daemon
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 23)
        p = torch.arange(PAGES)
        tokens = torch.arange(TOKENS)
        before = _pages_of(pool, p)
        host = c.alloc(TOKENS)
        other = torch.arange(TOKENS, 2 * TOKENS)
        assert c.write(host_indices=host, device_indices=other) > 0  # the Load brings these bytes
        loaded = _pages_of(pool, torch.arange(PAGES, 2 * PAGES))
        engine.pause(True)
        result: dict = {}
        try:
            putter = threading.Thread(target=lambda: result.setdefault("put", c.put(_keys("p"), p)))
            putter.start()
            while engine.jobs < 1:
                time.sleep(0.001)
            handle = c.load(host_indices=host, device_indices=tokens)
            time.sleep(0.3)
            assert not handle.landed(START), "the Load overtook the Put reading its pages"
        finally:
            engine.pause(False)
        putter.join(30)
        assert result["put"].stored == PAGES and handle.wait(timeout=30) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, p), loaded, strict=True))
        _zero(pool)
        assert c.get(_keys("p"), p).wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, p), before, strict=True))


def test_submit_copy_checks_everything_before_it_submits(plane_daemon) -> None:
    d = plane_daemon
    plane = d.core.plane
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, _client(d, pool) as c:
        gate = d.run(lambda: d.core.client(c.client_id).gate)
        address, size = d.core.copier.arena_span
        chunk = PAGE * LAYOUT.token_bytes(DTYPE)
        stop = np.zeros(1, np.int64)
        ok = dict(ticket=1 << 40, gate=gate, load=False, host_base=address, lp_stride=chunk, host_limit=size,
                  offsets=np.zeros(1, np.int64), tokens=np.arange(PAGE, dtype=np.int64),
                  layers=np.arange(LAYERS, dtype=np.int64), stop=np.ones(1, np.int64))
        last = size - LAYERS * 2 * chunk
        for change, why in [({"offsets": np.array([-1])}, "outside the host span"),
                            ({"offsets": np.array([last + 1])}, "outside the host span"),
                            ({"tokens": np.arange(PAGE, dtype=np.int64) + TOKENS - 1}, "outside the pool"),
                            ({"tokens": np.arange(PAGE - 1, dtype=np.int64)}, "page_size tokens"),
                            ({"layers": np.array([LAYERS])}, "outside the registration"),
                            ({"layers": np.array([-1])}, "outside the registration"),
                            ({"lp_stride": chunk - 1}, "hold a page"),
                            ({"stop": np.zeros(0, np.int64)}, "int64 array"),
                            ({"offsets": np.zeros(1, np.int32)}, "int64 array")]:
            with pytest.raises(ValueError, match=why):
                plane.engine.submit_copy(**{**ok, **change})
        assert d.run(lambda: (gate.x_inflight, plane.engine.jobs)) == (0, 0)
        # The last offset that fits is taken; its stop word already set, it copies nothing.
        assert plane.engine.submit_copy(**{**ok, "offsets": np.array([last]), "stop": stop + 1})
        deadline = time.monotonic() + 10
        while gate.x_inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (gate.x_inflight, plane.engine.jobs) == (0, 0)


def test_a_copy_that_ends_while_the_loop_takes_what_the_plane_posted_is_never_left_unseen() -> None:
    """The loop's reader takes the plane's handoffs and copy ends in one pass. A copy that ends
    during that pass is either taken by it or rings the eventfd again, whichever moment it ends
    at: here one ends right as the pass takes the ends (the worst moment: it used to be taken by
    nobody, its Put or Get waiting forever)."""
    import select
    import types
    from concurrent.futures import Future

    from kvserver.lane.plane import DataPlane, _kvlane

    if _kvlane is None:
        pytest.skip("the compiled data plane is not built")
    ps, tb, parts, nl, tokens = 4, 64, 2, 2, 256
    dev = [np.zeros(tokens * tb, np.uint8) for _ in range(nl * parts)]
    arena = np.zeros(1 << 20, np.uint8)
    plane = DataPlane(0.0)
    gate = _kvlane.Gate(owned=np.ones(8, np.uint8), host_base=arena.ctypes.data,
                        page_bytes=nl * parts * ps * tb, page_size=ps, token_bytes=tb, parts=parts,
                        start_layer=0, num_layers=nl, epoch=1, dev_tokens=tokens,
                        dev_bases=[d.ctypes.data for d in dev], dev_stride=tb, max_indices=1024)
    futures: dict[int, Future] = {}

    def submit(ticket: int) -> None:
        job = types.SimpleNamespace(work=types.SimpleNamespace(ended=False), stop_reason="",
                                    stop_word=np.zeros(1, np.int64), local_layers=list(range(nl)))
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        futures[ticket] = fut
        plane._copies[ticket] = (fut, job, gate, None, lambda: None)
        assert plane.engine.submit_copy(ticket, gate, False, arena.ctypes.data, ps * tb, arena.size,
                                        np.zeros(1, np.int64), np.arange(ps, dtype=np.int64),
                                        np.arange(nl, dtype=np.int64), job.stop_word)

    class EndsMidPass:
        """The engine, but a second copy ends while the pass takes what the first one posted."""

        def __init__(self, engine) -> None:
            self.engine, self.once = engine, True

        def __getattr__(self, name: str):
            return getattr(self.engine, name)

        def take_completions(self):
            got = self.engine.take_completions()
            if self.once:
                self.once = False
                submit(2)
                deadline = time.monotonic() + 10
                while gate.x_inflight and time.monotonic() < deadline:  # posted, its eventfd rung
                    time.sleep(0.001)
            return got

    try:
        submit(1)
        assert select.select([plane.engine.notify_fd], [], [], 10)[0], "the first copy never ended"
        plane.engine = EndsMidPass(plane.engine)
        plane._handoffs()  # the reader's pass
        assert futures[1].done()
        if not futures[2].done():  # not taken by that pass: then the eventfd says so
            assert select.select([plane.engine.notify_fd], [], [], 1)[0], "a copy's end was left unseen"
            plane._handoffs()
        assert futures[2].done() and futures[2].exception() is None
    finally:
        plane.engine = getattr(plane.engine, "engine", plane.engine)
        plane.stop()


def test_the_plane_s_stop_settles_the_copies_it_still_held() -> None:
    import types
    from concurrent.futures import Future

    from kvserver.errors import JobStopped
    from kvserver.lane.plane import DataPlane, _kvlane

    if _kvlane is None:
        pytest.skip("the compiled data plane is not built")
    dev = np.zeros(64 * 64, np.uint8)
    arena = np.zeros(1 << 16, np.uint8)
    plane = DataPlane(0.0)
    gate = _kvlane.Gate(owned=np.ones(4, np.uint8), host_base=arena.ctypes.data, page_bytes=4 * 64,
                        page_size=4, token_bytes=64, parts=1, start_layer=0, num_layers=1, epoch=1,
                        dev_tokens=64, dev_bases=[dev.ctypes.data], dev_stride=64, max_indices=64)
    plane.engine.pause(True)  # held: still on the thread when it stops
    job = types.SimpleNamespace(work=types.SimpleNamespace(ended=False), stop_reason="",
                                stop_word=np.zeros(1, np.int64), local_layers=[0])
    fut: Future = Future()
    fut.set_running_or_notify_cancel()
    plane._copies[7] = (fut, job, gate, None, lambda: None)
    assert plane.engine.submit_copy(7, gate, True, arena.ctypes.data, 4 * 64, arena.size,
                                    np.zeros(1, np.int64), np.arange(4, dtype=np.int64),
                                    np.zeros(1, np.int64), job.stop_word)
    plane.stop()
    assert fut.done() and isinstance(fut.exception(), JobStopped) and job.work.ended
    assert gate.x_inflight == 0


def test_another_engine_s_small_write_takes_its_turn_beside_a_large_put(plane_daemon) -> None:
    """The plane's writes take turns a piece each: held while one engine's 64 MiB Put (a cache
    copy on the plane) and then another engine's 1-page Write queue up, the Write ends long before
    the Put does, as it would beside another engine's large offload."""
    d = plane_daemon
    pages = torch.arange(BIG_TOKENS // 16)
    with two_engines(d, big_host=False) as (big, small):
        host_small = small.alloc(16)
        plane = d.core.plane
        copies, ended, put = plane.copies + plane.plane_gets, {}, {}  # (a Get may be the plane's own)
        start = held_in_order(
            d.core.plane.engine,
            timed(ended, "put", lambda: put.setdefault("r", big.put(_keys("big", len(pages)), pages))),
            timed(ended, "write", lambda: small.write(host_indices=host_small,
                                                      device_indices=torch.arange(16))))
        ended = joined(ended)
        assert put["r"].stored == len(pages)
        assert plane.copies + plane.plane_gets - copies == 1, "the Put's copy did not run on the plane"
        # Behind the whole Put, the Write would end about when the Put's copy does.
        assert ended["write"] - start < (ended["put"] - start) / 2, ("the Write waited", ended, start)
        # A Get of 64 MiB goes to the copy workers (split over both cores), one of 32 MiB to the plane.
        assert big.get(_keys("big", len(pages)), pages).wait(timeout=30) > 0
        assert plane.copies + plane.plane_gets - copies == 1
        assert big.get(_keys("big", len(pages) // 2), pages[: len(pages) // 2]).wait(timeout=30) > 0
        assert plane.copies + plane.plane_gets - copies == 2
