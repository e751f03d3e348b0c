"""A lane Put of keys its part lacks, stored whole on the data plane's thread (docs/design.md, "A Put
on the data plane"): its request read and checked in C, its keys walked under the cache's lock, the
free pages the loop set aside for its registration (its gate's stash) taken there, its device
pages copied into them as a write of the plane, then filed under its part and answered; the loop
settles its end (counters, recency, KV events, the tiers' hooks) and fills the stash again. The same
answers, bytes and counters as the gRPC Put; a key stored meanwhile counts present; what the plane
does not take is the loop's; a released registration's stash goes back; no page is held for good.
Real daemon, real client, real shared memory."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_dataplane import DTYPE, LAYERS, LAYOUT, PAGE, START, TOKENS, _client, _fill
from test_dataplane_alone import _until, _zero
from test_dataplane_cache import PAGES, _keys, _pages_of

from kvclient import CacheView, KVClient, KVClientError, ShmKVPool
from kvserver.core import cache_ops
from kvserver.store.keys import as_keys
from kvserver.store.pages import COMMITTED, WRITING

MiB = 1 << 20


def _stores(d) -> int:
    return d.core.plane.plane_stores


def _gate(d, c: KVClient):
    return d.core.clients[c.client_id].gate


def _settled(d) -> None:
    """The plane's ends settled on the loop (as a Stats would settle them first)."""
    d.run(d.core.plane.settle_gets)


def _holds(d) -> tuple[int, int, int]:
    """Readers, slab holds and pages being written, apart from the stashes' pages (being written,
    in no part, each a hold of its slab)."""
    def read() -> tuple[int, int, int]:
        d.core.plane.settle_gets()
        p = d.core.cache.pages
        stashed = int(((p.state == WRITING) & (p.part == -1)).sum())
        writing = int((p.state == WRITING).sum())
        return int(p.readers.sum()), int(p.slab_holds.sum()) - stashed, writing - stashed

    return d.run(read)


def _consistent(d) -> None:
    """The index counts exactly the committed pages, each filed under its part."""
    def check() -> None:
        d.core.plane.settle_gets()
        p = d.core.cache.pages
        committed = np.flatnonzero(p.state == COMMITTED)
        assert p.index.count == len(committed)
        assert (p.index.owner[committed] == p.part[committed]).all()

    d.run(check)


def _warm(c: KVClient, tag: str, d=None) -> None:
    """A client's first Put is the loop's, which gives its gate its part, and its stash once the
    Put is answered (``d``: waited for)."""
    assert c.put([f"warm-{tag}".encode().ljust(16, b".")], torch.arange(1)).stored == 1
    if d is not None:
        _until(lambda: _gate(d, c).stashed > 0)


