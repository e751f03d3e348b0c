"""A scheduler's Lookups of a whole space on its space's lane, answered on the compiled data
plane's thread (docs/design.md, "A Get on the data plane"), against the real daemon with two real
engines, the two PP stages of one space: the same pages, counters and LRU touches as the gRPC
Lookup; the loop's until the space has every part, and for whatever the plane's check does not
take; the check differential against protobuf; a forgotten space id handed back to the loop."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from checks import wait_until
from test_dataplane_gets import _taken
from test_lane import RawRing
from test_view_lane import refused_on_a_space_lane

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool
from kvserver.core import cache_ops
from kvserver.protocol import ring as R
from kvserver.store.keys import as_keys
from kvserver.v1 import kvserver_pb2 as pb

LAYOUT, DTYPE, PAGE, TOKENS, LAYERS = KVLayout.mha(2, 32), torch.bfloat16, 16, 512, 4
MODEL = "plane-space"


def _keys(tag: str, n: int = 24) -> list[bytes]:
    return [f"{tag}-{i:08d}".encode().ljust(16, b".") for i in range(n)]


def _stage(d, pool: ShmKVPool, rank: int, model: str = MODEL) -> KVClient:
    """The engine of PP stage ``rank`` of two (layers [2 rank, 2 rank + 2) of 4)."""
    c = KVClient(d.address, timeout=10, resilient=False)
    c.register(model=model, pool=pool, start_layer=2 * rank, end_layer=2 * rank + 2, num_layers=LAYERS,
               host_tokens=TOKENS, page_size=PAGE, pp_rank=rank, pp_size=2)
    return c


def _view(d, model: str = MODEL, **kw) -> CacheView:
    return CacheView(d.address, model=model, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=LAYERS,
                     pp_size=2, **kw)


@contextlib.contextmanager
def _space(d) -> Iterator[tuple[KVClient, KVClient, CacheView, CacheView]]:
    """Both stages of the space, a view on its lane and one on gRPC."""
    with ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p0, ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p1, \
            _stage(d, p0, 0) as a, _stage(d, p1, 1) as b, _view(d) as v, _view(d, lane="grpc") as g:
        yield a, b, v, g


def _counts(c: KVClient) -> tuple[int, int]:
    spaces = c.stats().spaces
    return sum(s.counters.hits for s in spaces), sum(s.counters.misses for s in spaces)


def _gate(d):
    """The gate of the daemon's one space lane."""
    return d.run(lambda: next(iter(d.daemon.servicer.lanes.space_lanes)).gate)


def _space_lookups(d) -> int:
    return d.core.plane.plane_space_lookups


def _stamps(d, keys: list[bytes]) -> list[np.ndarray]:
    """Each part's LRU stamps of the pages of ``keys`` (all stored in every part)."""
    cache = d.core.cache
    (space,) = [s for s in cache._spaces.values() if s.key.model == MODEL]
    out = []
    for part in space.parts.values():
        ids = cache.pages.find(part.gid, as_keys(keys))
        assert (ids >= 0).all()
        out.append(cache.pages.stamp[ids].copy())
    return out


