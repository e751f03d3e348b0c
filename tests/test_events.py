"""KV events of the node's cache: the Events call (what an engine's connector reads) and the
daemon's own ZMQ publisher (--kv-events-endpoint), decoded with vLLM's own KVEventBatch classes.
Stores of every engine's pages, removals on eviction, each tier's medium and locality, the
engines' own (wide) keys, bounded logs with their gaps, and replay after a missed batch. Real
daemons, real engines over shared memory."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import vllm_env
import zmq
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE, CacheEngine
from mooncake_master import free_port

from kvclient import CacheView
from kvserver.events import book
from kvserver.events.publisher import space_topic
from kvserver.protocol.layout import dtype_named
from kvserver.store import SpaceKey

MiB = 1 << 20


def wide(prefix: int, n: int) -> list[bytes]:
    """32-byte keys, as vLLM's sha256 block hashes are (kept whole in the index)."""
    return [prefix.to_bytes(2, "big") + i.to_bytes(4, "big") + bytes(26) for i in range(n)]


def store(eng: CacheEngine, keys: list[bytes], batch: int = 100) -> None:
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        eng.fill(chunk, np.arange(len(chunk)))
        r = eng.put(chunk, np.arange(len(chunk)))
        assert r.stored + r.present == len(chunk)


def view(address: str) -> CacheView:
    return CacheView(address, model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=4)


def read_all(v: CacheView, where: list) -> list:
    """Every event the space's log has after ``where`` = [log_id, seq] (updated)."""
    out = []
    while True:
        r = v.events(*where)
        where[:] = [r.log_id, r.next_seq]
        out += r.events
        if not r.events:
            return out


def test_the_events_call_tells_an_engine_every_store_and_eviction_in_its_space(daemon_factory):
    d = daemon_factory(host_memory=24 * MiB)
    with CacheEngine(d.address, pages=128) as mine, CacheEngine(d.address, pages=128) as other, \
            view(d.address) as v:
        where = ["", 0]
        assert read_all(v, where) == []  # the first read starts the log
        ours = wide(1, 100)
        store(other, ours)  # stored by another engine: this space's router must hear of it too
        events = read_all(v, where)
        assert all(not e.removed and (e.medium, e.locality) == ("CPU", "LOCAL") for e in events)
        assert [k for e in events for k in e.keys] == ours  # the engines' own 32-byte keys, in order
        # Other pages fill host memory: ours are evicted, and this engine is told (it caused none).
        with CacheEngine(d.address, pages=128, model="filler") as filler:
            store(filler, wide(2, 800))
        events = read_all(v, where)
        removed = {k for e in events if e.removed for k in e.keys}
        assert removed == set(ours), "every evicted page of the space is reported"
        assert mine.lookup(ours).pages == 0
        assert all(e.seq > 0 and e.ts > 0 and e.unnamed == 0 for e in events)


def test_a_reader_that_falls_behind_is_told_of_the_gap_and_a_restarted_daemon_starts_over(
        daemon_factory, monkeypatch):
    monkeypatch.setattr(book, "MAX_LOG_KEYS", 200)
    monkeypatch.setattr(book, "CHUNK_KEYS", 50)
    d = daemon_factory(host_memory=64 * MiB)
    with CacheEngine(d.address, pages=128) as eng, view(d.address) as v:
        where = ["", 0]
        read_all(v, where)
        store(eng, wide(3, 500))  # 10 events of 50: the log keeps the last 200 keys
        r = v.events(*where)
        assert r.gap and r.events[0].seq == 7 and len(r.events) == 4, r
        assert d.run(lambda: d.core.events.gaps) == 1
        # Another daemon's log (a restart): the reader is told nothing old, and starts over.
        r = v.events("another-daemon", 3)
        assert r.events == () and r.log_id == where[0] and r.next_seq == 10


def test_the_disk_tier_reports_its_own_stores_as_storage(daemon_factory, tmp_path):
    d = daemon_factory(host_memory=24 * MiB, disk_cache=str(tmp_path / "disk"), disk_size=64 * MiB)
    with CacheEngine(d.address, pages=128) as eng, view(d.address) as v:
        where = ["", 0]
        read_all(v, where)
        keys = wide(4, 60)
        store(eng, keys)
        deadline = time.monotonic() + 20
        seen: dict[str, set] = {"CPU": set(), "STORAGE": set()}
        while seen["STORAGE"] != set(keys):
            assert time.monotonic() < deadline, seen
            for e in read_all(v, where):
                assert e.locality == "LOCAL" and not e.removed
                seen[e.medium] |= set(e.keys)
            time.sleep(0.05)
        assert seen["CPU"] == set(keys)