def test_a_lane_put_of_new_keys_is_stored_on_the_plane_as_the_rpc_stores_it(plane_daemon) -> None:
    d = plane_daemon
    copier = d.core.copier
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            _client(d, pool, lane="grpc") as g:
        _fill(pool, 51)
        _warm(c, "a", d)
        gate = _gate(d, c)
        assert gate.stashed >= PAGES, "the loop set no pages aside for the plane's Puts"
        src = torch.randperm(PAGES)
        want = _pages_of(pool, src)
        stores, alone = _stores(d), copier.alone_copies
        before = c.stats().clients[0].transfers
        got = c.put(_keys("p"), src)
        assert _stores(d) == stores + 1, "the Put was not stored on the plane"
        assert copier.alone_copies == alone, "the loop copied it"
        on_grpc = g.put(_keys("q"), src)
        assert (got.stored, got.present, got.dropped, got.bytes) == (PAGES, 0, 0, on_grpc.bytes)
        assert c.lookup(_keys("p")).pages == PAGES  # filed before the answer
        dst = torch.arange(PAGES, 2 * PAGES)
        _zero(pool)
        assert g.get(_keys("p"), dst).wait(timeout=10) > 0
        assert all(torch.equal(x, y) for x, y in zip(_pages_of(pool, dst), want, strict=True))
        # Its end settled: its client's counters, its space's pages and bytes as the gRPC Put's.
        after = c.stats().clients[0].transfers
        written = (after.write_ops - before.write_ops, after.bytes_written - before.bytes_written)
        assert written == (1, got.bytes)
        (space,) = c.stats().spaces
        page_bytes = got.bytes // PAGES
        assert (space.counters.pages, space.counters.bytes) == (2 * PAGES + 1, (2 * PAGES + 1) * page_bytes)
        # Half stored, half new; a key named twice: the same counts as the gRPC Put's.
        stores = _stores(d)
        on_lane = c.put(_keys("p")[:8] + _keys("r")[:8], torch.arange(16))
        on_grpc = g.put(_keys("p")[:8] + _keys("s")[:8], torch.arange(16))
        assert (on_lane.stored, on_lane.present, on_lane.bytes) == (on_grpc.stored, on_grpc.present,
                                                                     on_grpc.bytes) == (8, 8, on_grpc.bytes)
        twice = c.put([_keys("t")[0]] * 2, torch.arange(2))
        assert (twice.stored, twice.present) == (1, 1) == (lambda r: (r.stored, r.present))(
            g.put([_keys("u")[0]] * 2, torch.arange(2)))
        assert _stores(d) == stores + 2
        assert c.lookup(_keys("r")[:8] + _keys("t")[:1]).pages == 9
        (space,) = c.stats().spaces
        assert space.counters.dedup_pages == 8 + 8 + 1 + 1
        # Its pages' recency: each Put's newest, as the loop's commit makes them.
        cache = d.core.cache
        part = d.run(lambda: d.daemon.servicer.cache._part(d.core.clients[c.client_id]))
        stamps = d.run(lambda: cache.pages.stamp[cache.pages.find(part.gid, as_keys(_keys("r")[:8]))].copy())
        older = d.run(lambda: cache.pages.stamp[cache.pages.find(part.gid, as_keys(_keys("p")[8:]))].copy())
        assert stamps.min() > older.max() > 0
    assert _holds(d) == (0, 0, 0)
    _consistent(d)


