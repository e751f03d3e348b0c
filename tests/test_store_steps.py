"""A large request's bookkeeping runs in steps of at most STEP_KEYS keys (the daemon lets its event
loop serve others between two): stepped or run at once it gives the same answer, and a request
given up between two steps leaves nothing behind (no pin, no page being written or read)."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import K, MiB, make_cache, one_part, part_of, put, space_key, stored

import kvserver.store.cache as cache_module
from kvserver.store import Keys
from kvserver.store.pages import WRITING
from kvserver.store.steps import run_steps

N = 100


def raw_keys(n: int, salt: int = 0) -> list[bytes]:
    return [(i + (salt << 32)).to_bytes(16, "little") for i in range(n)]


def keys(n: int, salt: int = 0) -> Keys:
    return Keys.of(raw_keys(n, salt))


@pytest.fixture
def small_steps(monkeypatch):
    monkeypatch.setattr(cache_module, "STEP_KEYS", 16)


def steps_of(gen) -> tuple[int, object]:
    """(how many times it yielded, what it returned)."""
    n = 0
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return n, done.value
        n += 1


def test_a_large_request_yields_between_steps_and_answers_the_same(small_steps):
    cache, _, _ = make_cache(capacity=64 * MiB)
    part = one_part(cache, page_bytes=4096)
    yields, plan = steps_of(cache.prepare_put_steps(part, keys(N)))
    assert yields == N // 16 and len(plan.positions) == N and plan.positions.tolist() == list(range(N))
    cache.complete_put(plan, True)
    yields, got = steps_of(cache.lookup_steps(part, keys(N)))
    assert yields == N // 16 and got == (N, "", 0, 0)
    mixed = Keys.of([*(k.to_bytes(16, "little") for k in range(40)), b"missing".ljust(16, b"\0")])
    assert steps_of(cache.lookup_steps(part, mixed)) == (2, (40, "", 0, 0))  # stops at the first miss
    yields, plan = steps_of(cache.prepare_get_steps(part, keys(N)))
    assert yields == N // 16 and plan.pages == N and len(plan.offsets) == N
    cache.complete_get(plan, True)
    counters = cache.stats()[0][0].counters
    assert (counters.pages, counters.hits, counters.misses) == (N, N + 40, 1)


def test_a_stepped_puts_plan_is_the_plan_of_the_put_at_once(monkeypatch):
    """The steps' plans are gathered as they come (``PutPlans``), not concatenated at the end: the
    same positions, offsets, pages, present and waiting keys as the Put made in one step."""
    def plan_of(step_keys: int):
        monkeypatch.setattr(cache_module, "STEP_KEYS", step_keys)
        cache, _, _ = make_cache(capacity=64 * MiB)
        part = one_part(cache, page_bytes=4096)
        put(cache, part, [i.to_bytes(16, "little") for i in range(10, 30, 3)])  # 7 stored already
        writing = cache.prepare_put(part, keys(N)[40:50])  # another Put writing these
        _, plan = steps_of(cache.prepare_put_steps(part, keys(N)))
        cache.complete_put(writing, True)
        offsets = {int(o) - int(cache.slabs.slabs[int(cache.pages.slab[i])].offset)
                   for i, o in zip(plan.page_ids.tolist(), plan.offsets.tolist(), strict=True)}
        return (plan.positions.tolist(), len(plan.page_ids), plan.present, plan.dropped,
                plan.waiting.tolist(), sorted(offsets))

    stepped, at_once = plan_of(16), plan_of(1 << 20)
    assert stepped == at_once and len(at_once[0]) == N - 7 - 10 and at_once[2] == 7, stepped


def test_a_pinned_lookup_pins_every_step_under_one_lease(small_steps):
    cache, _, _ = make_cache(capacity=64 * MiB)
    part = one_part(cache, page_bytes=4096)
    put(cache, part, keys(N))
    n, lease = run_steps(cache.lookup_steps(part, keys(N), pin_ms=1000))[:2]
    assert n == N and len(cache.leases.leases) == 1 and int(cache.pages.pins.sum()) == N
    assert cache.release("t", [lease]) == 1 and int(cache.pages.pins.sum()) == 0


def test_requests_given_up_between_steps_leave_nothing(small_steps):
    cache, arena, _ = make_cache(capacity=64 * MiB)
    part = one_part(cache, page_bytes=4096)
    put(cache, part, keys(N))
    booked = arena.booked
    for gen in (cache.lookup_steps(part, keys(N), pin_ms=1000), cache.prepare_put_steps(part, keys(N, 1)),
                cache.prepare_get_steps(part, keys(N))):
        next(gen)
        next(gen)  # two steps done
        gen.close()  # the caller gave up (a cancelled RPC)
    assert int(cache.pages.pins.sum()) == 0 and not cache.leases.leases and arena.booked == booked
    assert int((cache.pages.state == WRITING).sum()) == 0 and int(cache.pages.readers.sum()) == 0
    assert cache.lookup(part, keys(N, 1)) == (0, "")  # the Put given up stored nothing
    assert part.pages == N


def test_a_put_that_fills_the_budget_drops_every_later_key(small_steps):
    cache, _, _ = make_cache(capacity=8 * MiB, default_quota=2 * MiB)  # 2 MiB: 512 pages of 4 KiB
    part = one_part(cache, page_bytes=4096)
    plan = cache.prepare_put(part, keys(600))
    stored = len(plan.positions)
    assert stored < 600 and plan.positions.tolist() == list(range(stored))  # a prefix, whole
    assert plan.dropped == 600 - stored and plan.present == 0
    cache.complete_put(plan, True)


def test_a_pin_runs_from_the_answer_not_from_the_lookups_first_step(small_steps):
    """A pinned lookup's lease is not expired between its steps: its pin_ms counts from the
    answer, so the pins of every step hold until then."""
    cache, _, clock = make_cache(capacity=64 * MiB)
    part = one_part(cache, page_bytes=4096)
    put(cache, part, keys(N))
    steps = cache.lookup_steps(part, keys(N), pin_ms=1)
    next(steps)  # the first step pinned its pages under the lease
    clock.now += 1.0  # past pin_ms
    assert cache.expire_leases() == 0  # as the daemon's expiry task would run between two steps
    n, lease = run_steps(steps)[:2]
    assert n == N and lease in cache.leases.leases and int(cache.pages.pins.sum()) == N
    clock.now += 0.002
    assert cache.expire_leases() == 1 and int(cache.pages.pins.sum()) == 0


def test_wide_keys_are_digested_in_steps(monkeypatch):
    """Keys wider than 32 bytes are kept as digests, one hash call each: a request of them is
    unpacked in steps (the event loop free between two), to the same keys as at once."""
    import kvserver.store.keys as keys_module

    monkeypatch.setattr(keys_module, "STEP_KEYS", 16)
    packed = b"".join(i.to_bytes(40, "little") for i in range(N))
    yields, stepped = steps_of(Keys.unpack_steps(packed, 40, N))
    whole = Keys.unpack(packed, 40, N)
    assert yields == N // 16 and (stepped.words == whole.words).all() and (stepped.lens == whole.lens).all()
    assert steps_of(Keys.unpack_steps(packed[: 16 * N], 16, N))[0] == 0  # 16 bytes: one numpy pass


@pytest.mark.parametrize("parts", [1, 2])
def test_a_packed_lookup_walks_in_steps_and_answers_as_lookup_steps(monkeypatch, parts):
    """KVCache.lookup_packed_steps walks PACKED_STEP_PAIRS (key, part) pairs a step (never fewer
    keys than STEP_KEYS), yields between two, changes nothing before its last step (a Lookup given
    up midway counted and touched nothing), and answers what lookup_steps answers: a hit that ends
    inside a step, at a step's end, or runs to the last key, for a space of one part and of two, and
    for a part; a space of several parts bounded by MAX_LOOKUP_PAIRS alike, a part never."""
    monkeypatch.setattr(cache_module, "STEP_KEYS", 4)
    monkeypatch.setattr(cache_module, "PACKED_STEP_PAIRS", 16)
    cache, _, _ = make_cache(capacity=64 * MiB)
    if not cache.pages.compiled:
        pytest.skip("built without a compiler")
    space = cache.space(space_key("t", tp=parts))
    members = [part_of(cache, space, shard, page_bytes=4096) for shard in range(parts)]
    stored = [i.to_bytes(16, "little") for i in range(N)]
    for i, part in enumerate(members):  # the last part misses key 70: a space's hit ends there
        put(cache, part, [k for j, k in enumerate(stored) if not (i == parts - 1 and parts > 1 and j == 70)])
    step = 16 // parts
    assert cache.packed_step_keys(space) == step and cache.packed_step_keys(members[0]) == 16
    hit = 70 if parts > 1 else N
    p = cache.pages
    for asked, want in [(N, hit), (5 * step, 5 * step), (5 * step + 3, 5 * step + 3), (0, 0)]:
        packed = b"".join(stored[:asked])
        for extra in ([], [b"\xff" * 16]):  # a miss after the keys asked
            packed_more = packed + b"".join(extra)
            n_keys = asked + len(extra)
            before = (space.counters.hits, space.counters.misses)
            yields, got = steps_of(cache.lookup_packed_steps(space, packed_more, 16))
            want = min(want, asked)
            assert got == (want, "", 0, 0)
            # a step a yield until the one where the hit ends (or the last)
            assert yields == (want // step if want < n_keys else max(0, -(-n_keys // step) - 1))
            counted = (space.counters.hits - before[0], space.counters.misses - before[1])
            assert counted == (want, n_keys - want)
            ids = [p.find(part.gid, Keys.unpack(packed_more, 16, N + 1))[:want] for part in members]
            stamps = [p.stamp[i].copy() for i in ids]
            mid = (space.counters.hits, space.counters.misses)
            assert run_steps(cache.lookup_steps(space, Keys.unpack(packed_more, 16, N + 1))) == got
            for i, part_ids in enumerate(ids):  # the same order of recency as lookup_steps leaves
                order = np.argsort(-stamps[i], kind="stable")
                assert np.array_equal(order, np.argsort(-p.stamp[part_ids], kind="stable"))
            assert (space.counters.hits - mid[0], space.counters.misses - mid[1]) == (want, n_keys - want)
    # A part's own Lookup walks every key; a space of several parts is bounded as lookup_steps
    # bounds it (MAX_LOOKUP_PAIRS); at once or in steps alike.
    monkeypatch.setattr(cache_module, "MAX_LOOKUP_PAIRS", 60)
    packed = b"".join(stored)
    for target in (members[0], space):
        want = run_steps(cache.lookup_steps(target, Keys.unpack(packed, 16, N + 1)))
        assert want.pages == (30 if parts > 1 and target is space else N)
        assert run_steps(cache.lookup_packed_steps(target, packed, 16)) == want
        assert cache.lookup_packed(target, packed, 16) == want
    # given up after its first step: nothing counted, nothing touched
    before = (space.counters.hits, space.counters.misses, p.stamp.copy())
    gen = cache.lookup_packed_steps(space, b"".join(stored), 16)
    next(gen)
    gen.close()
    assert (space.counters.hits, space.counters.misses) == before[:2]
    assert np.array_equal(p.stamp, before[2])


def test_a_large_puts_pages_are_committed_in_steps_before_it_answers(socket_dir, monkeypatch):
    """A Put of 32 Ki pages into a space of several parts (an MHA model at TP 4) committed them on
    the event loop in one go once their copy was over: 10-14 ms at the most keys a Put may name
    (36 ms before the index split its buckets ahead), every other engine waiting. Its pages are
    committed in steps now, the loop serving others between two; the Put still answers only once
    every one of them is committed."""
    import os

    import torch
    from conftest import DaemonThread

    from kvclient import KVClient, KVLayout, ShmKVPool
    from kvserver.config import ServerConfig
    from kvserver.core import cache_ops
    from kvserver.store import KVCache

    sizes: list[int] = []
    real, real_written = KVCache.complete_put, cache_ops.CacheOps._written
    wakes = []

    def complete_put(cache, plan, ok):
        sizes.append(len(plan.page_ids))
        return real(cache, plan, ok)

    def written(ops):  # Puts waiting on its keys look again: once, not at every step
        wakes.append(len(sizes))
        return real_written(ops)

    monkeypatch.setattr(KVCache, "complete_put", complete_put)
    monkeypatch.setattr(cache_ops.CacheOps, "_written", written)
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=64 * MiB))
    n = 4 * cache_ops.SETTLE_PAGES
    try:
        with ShmKVPool(KVLayout.mha(1, 64), torch.float16, num_layers=1, num_tokens=2 * n) as pool, \
                KVClient(d.address, timeout=60) as client:
            client.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                            page_size=2, tp_rank=0, tp_size=4)
            packed = np.arange(n, dtype=np.uint64).repeat(2).tobytes()
            sizes.clear()
            wakes.clear()
            got = client.put(packed, np.arange(n), key_bytes=16)
            assert got.stored == n, got
            assert max(sizes) <= cache_ops.SETTLE_PAGES and sum(sizes) == n, sizes
            assert wakes == [len(sizes)], wakes  # (each wake re-checks every waiting Put's keys)
            assert client.lookup(packed, key_bytes=16).pages == n
    finally:
        d.stop()


def test_the_daemons_stop_waits_for_a_put_whose_copy_ends_as_its_client_goes(socket_dir, monkeypatch):
    """The daemon stops while a large Put's copy runs: the copy ends while the stop releases its
    client, and the Put's pages are committed in steps started then. The stop waited only for the
    steps started before it released its clients: pages were committed after the tiers and the
    arena were closed, or left being written. It waits for these too now."""
    import concurrent.futures as cf
    import os
    import threading

    import torch
    from conftest import DaemonThread

    from kvclient import KVClient, KVLayout, ShmKVPool
    from kvserver.config import ServerConfig
    from kvserver.core import cache_ops, kvcore
    from kvserver.media import shm

    real_start, real_close = shm.ShmDevicePool.start, kvcore.KVCore.close
    settled_after_close: list[int] = []

    def slow_start(pool, job, to_device, *args, **kw):  # the copy ends 1 s late
        done, late = real_start(pool, job, to_device, *args, **kw), cf.Future()
        done.add_done_callback(lambda f: threading.Timer(1.0, lambda: late.set_result(None)).start())
        return late

    async def close(core, grace=None):
        await real_close(core, grace)
        closed.set()

    real_settle = cache_ops.CacheOps._settle

    def settle(ops, plan, ok):
        if closed.is_set():
            settled_after_close.append(len(plan.page_ids))
        return real_settle(ops, plan, ok)

    closed = threading.Event()
    monkeypatch.setattr(shm.ShmDevicePool, "start", slow_start)
    monkeypatch.setattr(kvcore.KVCore, "close", close)
    monkeypatch.setattr(cache_ops.CacheOps, "_settle", settle)
    n = 64 * cache_ops.SETTLE_PAGES
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=256 * MiB,
                                  shutdown_grace=0.05))
    with ShmKVPool(KVLayout.mha(1, 64), torch.float16, num_layers=1, num_tokens=2 * n) as pool, \
            KVClient(d.address, timeout=30, lane="grpc") as client:
        client.register(model="m", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                        page_size=2, tp_rank=0, tp_size=4)
        put = threading.Thread(target=lambda: client.put(np.arange(n, dtype=np.uint64).repeat(2).tobytes(),
                                                         np.arange(n), key_bytes=16))
        put.start()
        import time

        time.sleep(0.5)
        d.stop()
        put.join(30)
    state = d.core.cache.pages.state
    assert not np.count_nonzero(state == WRITING) and not settled_after_close, settled_after_close


def test_leases_ending_together_end_in_steps(monkeypatch):
    """A Release of many leases, a registration's release ending the leases it took, and the sweep
    ending the leases that expired together, unpinned every page at once: 16 Mi pins (a tenant's
    most) held the event loop 40-90 ms. They end in steps of at most ``END_STEP_PINS`` pins now
    (a lease of more is one step), the same leases ended and every pin gone."""
    from kvserver.store import leases as leases_module

    monkeypatch.setattr(leases_module, "END_STEP_PINS", 25)
    cache, _, clock = make_cache(capacity=64 * MiB)
    part = one_part(cache, page_bytes=4096)
    put(cache, part, keys(N))

    def pinned(owner: str = "") -> list[str]:  # ten leases of ten pins
        return [run_steps(cache.lookup_steps(part, keys(N)[i:i + 10], pin_ms=1000, owner=owner))[1]
                for i in range(0, N, 10)]

    ids = pinned()
    yields, ended = steps_of(cache.release_steps("t", ids + ids[:3] + ["gone"]))
    assert (yields, ended, int(cache.pages.pins.sum())) == (4, 10, 0)  # two leases a step
    pinned(owner="engine")
    assert steps_of(cache.release_owned_steps("engine")) == (4, 10) and not cache.pages.pins.any()
    pinned()
    clock.now += 2
    assert steps_of(cache.expire_leases_steps()) == (4, 10) and not cache.pages.pins.any()
    assert not cache.leases.leases
    pinned()  # a sweep given up after its first step leaves the rest to the next one
    clock.now += 2
    sweep = cache.expire_leases_steps()
    next(sweep)
    sweep.close()
    assert len(cache.leases.leases) == 8 and cache.expire_leases() == 8 and not cache.leases.leases


def test_a_stepped_puts_piece_whose_tier_hook_raised_is_not_committed_twice(socket_dir, monkeypatch):
    """The disk tier's hook raises for the first piece of a stepped Put, after that piece was
    committed. Retrying the piece committed it twice, taking its slabs' hold counts below zero
    (a slab then looks idle while a page of it is read). The rest is settled, the piece not again."""
    import os

    from cache_engine import CacheEngine
    from conftest import DaemonThread

    from kvserver.config import ServerConfig
    from kvserver.core import cache_ops
    from kvserver.disk import tier as disk_tier

    real, calls = disk_tier.DiskTier.demote, []

    def demote(tier, part, ids):
        calls.append(len(ids))
        if len(calls) == 1:
            raise MemoryError("the first piece's hook")
        return real(tier, part, ids)

    monkeypatch.setattr(disk_tier.DiskTier, "demote", demote)
    n = 2 * cache_ops.SETTLE_PAGES
    d = DaemonThread(ServerConfig(socket=os.path.join(socket_dir, "kv.sock"), host_memory=96 * MiB,
                                  disk_cache=os.path.join(socket_dir, "disk"), disk_size=256 * MiB))
    try:
        eng = CacheEngine(d.address, pages=n, end=1, timeout=30)
        try:
            keys = [f"k{i:06d}".encode().ljust(16, b".") for i in range(n)]
            eng.fill(keys, np.arange(n))
            assert eng.put(keys, np.arange(n)).stored == n
            assert calls == [cache_ops.SETTLE_PAGES] * 2, calls
            assert d.run(lambda: int(d.core.cache.pages.slab_holds.min())) >= 0
            eng.wipe()
            assert eng.get(keys, np.arange(n)) == n and eng.wrong(keys, np.arange(n)) == []
        finally:
            eng.client.close()
            eng.pool.close()
    finally:
        d.stop()


def _expired_leases(n: int, **settings):
    """A cache whose tenant "t" holds ``n`` leases of one pin each, all expired (none ended yet)."""
    cache, _, clock = make_cache(**settings)
    part = one_part(cache)
    put(cache, part, keys(1))
    for _ in range(n):
        cache.lookup(part, keys(1), pin_ms=1000)
    clock.now += 2
    return cache, part


def test_a_tenant_at_the_lease_limit_has_its_expired_leases_ended_in_steps(monkeypatch):
    """What a pinning Lookup's caller runs first where its tenant holds the most leases: every
    expired lease ends, their pins too, in steps with the event loop free between two (in one go,
    4096 leases of 4 Ki pins held it 57-68 ms); the Lookup then takes its lease."""
    from kvserver.store import leases as leases_module

    monkeypatch.setattr(leases_module, "END_STEP_PINS", 1)  # a lease a step
    cache, part = _expired_leases(8, max_leases_per_tenant=8)
    assert steps_of(cache.make_way_steps("t"))[0] == 7
    assert not cache.leases.leases and int(cache.pages.pins.sum()) == 0
    assert cache.lookup(part, keys(1), pin_ms=1000)[0] == 1


def test_the_lease_check_itself_ends_at_most_one_step_of_expired_leases(monkeypatch):
    """Leases that expired while a Lookup's caller ended others in steps are not all ended in the
    check of its walk, in one go: one step there, the caller's next steps the rest."""
    from kvserver.store import leases as leases_module

    monkeypatch.setattr(leases_module, "END_STEP_PINS", 1)  # a lease a step
    cache, _ = _expired_leases(8, max_leases_per_tenant=8)
    assert cache.leases.at_limit("t") and cache.leases.any_expired()
    with cache.lock:
        cache.leases.check("t")  # room: one expired lease ended
    assert len(cache.leases.leases) == 7 and cache.leases.any_expired()