def test_a_whole_space_lookup_is_answered_by_the_plane_as_grpc_answers_it(plane_daemon) -> None:
    """Stage 0 holds 20 keys, stage 1 the first 12: the whole space holds 12. The view's Lookups on
    its lane, once the loop has given the lane's gate the space's parts, are answered on the
    plane's thread: the pages the gRPC Lookup finds, the same hits and misses counted, each part's
    pages made the most recent; a pin and a Lookup of more keys than a step walks are the loop's."""
    d = plane_daemon
    with _space(d) as (a, b, v, g):
        q = _keys("q")
        assert a.put(q[:20], torch.arange(20)).stored == 20
        assert b.put(q[:12], torch.arange(12)).stored == 12
        before = _space_lookups(d)
        assert v.lookup(q[:1]).pages == 1  # the loop's: it gives the lane's gate the space's parts
        assert _space_lookups(d) == before
        gate = _gate(d)
        assert gate is not None and gate.space and gate.cache_gid >= 0
        for keys, pages in ((q, 12), (q[:12], 12), (q[:20], 12), (_keys("z")[:3], 0), (q[5:9], 4),
                            (q[10:16], 2), (q[12:14], 0)):
            was = _counts(a)
            found = v.lookup(keys).pages
            on_lane = _counts(a)
            assert found == g.lookup(keys).pages == pages
            on_grpc = _counts(a)
            lane_counted = (on_lane[0] - was[0], on_lane[1] - was[1])
            assert lane_counted == (on_grpc[0] - on_lane[0], on_grpc[1] - on_lane[1])
        assert _space_lookups(d) == before + 7, "the Lookups were not answered on the plane"
        # The pages it found are the most recent in each part, the first key's the newest.
        assert v.lookup(q[3:6]).pages == 3 and _space_lookups(d) == before + 8
        for stamps in d.run(lambda: (d.core.plane.settle_gets(), _stamps(d, q[:12]))[1]):
            assert int(np.argmax(stamps)) == 3
            assert stamps[3] > stamps[4] > stamps[5] > max(np.delete(stamps, [3, 4, 5]))
        # The loop's: a pin (its lease), more keys than one step of a whole-space Lookup walks.
        pinned = v.lookup(q[:4], pin_ms=500)
        assert pinned.pages == 4 and pinned.lease_id
        assert v.release(pinned.lease_id) == 1
        many = q[:12] + _keys("m", 2048)
        assert v.lookup(many).pages == 12 == g.lookup(many).pages
        assert _space_lookups(d) == before + 8
        a.unregister()
        b.unregister()


def test_until_the_space_has_every_part_its_lookups_are_the_loops(plane_daemon) -> None:
    """With one stage registered the space holds no whole page: the loop answers 0 and gives the
    gate nothing; once the other stage has its part the plane answers."""
    d = plane_daemon
    q = _keys("p")
    with ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p0, ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p1, \
            _stage(d, p0, 0) as a, _view(d) as v:
        assert a.put(q[:8], torch.arange(8)).stored == 8
        before = _space_lookups(d)
        assert v.lookup(q).pages == 0 and v.lookup(q).pages == 0
        assert _space_lookups(d) == before
        gate = _gate(d)
        assert gate.cache_gid < 0
        with _stage(d, p1, 1) as b:
            assert b.put(q[:5], torch.arange(5)).stored == 5
            assert v.lookup(q).pages == 5  # the loop's, which gives the gate the parts
            assert v.lookup(q).pages == 5 and v.lookup(q[6:]).pages == 0
            assert _space_lookups(d) == before + 2
            b.unregister()
        a.unregister()


def test_what_the_plane_s_space_lookup_check_takes_the_loop_takes_alike(plane_daemon) -> None:
    """Differential: whatever a space's gate takes (``Gate.check_call``), protobuf parses to that
    space's Lookup with no client id and no pin, within the keys one step walks; and on a raw
    ring whose gate has the space's parts, every request the plane hands over is answered by the
    loop as before (tests/test_view_lane.py has the same requests on a gate without them)."""
    d = plane_daemon
    with _space(d) as (a, b, v, g):
        assert a.put(_keys("y")[:3], torch.arange(3)).stored == 3
        assert b.put(_keys("y")[:2], torch.arange(2)).stored == 2
        sid = v.open()
        ring = RawRing(d.address, space_id=sid, slots=4)
        try:
            keys = b"".join(_keys("y")[:3])
            lookup = pb.LookupRequest(space_id=sid, keys=keys, key_bytes=16, timeout_ms=50)
            lookup = lookup.SerializeToString()
            ring.put(0, R.RPC_LOOKUP, lookup)
            assert ring.ring() == 1
            lane = d.run(lambda: next(iter(d.daemon.servicer.lanes.space_lanes)))
            gate = lane.gate
            assert gate is not None and gate.space
            wait_until(lambda: ring.state(0) == R.DONE, 10, "the first Lookup's answer")
            assert gate.cache_gid >= 0  # the loop's answer gave the gate the space's parts
            crafted = [
                lookup + pb.LookupRequest(client_id=a.client_id).SerializeToString(),  # an engine's id too
                pb.LookupRequest(space_id="f" * len(sid), keys=keys, key_bytes=16).SerializeToString(),
                lookup + b"\x28\x01",  # a pin
                lookup + b"\x48\x01",  # a field it does not know
                lookup + lookup[:2 + len(sid)],  # the space id twice
                pb.LookupRequest(space_id=sid, keys=b"k" * 130, key_bytes=65).SerializeToString(),
                pb.LookupRequest(space_id=sid, keys=b"k" * 16 * 2049, key_bytes=16).SerializeToString(),
            ]
            for data in _taken(gate, R.RPC_LOOKUP, lookup, crafted, 13):
                parsed = pb.LookupRequest.FromString(data)
                assert parsed.space_id == sid and not parsed.client_id and not parsed.pin_ms
                n = len(parsed.keys) // parsed.key_bytes
                assert 1 <= parsed.key_bytes <= 64 and n * parsed.key_bytes == len(parsed.keys) and n >= 1
                assert n <= 2048  # one step of a 2-part space's Lookup
            before = _space_lookups(d)
            refused_on_a_space_lane(ring, a.client_id, keys)
            ring.put(0, R.RPC_GET, b"\xff" * 40)  # a Get's rpc id, and no request at all
            assert ring.ring() == 1
            wait_until(lambda: ring.state(0) == R.DONE, 10, "the ring's answer")
            inv = grpc.StatusCode.INVALID_ARGUMENT
            assert ring.answer(0) == (inv, "a space's lane carries only Lookups, not Get")
            assert _space_lookups(d) == before
        finally:
            ring.close()
        a.unregister()
        b.unregister()


