"""A Register that needs room the cache holds: it evicts only the slabs of one window of the arena
that then holds its region, and nothing at all when no such window exists (docs/cache.md); in steps
that let the event loop serve other engines, the room it makes held for it meanwhile and the
evicted memory given back to the kernel off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading

import grpc
import numpy as np
import pytest
import torch
from cache_engine import CacheEngine, prompt_keys, scattered
from checks import error_of
from conftest import DaemonThread
from store_support import make_cache, one_part, put

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient.errors import KVClientError
from kvclient.keys import page_keys
from kvserver.config import ServerConfig
from kvserver.core.share import LoopShare
from kvserver.host.arena import HostArena
from kvserver.host.room import Room
from kvserver.store import Keys
from kvserver.store import cache as cache_module
from kvserver.store.pages import BYTES_PER_PAGE, COMMITTED, WRITING

MIB = 1 << 20


def _cached_pages(d: DaemonThread, keys: Keys) -> int:
    def count() -> int:
        cache = d.core.cache
        part = next(iter(cache._parts.values()))
        return int((cache.pages.find(part.gid, keys) >= 0).sum())

    return d.run(count)


def _key_in_slab_at(d: DaemonThread, keys: list[bytes], offset: int) -> int:
    """The position of a key whose page lies in the slab at ``offset``."""
    def find() -> int:
        cache = d.core.cache
        part = next(iter(cache._parts.values()))
        ids = cache.pages.find(part.gid, Keys.of(keys))
        slab_at = {s.sid: s.offset for s in cache.slabs.slabs.values()}
        return next(i for i, p in enumerate(ids.tolist()) if p >= 0
                    and slab_at.get(int(cache.pages.slab[p])) == offset)

    return d.run(find)


def _filled(d: DaemonThread, eng: CacheEngine) -> tuple[Keys, np.ndarray]:
    """Four Puts of 250 pages of 32 KiB (four 8 MIB slabs, taken from the top of the arena down),
    the first Put's slab the least recently used."""
    rng = np.random.default_rng(0)
    keys = prompt_keys(rng.integers(0, 1 << 30, 1000 * 16))
    for c in range(0, 1000, 250):
        pages = scattered(rng, 250, eng.num_pages)
        eng.fill(keys[c:c + 250], pages)
        assert eng.put(keys[c:c + 250], pages).stored == 250
    slabs = d.run(lambda: sorted((s.offset, s.nbytes) for s in d.core.cache.slabs.slabs.values()))
    assert [n for _, n in slabs] == [8 * MIB] * 4, slabs
    return Keys.of(keys), keys


def test_a_register_that_cannot_fit_evicts_nothing(socket_dir) -> None:
    """A page pinned in the slab at 16 MIB: no window of free space and unpinned slabs holds 20 MIB
    (14 below it, 16 above), so the Register is refused, and every cached page is still there."""
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=40 * MIB))
    try:
        with CacheEngine(d.address, pages=1024) as eng:
            stored, keys = _filled(d, eng)
            k = _key_in_slab_at(d, keys, 16 * MIB)
            lease = eng.lookup([keys[k]], pin_ms=30_000)
            assert lease.pages == 1
            code, message = error_of(lambda: CacheEngine(d.address, pages=16, host_tokens=640 * 16))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
            assert _cached_pages(d, stored) == 1000
    finally:
        d.stop()


def test_a_register_evicts_one_window_not_the_least_recent_slabs(socket_dir) -> None:
    """10 MIB: the slab next to the arena's free 6 MIB makes room alone; evicting least recently
    used slabs first would take the top two (neither next to free space) before one range held it."""
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=40 * MIB))
    try:
        with CacheEngine(d.address, pages=1024) as eng:
            stored, _ = _filled(d, eng)
            with CacheEngine(d.address, pages=16, host_tokens=320 * 16):
                assert _cached_pages(d, stored) == 750
    finally:
        d.stop()


PIECE = 32  # pages a step of make_room_steps evicts in these tests (EVICT_STEP_PAGES, made small)
SMALL = 16 << 10  # page bytes: 128 pages to a slab, their bookkeeping within the free allowance


def _keys(first: int, n: int):
    """``n`` distinct 16-byte keys from ``first`` on."""
    return Keys.unpack(np.arange(first, first + n, dtype=np.uint64).repeat(2).tobytes(), 16, n)


def _full_of_small_pages(monkeypatch) -> tuple:
    """A 16 MIB cache full of 16 KiB pages: eight 2 MIB slabs of 128 pages, each page's memory
    written with 0xAB (what an engine's bytes would be); steps of PIECE pages."""
    monkeypatch.setattr(cache_module, "EVICT_STEP_PAGES", PIECE)
    kv, arena, _ = make_cache(capacity=16 * MIB)
    part = one_part(kv, page_bytes=SMALL)
    n = 2 * MIB // SMALL
    keys = []
    for i in range(8):
        ks = _keys(i * n, n)
        assert len(put(kv, part, ks).positions) == n
        keys.append(ks)
    assert arena.largest_free() == 0 and kv.bytes == 16 * MIB
    arena.view(np.uint8).fill(0xAB)
    return kv, arena, part, keys