def test_a_lookup_of_the_store_at_the_lease_limit_has_every_expired_lease_make_way():
    """The store's own (synchronous) Lookup ends every expired lease before its check, other
    tenants' ahead of its own too, as before the steps."""
    cache, _, clock = make_cache(max_leases_per_tenant=600)
    mine, theirs = one_part(cache), part_of(cache, cache.space(space_key("u")))
    put(cache, mine, keys(1))
    put(cache, theirs, keys(1))
    for _ in range(600):
        cache.lookup(theirs, keys(1), pin_ms=1000)
    clock.now += 0.5
    for _ in range(600):
        cache.lookup(mine, keys(1), pin_ms=1000)
    clock.now += 2  # theirs are due first in the heap, more than one step's worth
    assert cache.lookup(mine, keys(1), pin_ms=1000)[0] == 1
    assert len(cache.leases.leases) == 1


def test_one_step_ends_at_most_512_leases_however_few_pins_they_hold():
    """Leases of one pin each: a step bounded by pins alone ended 4096 of them at once (15 ms)."""
    cache, _ = _expired_leases(1024, max_leases_per_tenant=1024)
    assert steps_of(cache.expire_leases_steps()) == (1, 1024) and int(cache.pages.pins.sum()) == 0


def test_a_put_longer_than_a_step_keeps_the_pages_its_first_steps_found_stored(small_steps):
    """A Put's later step makes room without evicting the stored pages its earlier steps counted
    present: with room for one step's pages, Put(A + B) after Put(A) keeps A and drops B."""
    cache, _, _ = make_cache(capacity=3 * MiB)
    part = one_part(cache, page_bytes=128 * 1024)  # one 2 MiB slab of 16 pages fits
    a, b = raw_keys(16), raw_keys(16, salt=1)
    put(cache, part, a)
    assert cache.lookup(part, a)[0] == 16
    plan = put(cache, part, a + b)
    assert (len(plan.positions), plan.present, plan.dropped) == (0, 16, 16)
    assert cache.lookup(part, a)[0] == 16 and part.space.counters.evictions == 0
    assert int(cache.pages.readers.sum()) == 0  # nothing held once the Put is planned