def test_kv_events_tell_the_plane_s_stores(plane_daemon) -> None:
    """A router hears of the pages the plane stored, in order, as of the loop's."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c, \
            CacheView(d.address, model="plane", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                      num_layers=START + LAYERS + 2) as v:
        where = v.events()
        _warm(c, "e", d)
        stores = _stores(d)
        keys = _keys("e", 12)
        assert c.put(keys, torch.arange(12)).stored == 12 and _stores(d) == stores + 1
        got: list[bytes] = []
        _until(lambda: got.extend(k for e in v.events(where.log_id, where.next_seq).events
                                  if not e.removed for k in e.keys) or len(got) >= 13)
        assert got[-12:] == keys


def test_what_the_plane_does_not_store_the_loop_stores_as_before(plane_daemon, monkeypatch) -> None:
    """Keys of over 32 bytes (the loop keeps their bytes, for KV events), more keys than the stash
    holds, and a Put while a copy of the registration is the loop's: stored by the loop, the same
    answers."""
    monkeypatch.setattr(cache_ops, "STASH_PAGES", 8)
    d = plane_daemon
    copier = d.core.copier
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 52)
        _warm(c, "w", d)
        gate = _gate(d, c)
        assert gate.stashed == 8
        stores, alone = _stores(d), copier.alone_copies
        wide = [k.ljust(48, b"w") for k in _keys("w", 4)]
        assert c.put(wide, torch.arange(4)).stored == 4
        assert c.put(_keys("x", 9), torch.arange(9)).stored == 9  # one more than the stash
        assert _stores(d) == stores and copier.alone_copies == alone + 2
        assert c.lookup(wide).pages == 4 and c.lookup(_keys("x", 9)).pages == 9
        assert c.put(_keys("y", 8), torch.arange(8)).stored == 8  # the stash's own size: the plane's
        assert _stores(d) == stores + 1
        _until(lambda: gate.stashed >= 4)  # filled again once half is used
    assert _holds(d) == (0, 0, 0)
    _consistent(d)


def test_a_key_stored_while_the_plane_copies_counts_present_and_its_page_goes_back(plane_daemon) -> None:
    d = plane_daemon
    engine, cache = d.core.plane.engine, d.core.cache
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 53)
        _warm(c, "m", d)
        gate = _gate(d, c)
        part = d.run(lambda: d.daemon.servicer.cache._part(d.core.clients[c.client_id]))
        stashed = gate.stashed
        keys = _keys("m", 4)
        got = []
        engine.pause(True)  # the plane takes the Put, its pages from the stash, and copies nothing yet
        try:
            t = threading.Thread(target=lambda: got.append(c.put(keys, torch.arange(4))))
            t.start()
            _until(lambda: gate.stashed == stashed - 4)

            def store_two() -> None:  # another Put of the part stores two of them meanwhile
                plan = cache.prepare_put(part, as_keys(keys[1:3]))
                cache.complete_put(plan, True)

            d.run(store_two)
        finally:
            engine.pause(False)
        t.join(timeout=10)
        assert [(r.stored, r.present) for r in got] == [(2, 2)]
        assert c.lookup(keys).pages == 4
        _until(lambda: gate.stashed >= stashed - 2)  # the two pages it did not file went back
    assert _holds(d) == (0, 0, 0)
    _consistent(d)


def test_a_released_registration_gives_its_stash_and_its_stopped_put_s_pages_back(plane_daemon) -> None:
    d = plane_daemon
    engine = d.core.plane.engine
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool:
        hasty = KVClient(d.address, timeout=0.3, resilient=False)
        hasty.register(model="plane", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE)
        _fill(pool, 54)
        _warm(hasty, "z", d)
        assert _gate(d, hasty).stashed > 0
        engine.pause(True)
        try:
            with pytest.raises(KVClientError):  # past its deadline, its copy held
                hasty.put(_keys("z", 8), torch.arange(8))
        finally:
            engine.pause(False)
        _until(lambda: d.run(lambda: engine.jobs) == 0)
        assert hasty.lookup(_keys("z", 8)).pages == 0  # nothing half written is found
        hasty.unregister()
        hasty.close()

        def stashed() -> int:
            d.core.plane.settle_gets()
            p = d.core.cache.pages
            return int((p.state == WRITING).sum())

        assert d.run(stashed) == 0, "a released registration's stash was kept"
    assert _holds(d) == (0, 0, 0)
    _consistent(d)


def test_puts_past_host_memory_evict_and_fill_the_stash_again(daemon_factory) -> None:
    """Many more Puts than host memory holds, on the plane: each stored (the stash filled again
    from the part's least recently used pages), the newest found, the index consistent."""
    d = daemon_factory(host_memory=24 * MiB)  # its region, then two slabs of 8 MiB
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built")
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _fill(pool, 55)
        _warm(c, "v", d)
        stores = _stores(d)
        for i in range(120):  # 16 pages of 16 KiB each: 30 MiB through 16 MiB
            keys = [f"v{i}-{k}".encode().ljust(16, b".") for k in range(16)]
            assert c.put(keys, torch.arange(16)).stored == 16
        assert _stores(d) - stores > 100
        assert c.lookup([f"v119-{k}".encode().ljust(16, b".") for k in range(16)]).pages == 16
        (space,) = c.stats().spaces
        assert space.counters.evictions > 0 and space.counters.bytes <= 16 * MiB
    assert _holds(d) == (0, 0, 0)
    _consistent(d)


def test_pages_the_plane_stored_are_kept_across_a_restart(daemon_factory, tmp_path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir(mode=0o700)
    d = daemon_factory(host_memory=64 * MiB, host_memory_dir=str(kept))
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built")
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool:
        _fill(pool, 56)
        want = _pages_of(pool, torch.arange(PAGES))
        with _client(d, pool) as c:
            _warm(c, "k", d)
            stores = _stores(d)
            assert c.put(_keys("k"), torch.arange(PAGES)).stored == PAGES and _stores(d) == stores + 1
        d.stop()
        again = daemon_factory(host_memory=64 * MiB, host_memory_dir=str(kept))
        assert again.core.recovery.adopted_pages == PAGES + 1
        assert again.core.recovery.torn == 0  # the stash went back at the stop: nothing was being written
        with _client(again, pool, lane="grpc") as g:
            _zero(pool)
            assert g.get(_keys("k"), torch.arange(PAGES)).wait(timeout=10) > 0
            got = _pages_of(pool, torch.arange(PAGES))
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_a_stash_takes_only_free_pages_being_written_under_the_cache_s_lock(plane_daemon) -> None:
    """``Engine.stash`` refuses what is not a page set aside (committed, free, outside the tables,
    another gate's kind), and any call without the cache's lock; ``unstash`` gives back exactly
    what it holds."""
    d = plane_daemon
    plane, cache = d.core.plane, d.core.cache
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 2 * TOKENS) as pool, _client(d, pool) as c:
        _warm(c, "u", d)
        gate = _gate(d, c)
        part = d.run(lambda: d.daemon.servicer.cache._part(d.core.clients[c.client_id]))

        def probe() -> list[str]:
            out = []
            with cache.lock:
                held = plane.unstash(gate)
                assert len(held) > 4 and (cache.pages.state[held] == WRITING).all()
                stored = cache.pages.find(part.gid, as_keys([b"warm-u".ljust(16, b".")]))
                for ids in (stored, np.array([cache.pages.size]), np.array([-1])):
                    try:
                        plane.stash(gate, ids, 8)
                        out.append("taken")
                    except ValueError:
                        out.append("refused")
                plane.stash(gate, held, len(held))
            assert gate.stashed == len(held)
            try:
                plane.stash(gate, held[:1], 8)  # outside the lock
                out.append("taken")
            except RuntimeError:
                out.append("refused")
            return out

        assert d.run(probe) == ["refused"] * 4
        with pytest.raises(TypeError):
            plane.engine.stash(object(), b"", 0)
    assert _holds(d) == (0, 0, 0)


def test_the_registrations_of_one_size_class_share_its_stash_and_one_that_never_puts_gets_none(
        plane_daemon, monkeypatch) -> None:
    """Two TP ranks of one model (one tenant, pages of one size): the pages set aside for their
    Puts are the class's (here 2 MiB: 128 pages), halved between them, not each its own; a
    registration that only Gets and Looks up sets none aside, nor one whose keys the plane never
    stores (over 32 bytes)."""
    monkeypatch.setattr(cache_ops, "STASH_BYTES", 2 << 20)
    d = plane_daemon
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as p0, ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as p1, \
            ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as p2:
        ranks = []
        for rank, pool in enumerate((p0, p1)):
            c = KVClient(d.address, timeout=10, resilient=False)
            c.register(model="tp", pool=pool, start_layer=START, end_layer=START + LAYERS,
                       num_layers=START + LAYERS + 2, host_tokens=TOKENS, page_size=PAGE, tp_rank=rank,
                       tp_size=2)
            ranks.append(c)
        reader = _client(d, p2)
        try:
            _warm(ranks[0], "s0", d)
            alone = _gate(d, ranks[0]).stashed
            assert alone == 128
            _warm(ranks[1], "s1", d)
            for c in ranks:  # each one's next fill: its share now
                assert c.put(_keys("s2", 1), torch.arange(1)).stored == 1
            _settled(d)
            shares = [_gate(d, c).stashed for c in ranks]
            assert all(0 < s <= -(-alone // 2) for s in shares), (alone, shares)
            assert reader.lookup(_keys("s0", 1)).pages == 0
            assert reader.get(_keys("s0", 1), torch.arange(1)).wait(timeout=10) == 0
            assert _gate(d, reader).stashed == 0, "a registration that never Puts set pages aside"
            wide = [k.ljust(48, b"w") for k in _keys("s4", 2)]  # keys the plane never stores itself
            assert reader.put(wide, torch.arange(2)).stored == 2
            assert reader.put(wide, torch.arange(2)).present == 2
            _settled(d)
            assert _gate(d, reader).stashed == 0, "a registration whose Puts are the loop's set some aside"
        finally:
            for c in ranks + [reader]:
                c.close()
    assert _holds(d) == (0, 0, 0)
    _consistent(d)