def test_a_forgotten_space_id_s_lane_is_handed_back_to_the_loop(plane_daemon, monkeypatch) -> None:
    """The daemon forgets the ids of spaces dropped while empty when it holds too many: the lane of
    such an id is the loop's from then on (NOT_FOUND, as gRPC answers; the view opens its space
    again), never answered on the plane for an id the daemon no longer knows."""
    d = plane_daemon
    monkeypatch.setattr(cache_ops, "MAX_SPACE_IDS", 2)
    with ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p0, ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p1, \
            _stage(d, p0, 0) as a, _stage(d, p1, 1) as b, _view(d) as v:
        q = _keys("f")
        assert a.lookup(q).pages == 0 and b.lookup(q).pages == 0  # both parts: an empty, whole space
        assert v.lookup(q).pages == 0 and v.lookup(q).pages == 0
        lane = d.run(lambda: next(iter(d.daemon.servicer.lanes.space_lanes)))
        assert lane.gate.cache_gid >= 0
        first = v.open()
        # One space a tenant: another space's use drops this empty one, and a third view's open
        # passes the ids' bound, which forgets the dropped space's id.
        d.run(lambda: setattr(d.core.cache, "max_spaces_per_tenant", 1))
        with ShmKVPool(LAYOUT, DTYPE, 2, TOKENS) as p2, _stage(d, p2, 0, model="other") as o, \
                _view(d, model="other", lane="grpc") as w, _view(d, model="third", lane="grpc") as t:
            assert o.lookup(q).pages == 0
            w.open()
            t.open()
            assert lane.gate.closed, "the forgotten id's gate still answers"
            before = _space_lookups(d)
            assert v.lookup(q).pages == 0  # NOT_FOUND on the old lane: the view opens its space again
            assert v.open() != first and _space_lookups(d) == before
            o.unregister()
        a.unregister()
        b.unregister()