def test_a_put_counts_every_key_from_its_first_dropped_one_as_dropped(small_steps):
    """Dropped keys are the request's last ones, in one step or across steps: a key stored
    already after the first key left out counts dropped, not present, so that the leading
    ``n - dropped`` keys are what the part holds (kvclient's SGLang backend reads it so)."""
    cache, _, _ = make_cache(capacity=4 * MiB)  # four 1 MiB pages
    part = one_part(cache)
    put(cache, part, K("cxy"))
    _, lease = cache.lookup(part, K("cxy"), pin_ms=60_000)  # three of the four pages pinned
    plan = put(cache, part, K("abc"))  # a stored, b left out, c stored already
    assert (len(plan.positions), plan.present, plan.dropped) == (1, 0, 2)
    assert stored(cache, part, "abc") == "ac"
    counters = part.space.counters
    assert (counters.dedup_pages, counters.dropped) == (0, 2)
    cache.release("t", [lease])

    cache, _, _ = make_cache(capacity=3 * MiB)
    part = one_part(cache, page_bytes=128 * 1024)  # 16 pages fit, a step is 16 keys
    c = raw_keys(4, salt=2)
    put(cache, part, c)
    _, lease = cache.lookup(part, c, pin_ms=60_000)
    plan = put(cache, part, raw_keys(16) + c)  # room for 12 of n; c after them
    assert (len(plan.positions), plan.present, plan.dropped) == (12, 0, 8)
    cache.release("t", [lease])