def _slabs_add_up(cache, page_bytes: int = SMALL) -> None:
    """Every slab's pages are committed, being written or in its free list; the lists add up."""
    for slab in cache.slabs.slabs.values():
        state = cache.pages.state[slab.pages]
        used = int(((state == COMMITTED) | (state == WRITING)).sum())
        assert used + slab.free == len(slab.pages), (slab.sid, used, slab.free, len(slab.pages))
    assert cache.slabs.free_count((0, page_bytes)) == sum(s.free for s in cache.slabs.slabs.values())
    assert not cache.pages.slab_leaving.any()


def _slab_offsets(cache, part, keys) -> set[int]:
    ids = cache.pages.find(part.gid, keys)
    return {s.offset for s in cache.slabs.slabs.values() if np.isin(s.pages, ids).any()}


def test_make_room_in_steps_holds_what_it_makes_and_frees_its_memory_on_the_callers_thread(monkeypatch):
    """A Register's room is made a few thousand pages at a time (the loop serves others between
    two); what it has made stays reserved meanwhile, so that nothing else takes it, and the evicted
    slabs' memory is freed where the caller discards it (a worker thread), not in the steps."""
    cache, arena, part, keys = _full_of_small_pages(monkeypatch)
    oldest = set().union(*(_slab_offsets(cache, part, k) for k in keys[:3]))
    punched = []
    real = arena._punch
    monkeypatch.setattr(arena, "_punch", lambda at, n: punched.append((at, n)) or real(at, n))
    room = Room(arena)
    steps = cache.make_room_steps(6 * MIB, room)
    taken = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            assert done.value is True
            break
        taken += 1
        # between two steps: the room made so far is nobody's, and nothing was freed yet
        assert arena.largest_free() == 0 and punched == []
        # a Put meanwhile (the arena full) evicts and stores outside the window
        plan = put(cache, part, _keys((1 << 40) + 4 * taken, 4))
        assert len(plan.positions) == 4
        assert not any(start <= off < start + 2 * MIB for off in plan.offsets.tolist() for start in oldest)
    assert taken >= 3 * (2 * MIB // SMALL) // PIECE  # three slabs, a step for each piece of each
    assert cache.bytes == 10 * MIB and room.nbytes == 6 * MIB and arena.reserved == 16 * MIB
    assert punched == [] and arena.largest_free() == 0
    assert part.pages == 5 * 2 * MIB // SMALL
    room.discard()
    assert sorted(punched) == [(off, 2 * MIB) for off in sorted(oldest)]  # the least recent three
    room.give_back()
    assert len(punched) == 3  # given back as freed: not freed twice
    assert arena.largest_free() == 6 * MIB and arena.reserved == cache.bytes == 10 * MIB
    start = arena.reserve(6 * MIB)
    assert start == min(oldest) and not arena.view(np.uint8)[start: start + 6 * MIB].any()
    assert cache.stats()[0][0].counters.evictions == 3 * 2 * MIB // SMALL + 4 * taken
    _slabs_add_up(cache)


def test_make_room_in_steps_stops_where_a_slab_is_used_meanwhile(monkeypatch):
    """A page of the slab being evicted is read between two steps: eviction stops there, the pages
    it had cleared of that slab go back to its free list (a Put stores into them), and what the
    room holds is given back whole."""
    cache, arena, part, keys = _full_of_small_pages(monkeypatch)
    room = Room(arena)
    steps = cache.make_room_steps(6 * MIB, room)
    next(steps)  # PIECE of the least recent slab's pages are out
    left = cache.pages.find(part.gid, keys[0]) >= 0
    assert left.sum() == len(left) - PIECE
    got = cache.prepare_get(part, keys[0].take(np.flatnonzero(left)))
    assert got.pages == left.sum()
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value is False
    _slabs_add_up(cache)
    assert cache.slabs.free_count((0, SMALL)) == PIECE
    assert room.nbytes == 0  # no slab of the window evicted whole
    room.give_back()
    cache.complete_get(got, True)
    assert arena.largest_free() == 0 and arena.reserved == cache.bytes == 16 * MIB
    evictions = cache.stats()[0][0].counters.evictions
    assert len(put(cache, part, _keys(1 << 40, PIECE)).positions) == PIECE
    assert cache.stats()[0][0].counters.evictions == evictions  # stored in the cleared pages
    _slabs_add_up(cache)
    assert cache.make_room(6 * MIB)


def test_make_room_in_steps_given_up_midway_keeps_the_slabs_it_did_not_evict(monkeypatch):
    """The Register's caller went away between two steps: the slab half evicted and those not yet
    reached are the cache's again (their free pages in its lists, evictable), the ones evicted
    whole stay in the room, which gives them back freed."""
    cache, arena, part, keys = _full_of_small_pages(monkeypatch)
    room = Room(arena)
    steps = cache.make_room_steps(6 * MIB, room)
    per_slab = 2 * MIB // SMALL // PIECE
    for _ in range(per_slab + 2):  # the first slab evicted, two pieces of the second
        next(steps)
    steps.close()
    assert room.nbytes == 2 * MIB and not cache.pages.slab_leaving.any()
    _slabs_add_up(cache)
    assert cache.slabs.free_count((0, SMALL)) == 2 * PIECE
    room.give_back()
    assert arena.largest_free() == 2 * MIB and arena.reserved == cache.bytes == 14 * MIB
    assert cache.make_room(6 * MIB) and arena.largest_free() >= 6 * MIB


def test_make_room_in_steps_evicts_on_where_the_bookkeeping_still_keeps_the_range(monkeypatch):
    """Tiny pages: the cache's bookkeeping, charged to the budget, keeps a free range from being
    reserved. The steps go on evicting least recently used slabs into the room until, given back,
    it leaves the range reservable, as ``make_room`` does in one go."""
    monkeypatch.setattr(cache_module, "EVICT_STEP_PAGES", 1024)
    cache, arena, _ = make_cache(capacity=16 * MIB)
    part = one_part(cache, page_bytes=256)
    region = arena.reserve(4 * MIB)
    for i in range(8):
        put(cache, part, _keys(i * 8192, 8192))
    arena.release(region, 4 * MIB)
    assert max(arena.free_ranges()[1]) >= 8 * MIB > arena.largest_free()  # kept by the bookkeeping
    room, available, slabs = Room(arena), arena.available, len(cache.slabs.slabs)
    steps = cache.make_room_steps(8 * MIB, room)
    next(steps)
    # The free range the room holds claims of the budget what was left of it, not its size:
    # holding it as reserved left the arena 2 MiB overdrawn here, and a pinning Lookup evicted
    # whole slabs at once to pay that back, on the loop. Now one slab at most (the arena is full).
    assert 0 <= arena.available < available and room.claimed == available
    pinned, lease = cache.lookup(part, _keys(7 * 8192, 64), pin_ms=1000)
    assert pinned == 64
    assert len(cache.slabs.slabs) >= slabs - 1
    taken = 1
    while True:
        try:
            next(steps)
            taken += 1
        except StopIteration as done:
            assert done.value is True
            break
    assert taken >= 8192 // 1024  # a slab at least, in pieces
    room.discard()
    room.give_back()
    assert arena.largest_free() >= 8 * MIB
    assert cache.release("t", [lease]) == 1  # (leases released)
    assert arena.booked == cache.pages.in_slabs * BYTES_PER_PAGE and arena.reserved == cache.bytes
    _slabs_add_up(cache, 256)


LAYOUT, PAGE_TOKENS = KVLayout.mla(256, 0), 32  # 16 KiB pages: 512 to an 8 MiB slab


class _Watch:
    """Where the arena's memory is given back (on the loop or not) and the loop's steps, while on."""

    def __init__(self, d: DaemonThread, monkeypatch) -> None:
        self.on, self.punches, self.steps = threading.Event(), [], []
        real_punch, real_between = HostArena._punch, LoopShare.between_steps
        watch = self

        def punch(arena, start, size):
            if watch.on.is_set():
                watch.punches.append(threading.current_thread() is d._thread)
            return real_punch(arena, start, size)

        async def between_steps(share, spent):
            if watch.on.is_set():
                watch.steps.append(spent)
            return await real_between(share, spent)

        monkeypatch.setattr(HostArena, "_punch", punch)
        monkeypatch.setattr(LoopShare, "between_steps", between_steps)


def _fill(d: DaemonThread, client: KVClient, pool: ShmKVPool) -> int:
    """80 MiB of 16 KiB pages Put into a 64 MiB arena (full), their bytes 0xAB; what is cached."""
    client.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                    page_size=PAGE_TOKENS)
    pool.buffers[0][0].view(torch.uint8).fill_(0xAB)
    for i in range(80):
        tokens = range(i * 64 * PAGE_TOKENS, (i + 1) * 64 * PAGE_TOKENS)
        client.put(page_keys(tokens, PAGE_TOKENS), list(range(64)))
    cached = d.run(lambda: d.core.cache.bytes)
    assert cached >= 48 * MIB
    return cached