def test_a_space_gate_takes_only_its_spaces_lookups_and_is_given_its_parts_once() -> None:
    """A space's gate has no pool: it takes no Write, Load, Get or Put, copies nothing and has no
    pages to free; it is given a space's parts once (a registration's gate never is), within the
    bounds on its ids and keys; an engine's gate takes no space."""
    from kvserver.lane.plane import _kvlane

    if _kvlane is None:
        pytest.skip("the compiled data plane is not built")
    gate = _kvlane.space_gate()
    assert gate.space and gate.cache_gid == -1 and not gate.closed
    sid = b"0123456789abcdef0123456789abcdef"
    lookup = pb.LookupRequest(space_id=sid.decode(), keys=b"k" * 32, key_bytes=16).SerializeToString()
    assert not gate.check_call(R.RPC_LOOKUP, lookup)  # no parts yet
    for bad in [(1, b"", np.int32([3]).tobytes(), 8),  # no space id
                (1, sid, b"", 8),  # no part
                (1, sid, b"\x00" * 5, 8),  # not int32 ids
                (1, sid, np.int32([3, -1]).tobytes(), 8),  # a negative id
                (1, sid, np.int32([3]).tobytes(), 0),  # no key
                (1, sid, np.int32([3, 4]).tobytes(), 1 << 20)]:  # more pairs than the plane walks
        with pytest.raises(ValueError):
            gate.set_space(*bad)
    assert gate.cache_gid == -1
    gate.set_space(7, sid, np.int32([3, 4]).tobytes(), 8)
    gate.set_space(8, sid, np.int32([5]).tobytes(), 8)  # once: the first parts stay
    assert gate.cache_gid == 3
    assert gate.check_call(R.RPC_LOOKUP, lookup)
    assert not gate.check_call(R.RPC_LOOKUP, lookup + b"\x28\x01")  # a pin
    assert not gate.check_call(R.RPC_LOOKUP, pb.LookupRequest(
        space_id=sid.decode(), keys=b"k" * 16 * 9, key_bytes=16).SerializeToString())  # more keys than 8
    get = pb.GetRequest(keys=b"k" * 16, key_bytes=16, device_pages=[0]).SerializeToString()
    put = pb.PutRequest(keys=b"k" * 16, key_bytes=16, device_pages=[0]).SerializeToString()
    assert not gate.check_call(R.RPC_GET, get) and not gate.check_call(R.RPC_PUT, put)
    assert not gate.check(b"\x00" * 64)  # no Write or Load
    with pytest.raises(TypeError):
        gate.release_if_idle(np.int64([0]))
    with pytest.raises(ValueError):
        gate.set_cache(3, 1, b"client", 1 << 20, 8, 0)
    pool = dict(owned=np.ones(4, np.uint8), host_base=1, page_bytes=64, page_size=1, token_bytes=1,
                parts=1, start_layer=0, num_layers=1, epoch=1, dev_tokens=4, dev_bases=[1], dev_stride=1,
                max_indices=8)
    with pytest.raises(RuntimeError):
        gate.__init__(**pool)
    engine_gate = _kvlane.Gate(**pool)
    assert not engine_gate.space
    with pytest.raises(ValueError):
        engine_gate.set_space(1, sid, np.int32([3]).tobytes(), 8)


def test_closing_the_view_closes_its_lane_and_the_lane_s_gate(plane_daemon) -> None:
    """The plane watches the lane's doorbell: the view closing its end is told to the loop, which
    closes the lane (its descriptors given back) and its gate."""
    d = plane_daemon
    with _space(d) as (a, b, v, g):
        q = _keys("c")
        assert a.put(q[:4], torch.arange(4)).stored == 4 and b.put(q[:4], torch.arange(4)).stored == 4
        assert v.lookup(q).pages == 4 and v.lookup(q).pages == 4
        gate = _gate(d)
        assert gate.cache_gid >= 0 and not gate.closed
        v.close()
        lanes = d.daemon.servicer.lanes
        wait_until(lambda: d.run(lambda: len(lanes.space_lanes)) == 0, 10, "the lane's close")
        assert gate.closed
        a.unregister()
        b.unregister()


def test_the_plane_hands_lookups_to_the_loop_once_256_ends_wait_for_it(plane_daemon) -> None:
    """The loop settles the ends of the calls the plane answers: while it is busy, a scheduler
    calling back to back gets 256 answers from the plane, then its next Lookup goes to the loop
    (answered once the loop is free, which settles the 256 first), never a queue of ends without
    bound for one wake-up of the loop."""
    d = plane_daemon
    with _space(d) as (a, b, v, g):
        q = _keys("b")[:4]
        assert a.put(q, torch.arange(4)).stored == 4 and b.put(q, torch.arange(4)).stored == 4
        assert v.lookup(q).pages == 4 and v.lookup(q).pages == 4  # the gate has the parts
        a.stats()  # (the loop has settled those)
        before = _space_lookups(d)
        busy = threading.Event()
        d.loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(2.0)))  # the loop busy for 2 s
        assert busy.wait(5)
        counts, took = [], []
        for _ in range(300):
            counts.append(_space_lookups(d))
            t = time.perf_counter()
            assert v.lookup(q).pages == 4
            took.append(time.perf_counter() - t)
        slow = [i for i, s in enumerate(took) if s > 0.5]
        assert slow, "no Lookup waited for the loop"
        assert counts[slow[0]] == before + 256, counts[slow[0]] - before
        assert _space_lookups(d) >= before + 256