@pytest.fixture
def vllm_classes():
    if not vllm_env.vllm_installed():
        pytest.skip("vllm not installed (scripts/install_vllm.sh)")
    vllm_env.setup()
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    yield KVEventBatch, BlockStored, BlockRemoved
    vllm_env.restore()


def test_the_daemons_publisher_speaks_vllms_schema_with_replay(daemon_factory, vllm_classes):
    KVEventBatch, BlockStored, BlockRemoved = vllm_classes
    pub, rep = free_port(), free_port()
    d = daemon_factory(host_memory=24 * MiB, kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                       kv_events_replay_endpoint=f"tcp://127.0.0.1:{rep}")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kvserver/")
    time.sleep(0.3)  # the subscription reaches the publisher
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    try:
        with CacheEngine(d.address, pages=128) as eng:
            ours = wide(5, 80)
            store(eng, ours)
            with CacheEngine(d.address, pages=128, model="filler") as filler:
                store(filler, wide(6, 800))
            space = d.run(lambda: next(s.key for s in d.core.cache._spaces.values() if s.key.model == MODEL))
        topic = space_topic(space).encode()
        as_int = {int.from_bytes(k, "big") & ((1 << 64) - 1) for k in ours}
        stored: set[int] = set()
        removed: set[int] = set()
        frames = []
        deadline = time.monotonic() + 10
        while removed != as_int:
            assert time.monotonic() < deadline, (len(stored), len(removed))
            if not sub.poll(200):
                continue
            t, seq, payload = sub.recv_multipart()
            frames.append((t, seq, payload))
            if t != topic:
                continue
            batch = decode(payload)  # vLLM's own classes decode the daemon's bytes
            events = batch.events
            if not stored and not removed:  # the topic's first batch since the daemon started
                assert type(events[0]).__name__ == "AllBlocksCleared"
                events = events[1:]
            for ev in events:
                assert (ev.medium, ev.locality) == ("CPU", "LOCAL")
                if isinstance(ev, BlockStored):
                    assert ev.block_size == PAGE and ev.token_ids == [] and ev.parent_block_hash is None
                    stored |= set(ev.block_hashes)
                else:
                    assert isinstance(ev, BlockRemoved)
                    removed |= set(ev.block_hashes)
        assert stored == as_int
        # A subscriber that missed everything asks for a replay from seq 1: the same batches.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rep}")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, t, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((t, seq, payload))
        assert replayed[: len(frames)] == frames[: len(replayed)]
        assert int.from_bytes(replayed[0][1], "big") == 1
    finally:
        ctx.destroy(linger=0)


def test_a_log_joins_small_changes_but_never_into_an_event_a_reader_has_read():
    from kvserver.store import Keys

    space = SpaceKey("t", "m", LAYOUT, dtype_named(str(DTYPE)), PAGE, 4, 1, 1)
    b = book.EventBook()
    log_id, events, seq, gap = b.read(space, "", 0)
    assert (events, seq, gap) == ([], 0, False)
    for i in range(3):  # a decode step's block each: one event
        b.record(space, True, "CPU", "LOCAL", Keys.of([bytes([i]) * 32]))
    log_id, events, seq, _ = b.read(space, log_id, 0)
    assert [len(e.keys) for e in events] == [3] and seq == 1
    b.record(space, True, "CPU", "LOCAL", Keys.of([b"\x09" * 32]))  # not into the event read
    b.record(space, False, "CPU", "LOCAL", Keys.of([b"\x01" * 32]))  # another kind: another event
    _, events, seq, _ = b.read(space, log_id, seq)
    assert [(e.seq, e.stored, e.keys.as_bytes()) for e in events] == [
        (2, True, [b"\x09" * 32]), (3, False, [b"\x01" * 32])]
    # A log started again (its readers gone for IDLE_SECONDS) has another id: the reader is told.
    b._drop(space)
    new_id, events, seq, gap = b.read(space, log_id, seq)
    assert new_id != log_id and events == [] and gap is True and seq == 0
    _, events, _, gap = b.read(space, new_id, seq)
    assert events == [] and gap is False