@pytest.fixture
def small_steps(socket_dir, monkeypatch):
    """A daemon with a 64 MiB budget whose Registers evict 256 pages a step."""
    monkeypatch.setattr(cache_module, "EVICT_STEP_PAGES", 256)
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=64 * MIB))
    try:
        yield d
    finally:
        d.stop()


def test_a_register_that_needs_the_caches_room_evicts_in_steps_and_frees_off_the_loop(small_steps,
                                                                                        monkeypatch):
    """Engine A's cached pages fill the arena; engine B's Register needs most of it. The cache gave
    way on the event loop in one go: every evicted slab's keys out of the index and its memory
    back to the kernel (MADV_DONTNEED) there, 0.3-0.4 s for 390 MiB of 128-byte pages on this VM,
    every other engine waiting. Now it is evicted in steps, the loop serving others between two,
    and the memory goes back in a worker thread before B's region takes it: B reads zeros."""
    d = small_steps
    watch = _Watch(d, monkeypatch)
    with ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=64 * PAGE_TOKENS) as pa, \
            ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=64) as pb_, \
            KVClient(d.address, timeout=60) as a, KVClient(d.address, timeout=60) as b:
        cached = _fill(d, a, pa)
        watch.on.set()
        reg = b.register(model="m", pool=pb_, start_layer=0, end_layer=1, num_layers=1,
                         host_tokens=40 * MIB // 512, page_size=1)
        watch.on.clear()
        assert reg.host_tokens == 40 * MIB // 512
        assert d.run(lambda: d.core.cache.bytes) <= cached - 40 * MIB
        assert watch.punches and not any(watch.punches), watch.punches  # all off the loop
        assert len(watch.steps) >= 40 * MIB // (256 * 16 << 10), len(watch.steps)  # the loop let go
        client = d.run(lambda: d.core.clients[reg.client_id])
        view = d.core.arena.view(np.uint8)
        assert not view[client.region_offset: client.region_offset + client.region_bytes].any()


def test_a_register_given_up_while_it_evicts_frees_what_it_evicted_off_the_loop(small_steps, monkeypatch):
    """The Register's caller goes away between two steps: the slabs evicted so far went back to the
    kernel on the loop, all at once (the room given back undiscarded); now in a worker thread, as
    when it goes through. The cache's and the arena's accounting agree after."""
    d = small_steps
    watch = _Watch(d, monkeypatch)
    with ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=64 * PAGE_TOKENS) as pa, \
            KVClient(d.address, timeout=60) as a:
        _fill(d, a, pa)

        async def given_up() -> None:
            task = asyncio.ensure_future(d.core.rooms.make(40 * MIB, 40 * MIB))
            while len(watch.steps) < 6:  # three slabs evicted
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        watch.on.set()
        d.call(given_up())
        watch.on.clear()
        assert watch.punches and not any(watch.punches), watch.punches
        cache, arena = d.core.cache, d.core.arena
        assert d.run(lambda: (arena.reserved, bool(cache.pages.slab_leaving.any()))) == (cache.bytes, False)
        assert d.run(lambda: sum(arena.free_ranges()[1])) == arena.capacity - cache.bytes


def test_the_spare_page_ids_never_grow_by_copying():
    """Each evicted slab's page ids go back to the page table's spare ids. That stack grew by
    doubling, copying every id it held on the event loop: 16 ms in one step of a Register's
    eviction at 4 Mi ids. It is now sized for every page id at once, committed as written."""
    from kvserver.store.stack import IdPool

    pool = IdPool(1 << 22)
    ids = pool.take(1 << 22)
    held = pool._spare._ids
    for chunk in np.array_split(ids, 64):
        pool.give(chunk)
    assert pool._spare._ids is held and pool.in_use == 0
    again = pool.take(1 << 22)
    assert np.array_equal(np.sort(again), np.arange(1 << 22)) and pool.take(1) is None


@pytest.mark.parametrize("mib", [52, 40])
def test_a_replacing_register_that_cannot_fit_is_refused_while_another_ones_room_is_held(small_steps,
                                                                                           monkeypatch, mib):
    """Engine A's Register holds the window's free 16 MiB while it evicts. Engine X registers again,
    naming its old registration, asking for more than A leaves. The budget the room holds counted
    as free: X passed the check made before its old registration is released, lost it, and was
    refused after. The room claims that budget now: X is refused first, its old registration kept.
    Asking 40 MiB, X fits beside what the cache holds, but not once A's room has evicted what it
    still has to: counting every cached byte, X let its registration go and was refused after."""
    from kvclient._messages import register_request
    from kvclient._transport.fd_socket import get_ticket
    from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

    d = small_steps
    slow, held = threading.Event(), threading.Event()
    real_between, real_hold = LoopShare.between_steps, Room.hold_free

    async def between_steps(share, spent):
        if slow.is_set():
            await asyncio.sleep(0.3)
        return await real_between(share, spent)

    def hold_free(room, start, n, most):
        held.set()
        return real_hold(room, start, n, most)

    monkeypatch.setattr(LoopShare, "between_steps", between_steps)
    monkeypatch.setattr(Room, "hold_free", hold_free)
    with ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=64 * PAGE_TOKENS) as pc, \
            ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=64) as px, \
            ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=64) as pa, \
            KVClient(d.address, timeout=60) as x, KVClient(d.address, timeout=60) as c, \
            KVClient(d.address, timeout=60) as a:
        old = x.register(model="m", pool=px, start_layer=0, end_layer=1, num_layers=1,
                         host_tokens=8 * MIB // 512, page_size=PAGE_TOKENS)
        c.register(model="m", pool=pc, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                   page_size=PAGE_TOKENS)
        for i in range(32):  # 40 MiB of slabs at the top, 16 MiB free between them and X's region
            tokens = range(i * 64 * PAGE_TOKENS, (i + 1) * 64 * PAGE_TOKENS)
            c.put(page_keys(tokens, PAGE_TOKENS), list(range(64)))
        assert d.run(lambda: d.core.arena.free_ranges()[1]) == [16 * MIB]
        slow.set()
        got = {}

        def register_a() -> None:
            got["a"] = a.register(model="m", pool=pa, start_layer=0, end_layer=1, num_layers=1,
                                  host_tokens=40 * MIB // 512, page_size=PAGE_TOKENS).host_tokens

        thread = threading.Thread(target=register_a)
        thread.start()
        try:
            assert held.wait(20)
            req = register_request(model="m", pool=px, start_layer=0, end_layer=1, num_layers=1,
                                   host_tokens=mib * MIB // 512, page_size=PAGE_TOKENS, tp_rank=0, tp_size=1,
                                   pp_rank=0, pp_size=1)
            req.replaces_client_id = old.client_id
            req.peer_ticket = get_ticket(d.config.socket + ".fd", px.fds)
            with grpc.insecure_channel(d.address) as ch:
                code, message = error_of(lambda: pb_grpc.KVServerStub(ch).Register(req, timeout=20))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the registration it names stays" in message
            assert old.client_id in d.run(lambda: list(d.core.clients))
        finally:
            thread.join(30)
            slow.clear()
        assert got["a"] == 40 * MIB // 512


def test_a_rooms_free_ranges_claim_only_what_the_windows_slabs_do_not_give(monkeypatch):
    """A 4 MiB region whose window is a free 2 MiB and an 8 MiB slab: the slab alone gives the
    region its budget. The free range claimed it as well, so with the pages' bookkeeping charged a
    pinning Lookup between two steps found no budget and evicted another 8 MiB slab of cached
    pages for 48 bytes of pins. It claims nothing now, and the Lookup evicts nothing."""
    monkeypatch.setattr(cache_module, "EVICT_STEP_PAGES", 256)
    cache, arena, clock = make_cache(capacity=26 * MIB, slab_bytes=8 * MIB)
    part = one_part(cache, page_bytes=4096)  # 2048 pages a slab: their bookkeeping charged
    n = 8 * MIB // 4096
    for i in range(3):
        clock.now += 1
        put(cache, part, _keys(i * n, n))
    clock.now += 1
    cache.lookup(part, _keys(0, n))
    cache.lookup(part, _keys(n, n))  # the lowest slab, next to the free 2 MiB, the least recent
    assert arena.free_ranges() == ([0], [2 * MIB]) and arena.charged > 0
    room = Room(arena)
    steps = cache.make_room_steps(4 * MIB, room)
    next(steps)
    assert room.claimed == 0 and room.nbytes == 2 * MIB
    cached = cache.bytes
    pinned, lease = cache.lookup(part, _keys(8, 4), pin_ms=1000)  # pages of the top slab
    assert pinned == 4 and cache.bytes == cached  # nothing evicted for the pins
    for _ in steps:
        pass
    room.discard()
    room.give_back()
    assert arena.largest_free() >= 4 * MIB and cache.bytes == 16 * MIB


class _SlowDiscard:
    """A Register's room held until the test lets its discard go on (the worker thread giving the
    evicted slabs' memory back: ~0.09 s a populated GiB)."""

    def __init__(self, monkeypatch) -> None:
        self.discarding, self.go = threading.Event(), threading.Event()
        real = Room.discard

        def discard(room: Room) -> None:
            self.discarding.set()
            self.go.wait(20)
            return real(room)

        monkeypatch.setattr(Room, "discard", discard)


def _pools(*tokens: int) -> list[ShmKVPool]:
    return [ShmKVPool(LAYOUT, torch.bfloat16, num_layers=1, num_tokens=n) for n in tokens]


def _a_of_another_uid(monkeypatch) -> None:
    """Engine A (model "a") maps its pool in the turn of another uid than the other engines' (the
    tests' engines all run as one uid; a CUDA pool takes no such turn): the others' Registers meet
    A's room itself, not A's turn of their uid."""
    from kvserver.core.kvcore import KVCore

    uid: contextvars.ContextVar[str | None] = contextvars.ContextVar("uid", default=None)
    real_register, real_lock = KVCore.register, KVCore._map_lock

    async def register(core, req, *args, **kw):
        uid.set("a" if req.model == "a" else None)
        return await real_register(core, req, *args, **kw)

    monkeypatch.setattr(KVCore, "register", register)
    monkeypatch.setattr(KVCore, "_map_lock", lambda core, of: real_lock(core, uid.get() or of))


def _room_for_a(d: DaemonThread, x: KVClient, c: KVClient, a: KVClient,
                pools: list[ShmKVPool], most_mib: int = 36) -> tuple[threading.Thread, dict]:
    """X holds 8 MiB, C's Puts 40 MiB of slabs at the top, 16 MiB free between them; engine A's
    Register of 36 MiB evicts three slabs into its room, held there (``_SlowDiscard``). Once A's
    region is reserved, 4 MiB are free and 16 MiB cached."""
    px, pc, pa = pools
    x.register(model="m", pool=px, start_layer=0, end_layer=1, num_layers=1,
               host_tokens=8 * MIB // 512, page_size=PAGE_TOKENS)
    c.register(model="m", pool=pc, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
               page_size=PAGE_TOKENS)
    for i in range(32):
        tokens = range(i * 64 * PAGE_TOKENS, (i + 1) * 64 * PAGE_TOKENS)
        c.put(page_keys(tokens, PAGE_TOKENS), list(range(64)))
    assert d.run(lambda: d.core.arena.free_ranges()[1]) == [16 * MIB]
    got: dict = {}

    def register_a() -> None:
        got["a"] = a.register(model="a", pool=pa, start_layer=0, end_layer=1, num_layers=1,
                              host_tokens=most_mib * MIB // 512, min_host_tokens=36 * MIB // 512,
                              page_size=PAGE_TOKENS).host_tokens

    thread = threading.Thread(target=register_a)
    thread.start()
    return thread, got


def _register_b(b: KVClient, pool: ShmKVPool, mib: int, got: dict) -> threading.Thread:
    def register_b() -> None:
        try:
            got["b"] = b.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                                  host_tokens=mib * MIB // 512, page_size=PAGE_TOKENS).host_tokens
        except KVClientError as e:
            got["b"] = str(e)

    thread = threading.Thread(target=register_b)
    thread.start()
    return thread


def test_a_register_that_fits_once_another_ones_room_is_given_back_waits_for_it(small_steps, monkeypatch):
    """Engine B registers 20 MiB while engine A's room is held. Once A's region is reserved, 4 MiB
    are free and 16 MiB cached beside them, so B fits; but meanwhile A's room splits the arena, and
    its evicted slabs' budget counts nowhere: B was refused ("no host memory left"), and the same
    Register went through just after. It waits for A's room now, then makes its own; holding
    nothing meanwhile: engine D, of B's uid, registers for the cache alone while B waits (a wait
    inside B's turn of its uid mapping a pool held D back until A's room was given back)."""
    d = small_steps
    slow = _SlowDiscard(monkeypatch)
    _a_of_another_uid(monkeypatch)
    pools = _pools(64, 64 * PAGE_TOKENS, 64, 64, 64)
    try:
        with KVClient(d.address, timeout=60) as x, KVClient(d.address, timeout=60) as c, \
                KVClient(d.address, timeout=60) as a, KVClient(d.address, timeout=60) as b, \
                KVClient(d.address, timeout=60) as cache_only:
            a_thread, got = _room_for_a(d, x, c, a, pools[:3])
            try:
                assert slow.discarding.wait(20)
                b_thread = _register_b(b, pools[3], 20, got)
                b_thread.join(1.0)
                assert b_thread.is_alive(), got  # waiting for A's room, not refused
                cache_only.register(model="m", pool=pools[4], start_layer=0, end_layer=1, num_layers=1,
                                    host_tokens=0, page_size=PAGE_TOKENS)
                assert a_thread.is_alive() and b_thread.is_alive()  # D did not wait for A's room
            finally:
                slow.go.set()
                a_thread.join(30)
            b_thread.join(30)
            assert got == {"a": 36 * MIB // 512, "b": 20 * MIB // 512}
    finally:
        for p in pools:
            p.close()


def test_a_register_that_cannot_fit_even_once_another_ones_room_is_given_back_is_refused_at_once(
        small_steps, monkeypatch):
    """B asks 24 MiB, more than A's room will leave (4 MiB free and 16 MiB cached): refused while
    A's room is still held, without waiting for it."""
    d = small_steps
    slow = _SlowDiscard(monkeypatch)
    pools = _pools(64, 64 * PAGE_TOKENS, 64, 64)
    try:
        with KVClient(d.address, timeout=60) as x, KVClient(d.address, timeout=60) as c, \
                KVClient(d.address, timeout=60) as a, KVClient(d.address, timeout=60) as b:
            a_thread, got = _room_for_a(d, x, c, a, pools[:3])
            try:
                assert slow.discarding.wait(20)
                b_thread = _register_b(b, pools[3], 24, got)
                b_thread.join(20)
                assert not b_thread.is_alive() and "not enough host memory" in got["b"], got
                assert a_thread.is_alive()  # A's room still held
            finally:
                slow.go.set()
                a_thread.join(30)
            assert got["a"] == 36 * MIB // 512
    finally:
        for p in pools:
            p.close()


def test_stats_and_metrics_count_the_room_a_register_holds(small_steps, monkeypatch):
    """While A's room is held, Stats' reserved_bytes counted its evicted slabs (still reserved) but
    not the free range it holds, so neither it nor capacity - reserved said what others may take.
    It counts the room's whole budget now, shown apart as room_bytes (the metrics too)."""
    from kvserver.api.metrics import Transfers, snapshot

    d = small_steps
    slow = _SlowDiscard(monkeypatch)
    pools = _pools(64, 64 * PAGE_TOKENS, 64)

    def regions() -> int:
        return d.run(lambda: sum(c.region_bytes for c in d.core.clients.values()))

    try:
        with KVClient(d.address, timeout=60) as x, KVClient(d.address, timeout=60) as c, \
                KVClient(d.address, timeout=60) as a:
            a_thread, got = _room_for_a(d, x, c, a, pools)
            try:
                assert slow.discarding.wait(20)
                s = c.stats(all_clients=True)
                assert s.room_bytes == 36 * MIB, s.room_bytes  # a free 12 MiB claimed, 24 evicted
                assert s.reserved_bytes == regions() + s.cache_bytes + s.room_bytes
                assert s.capacity_bytes - s.reserved_bytes == d.run(lambda: d.core.arena.available)
                snap = d.run(lambda: snapshot(d.core, Transfers()))
                assert (snap.reserved, snap.room_bytes) == (s.reserved_bytes, s.room_bytes)
            finally:
                slow.go.set()
                a_thread.join(30)
            assert got["a"] == 36 * MIB // 512
            s = c.stats(all_clients=True)
            assert s.room_bytes == 0 and s.reserved_bytes == regions() + s.cache_bytes
    finally:
        for p in pools:
            p.close()


def test_a_put_dropped_while_a_register_makes_room_says_so(monkeypatch, caplog):
    """A Put between two steps of a Register's room finds no budget: the room holds it and the
    window's slabs are set aside. Its warning blamed cached pages "pinned or being read"; none
    is. It names the room now."""
    import logging

    monkeypatch.setattr(cache_module, "EVICT_STEP_PAGES", 32)
    cache, arena, _ = make_cache(capacity=16 * MIB)
    part = one_part(cache, page_bytes=16 << 10)
    n = 2 * MIB // (16 << 10)
    for i in range(8):
        put(cache, part, _keys(i * n, n))
    room = Room(arena)
    steps = cache.make_room_steps(16 * MIB, room)
    for _ in range(3 * n // 32 + 1):  # three slabs evicted into the room, a piece of the fourth
        next(steps)
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        plan = put(cache, part, _keys(1 << 40, 8))
        cache.log_drops()
    assert plan.dropped == 8
    logged = [r.getMessage() for r in caplog.records if "unstored" in r.getMessage()]
    assert logged and "held for registrations making room" in logged[-1], logged
    assert "being evicted for them" in logged[-1] and "pinned" not in logged[-1], logged
    steps.close()
    room.discard()
    room.give_back()


def test_a_replacing_register_never_counts_on_what_another_ones_room_may_leave(small_steps, monkeypatch):
    """Engine R makes room for at least 20 MiB of a region of up to 24 (three 8 MiB slabs evicted);
    meanwhile W registers again for 8 MiB, naming its 4 MiB registration X. Counting what R's room
    leaves beyond R's least, W passed the check that keeps X, released X, then found R had taken
    its most: W refused, X gone. A replacing Register counts no room's leftover: W is refused at
    once, and X stays."""
    d = small_steps
    slow = _SlowDiscard(monkeypatch)
    pools = _pools(64, 64, 64, 64 * PAGE_TOKENS, 64)

    def register(client: KVClient, pool: ShmKVPool, mib: int, least: int | None = None):
        return client.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                               host_tokens=mib * MIB // 512, page_size=PAGE_TOKENS,
                               min_host_tokens=None if least is None else least * MIB // 512)

    try:
        with KVClient(d.address, timeout=60) as p, KVClient(d.address, timeout=60) as w, \
                KVClient(d.address, timeout=60) as z, KVClient(d.address, timeout=60) as c, \
                KVClient(d.address, timeout=60) as r:
            register(p, pools[0], 24)
            x = register(w, pools[1], 4)
            register(z, pools[2], 36)
            p.unregister()  # [0, 24) free, X at 24, Z's region above it
            c.register(model="m", pool=pools[3], start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                       page_size=PAGE_TOKENS)
            for i in range(24):  # three slabs fill [0, 24)
                tokens = range(i * 64 * PAGE_TOKENS, (i + 1) * 64 * PAGE_TOKENS)
                c.put(page_keys(tokens, PAGE_TOKENS), list(range(64)))
            got: dict = {}

            def register_r() -> None:
                got["r"] = register(r, pools[0], 24, least=20).host_tokens

            r_thread = threading.Thread(target=register_r)
            r_thread.start()
            try:
                assert slow.discarding.wait(20)
                with pytest.raises(KVClientError, match="the registration it names stays"):
                    register(w, pools[4], 8)
                assert x.client_id in d.run(lambda: list(d.core.clients))
            finally:
                slow.go.set()
                r_thread.join(30)
            assert got["r"] == 24 * MIB // 512
            assert x.client_id in d.run(lambda: list(d.core.clients))
    finally:
        for pool in pools:
            pool.close()


def _during_a_room(d: DaemonThread, monkeypatch, most_mib: int, then) -> dict:
    """``then(b, pool, x)`` (engine B's Register, or X's: X holds 8 MiB) while engine A's room is
    held (A of another uid, accepting 36 MiB of up to ``most_mib``); what A and B got."""
    slow = _SlowDiscard(monkeypatch)
    _a_of_another_uid(monkeypatch)
    pools = _pools(64, 64 * PAGE_TOKENS, 64, 64)
    try:
        with KVClient(d.address, timeout=60) as x, KVClient(d.address, timeout=60) as c, \
                KVClient(d.address, timeout=60) as a, KVClient(d.address, timeout=60) as b:
            a_thread, got = _room_for_a(d, x, c, a, pools[:3], most_mib)
            try:
                assert slow.discarding.wait(20)
                b_thread = threading.Thread(target=lambda: got.update(b=then(b, pools[3], x)))
                b_thread.start()
                b_thread.join(0.5)
            finally:
                slow.go.set()
                a_thread.join(30)
            b_thread.join(30)
            return got
    finally:
        for p in pools:
            p.close()


def test_a_rooms_leftover_counts_what_its_register_may_take_not_all_it_asks(small_steps, monkeypatch):
    """A asks up to 60 MiB, accepting 36; its room holds 40 MiB, all it can take. B asks 12 MiB
    meanwhile, which fits beside A's 40 (16 MiB stay cached). Counting A's region as its 60 MiB, B
    was refused at once; A's region is counted as what its room holds now: B waits, then fits."""
    got = _during_a_room(small_steps, monkeypatch, 60, lambda b, pool, _: b.register(
        model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=12 * MIB // 512,
        page_size=PAGE_TOKENS).host_tokens)
    assert got == {"a": 40 * MIB // 512, "b": 12 * MIB // 512}, got


def test_a_replacing_register_waits_for_another_ones_room_before_it_lets_go(small_steps, monkeypatch):
    """B, registered for the cache alone, registers again for 20 MiB while A's room is held. It did
    not wait for A's room: it released its registration, found no window, and was refused. It
    waits first now, its registration still standing, then fits."""
    def again(b: KVClient, pool: ShmKVPool, _) -> int:
        b.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                   page_size=PAGE_TOKENS)
        return b.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                          host_tokens=20 * MIB // 512, page_size=PAGE_TOKENS).host_tokens

    got = _during_a_room(small_steps, monkeypatch, 36, again)
    assert got == {"a": 36 * MIB // 512, "b": 20 * MIB // 512}, got


def test_a_register_that_cannot_fit_beside_what_another_ones_room_spans_does_not_wait(small_steps,
                                                                                      monkeypatch):
    """A accepts 36 MiB of up to 60; its room spans 40 MiB (a free range it holds claims only the
    budget left), all of which A takes. B asks 20 MiB, 4 more than A leaves: counting A's take by
    the room's claims, B waited for A's room, then was refused. It is refused at once now."""
    def b_registers(b: KVClient, pool: ShmKVPool, _):
        try:
            b.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                       host_tokens=20 * MIB // 512, page_size=PAGE_TOKENS)
        except KVClientError as e:
            return str(e), small_steps.run(lambda: bool(small_steps.core.rooms._held))
        return "registered", None

    got = _during_a_room(small_steps, monkeypatch, 60, b_registers)
    assert got["a"] == 40 * MIB // 512 and "not enough host memory" in got["b"][0], got
    assert got["b"][1] is True, got  # refused while A's room was still held


def test_a_register_replacing_one_as_large_needs_no_room_and_never_waits(small_steps, monkeypatch):
    """X holds 8 MiB and registers again for 8, naming it, while A's room is held: its own region
    gives it the room. It waited for A's room (3 s with a room of that many GiB)."""
    def again(_, pool: ShmKVPool, x: KVClient):
        tokens = x.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                            host_tokens=8 * MIB // 512, page_size=PAGE_TOKENS).host_tokens
        return tokens, small_steps.run(lambda: bool(small_steps.core.rooms._held))

    got = _during_a_room(small_steps, monkeypatch, 36, again)
    assert got == {"a": 36 * MIB // 512, "b": (8 * MIB // 512, True)}, got
