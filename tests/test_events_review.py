"""The daemon's own KV event publisher (--kv-events-endpoint) under load and across restarts, read
by real ZMQ subscribers and decoded with vLLM's own KVEventBatch classes: a record larger than the
queue's bound is published whole; records dropped for a full queue are logged, counted in the
metrics and void their space's view with AllBlocksCleared, after what came before them; a
restarted daemon voids each space before its first batch; batches are bounded in bytes, so the
sockets' high-water marks bound memory; a replay answer streams to its peer as it reads, whole and
in order, and silent peers cost bounded memory; one sequence numbers the whole stream."""

from __future__ import annotations

import gc
import logging
import os
import time
import urllib.request
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import vllm_env
import zmq
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE, CacheEngine
from mooncake_master import free_port
from prometheus_client.parser import text_string_to_metric_families

from kvserver.events import publisher
from kvserver.events.publisher import ZmqPublisher, space_topic
from kvserver.protocol.layout import dtype_named
from kvserver.store import Keys, SpaceKey

MiB = 1 << 20
END = (-1).to_bytes(8, "big", signed=True)
A = SpaceKey("tenantA", MODEL, LAYOUT, dtype_named(str(DTYPE)), PAGE, 4, 1, 1)
B = SpaceKey("tenantB", MODEL, LAYOUT, dtype_named(str(DTYPE)), PAGE, 4, 1, 1)
TOPIC_A, TOPIC_B = space_topic(A).encode(), space_topic(B).encode()


@pytest.fixture
def vllm_classes():
    if not vllm_env.vllm_installed():
        pytest.skip("vllm not installed (scripts/install_vllm.sh)")
    vllm_env.setup()
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    yield KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
    vllm_env.restore()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def key(tag: int, i: int) -> bytes:
    """A 32-byte key whose vLLM int block hash (its low 64 bits) is ``tag << 32 | i``."""
    return bytes(24) + ((tag << 32) | i).to_bytes(8, "big")


def hashes(tag: int, ids) -> set[int]:
    return {(tag << 32) | i for i in ids}


def keys(tag: int, ids) -> Keys:
    return Keys.of([key(tag, i) for i in ids])


def subscriber(ctx: zmq.Context, endpoint: str, prefix: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, prefix)
    time.sleep(0.3)  # the subscription reaches the publisher
    return sub


class Router:
    """What a router following the stream believes, per topic, applying vLLM's events in order
    (AllBlocksCleared drops what it knew of the topic); ``frames`` as received."""

    def __init__(self, sub: zmq.Socket, classes) -> None:
        self.sub = sub
        self.batch, self.stored, self.removed, self.cleared = classes
        self.decode = msgspec.msgpack.Decoder(type=self.batch).decode
        self.frames: list[tuple[bytes, int, bytes]] = []
        self.view: dict[bytes, set] = {}
        self.events: list[tuple[bytes, int, object]] = []  # (topic, seq, event)

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.frames.append((topic, seq, payload))
        view = self.view.setdefault(topic, set())
        for ev in self.decode(payload).events:
            self.events.append((topic, seq, ev))
            if isinstance(ev, self.cleared):
                view.clear()
            elif isinstance(ev, self.stored):
                view |= set(ev.block_hashes)
            else:
                assert isinstance(ev, self.removed)
                view -= set(ev.block_hashes)

    def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not done in {timeout} s: {self.view}"
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                self.apply(topic, int.from_bytes(seq, "big"), payload)

    def kinds(self, topic: bytes) -> list[str]:
        return [type(ev).__name__ for t, _, ev in self.events if t == topic]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def store(eng: CacheEngine, ks: list[bytes]) -> None:
    eng.fill(ks, np.arange(len(ks)))
    r = eng.put(ks, np.arange(len(ks)))
    assert r.stored + r.present == len(ks)


def test_a_record_larger_than_the_queue_bound_is_published_whole(monkeypatch, ctx, vllm_classes):
    monkeypatch.setattr(publisher, "MAX_QUEUED_KEYS", 1000)
    p = ZmqPublisher("tcp://127.0.0.1:0")
    try:
        router = Router(subscriber(ctx, p.endpoint), vllm_classes)
        p.record(A, True, "CPU", "LOCAL", keys(1, range(5000)), time.time())  # into an empty queue
        router.until(lambda: router.view.get(TOPIC_A) == hashes(1, range(5000)), timeout=5)
        assert p.dropped == 0
    finally:
        p.close()


def test_dropped_records_void_their_space_after_what_came_before(monkeypatch, ctx, caplog, vllm_classes):
    caplog.set_level(logging.WARNING, logger="kvserver.events.publisher")
    monkeypatch.setattr(publisher, "MAX_QUEUED_KEYS", 3)
    p = ZmqPublisher("tcp://127.0.0.1:0", start=False)  # records wait until start(): a full queue
    try:
        router = Router(subscriber(ctx, p.endpoint), vllm_classes)
        p.record(A, True, "CPU", "LOCAL", keys(1, [1, 2]), time.time())  # queued
        p.record(A, True, "CPU", "LOCAL", keys(1, [3, 4]), time.time())  # queued: 2 keys wait
        p.record(A, False, "CPU", "LOCAL", keys(1, [1]), time.time())  # dropped: 4 keys wait
        p.record(A, False, "CPU", "LOCAL", keys(1, [2]), time.time())  # dropped
        p.record(B, True, "CPU", "LOCAL", keys(2, [1]), time.time())  # dropped
        assert (p.dropped, p.dropped_keys) == (3, 3)
        p.start()
        router.until(lambda: "AllBlocksCleared" in router.kinds(TOPIC_A)
                     and "AllBlocksCleared" in router.kinds(TOPIC_B))
        # Hashes 1 and 2 of A were removed unseen: the router must not keep them. It knew of the
        # stores before the drop only to forget them with everything else of A.
        assert router.view[TOPIC_A] <= hashes(1, [3, 4]) and router.view[TOPIC_B] == set()
        # The queue has room again: what comes now is published as ever, after the clear.
        p.record(A, True, "CPU", "LOCAL", keys(1, [5]), time.time())
        router.until(lambda: hashes(1, [5]) <= router.view[TOPIC_A])
        assert router.kinds(TOPIC_A)[-1] == "BlockStored" and router.view[TOPIC_A] <= hashes(1, [3, 4, 5])
        deadline = time.monotonic() + 5  # logged once the burst is over, with its count
        while not any("3 records" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
        warned = [r for r in caplog.records if r.name == "kvserver.events.publisher"]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    finally:
        p.close()


def test_a_daemon_whose_publisher_drops_says_so_in_its_log_metrics_and_stream(
        daemon_factory, monkeypatch, ctx, caplog, vllm_classes):
    caplog.set_level(logging.WARNING, logger="kvserver.events.publisher")
    monkeypatch.setattr(publisher, "MAX_QUEUED_KEYS", 0)  # every record finds the queue full
    pub = free_port()
    d = daemon_factory(host_memory=24 * MiB, kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                       metrics_listen="127.0.0.1:0")
    router = Router(subscriber(ctx, f"tcp://127.0.0.1:{pub}", b"kvserver/"), vllm_classes)
    with CacheEngine(d.address, pages=128) as eng:
        store(eng, [key(7, i) for i in range(40)])
        space = d.run(lambda: next(s.key for s in d.core.cache._spaces.values() if s.key.model == MODEL))
    topic = space_topic(space).encode()
    router.until(lambda: "AllBlocksCleared" in router.kinds(topic))
    assert router.view[topic] == set()
    assert scrape(d.daemon.metrics.port)["kvserver_kv_events_dropped_keys_total"] == 40
    deadline = time.monotonic() + 5
    while not any(r.levelno == logging.WARNING and "dropped" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no warning"
        time.sleep(0.1)


def test_a_daemon_without_a_publisher_exports_no_drop_count(daemon_factory):
    d = daemon_factory(host_memory=24 * MiB, metrics_listen="127.0.0.1:0")
    assert "kvserver_kv_events_dropped_keys_total" not in scrape(d.daemon.metrics.port)


def test_a_restarted_daemon_voids_each_space_before_its_first_batch(daemon_factory, ctx, vllm_classes):
    pub = free_port()
    endpoint = f"tcp://127.0.0.1:{pub}"
    router = Router(subscriber(ctx, endpoint, b"kvserver/"), vllm_classes)
    d = daemon_factory(host_memory=24 * MiB, kv_events_endpoint=endpoint)
    time.sleep(0.5)  # the subscriber reconnects to the daemon
    old = [key(8, i) for i in range(30)]
    with CacheEngine(d.address, pages=128) as eng:
        store(eng, old)
        space = d.run(lambda: next(s.key for s in d.core.cache._spaces.values() if s.key.model == MODEL))
    topic = space_topic(space).encode()
    router.until(lambda: router.view.get(topic) == hashes(8, range(30)))
    assert router.kinds(topic)[0] == "AllBlocksCleared"
    d.stop()  # without --host-memory-dir every page goes with it, unannounced
    d2 = daemon_factory(host_memory=24 * MiB, kv_events_endpoint=endpoint)
    time.sleep(0.5)  # the subscriber reconnects to the new daemon
    seen = len(router.frames)
    with CacheEngine(d2.address, pages=128) as eng:
        store(eng, [key(9, i) for i in range(10)])
    router.until(lambda: hashes(9, range(10)) <= router.view[topic])
    first = router.frames[seen]
    assert first[1] == 1, "the new daemon's stream starts its sequence over"
    assert router.view[topic] == hashes(9, range(10)), "no page of the old daemon is claimed"


@pytest.mark.parametrize("int_hashes", [True, False])
def test_batches_are_bounded_in_bytes(int_hashes, ctx, vllm_classes):
    p = ZmqPublisher("tcp://127.0.0.1:0", int_hashes=int_hashes)
    try:
        router = Router(subscriber(ctx, p.endpoint), vllm_classes)
        n = 40_000 if int_hashes else 8000
        p.record(A, True, "CPU", "LOCAL", keys(3, range(n)), time.time())
        want = hashes(3, range(n)) if int_hashes else {key(3, i) for i in range(n)}
        router.until(lambda: router.view.get(TOPIC_A) == want)
        sizes = [len(payload) for _, _, payload in router.frames]
        # 64 KiB of block hashes at most (so 1,024 batches queued for a stalled subscriber are
        # 64 MiB at most), and the batch's own framing
        assert len(sizes) > 1 and max(sizes) <= (64 << 10) + 1024, sizes
    finally:
        p.close()


def rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def wait_sent(p: ZmqPublisher) -> None:
    """Until the publisher sent everything recorded (its count still for half a second)."""
    last, still = -1, time.monotonic()
    while time.monotonic() - still < 0.5:
        if p.sent != last:
            last, still = p.sent, time.monotonic()
        time.sleep(0.05)


def test_silent_replay_peers_cost_bounded_memory(ctx):
    p = ZmqPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", int_hashes=False)
    try:
        for i in range(12):  # about 40 MB of batches kept for replay
            packed = os.urandom(32 * 100_000)
            p.record(A, bool(i % 2), "CPU", "LOCAL", Keys.unpack(packed, 32, 100_000), time.time())
            del packed
        wait_sent(p)
        gc.collect()
        base = rss_mib()
        peers = []
        for _ in range(6):  # each asks for everything, twice, and never reads
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 4096)
            d.connect(p.replay_endpoint)
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            peers.append(d)
        time.sleep(2.0)
        grown = rss_mib() - base
        # Before: a copy of the whole replay buffer queued per request (480 MB here).
        assert grown < 120, f"{grown} MiB for 6 silent peers"
    finally:
        p.close()


def replay(ctx: zmq.Context, endpoint: str, start: int, delay: float = 0.0,
           times: int = 1) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol from a DEALER that reads slowly (``delay`` per batch): the batches
    of ``times`` requests from ``start``, all sent before reading, each answer up to its end."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVHWM, 4)
    d.connect(endpoint)
    for _ in range(times):
        d.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        for _ in range(times):
            while True:
                assert d.poll(5000), f"no end of the replay after {len(out)} batches"
                _, topic, seq, payload = d.recv_multipart()
                if seq == END:
                    assert topic == b"" and payload == b""
                    break
                out.append((topic, int.from_bytes(seq, "big"), payload))
                time.sleep(delay)
        return out
    finally:
        d.close(linger=0)


def test_a_replay_longer_than_the_peers_queue_arrives_whole_and_in_order(ctx):
    p = ZmqPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", int_hashes=False)
    try:
        packed = os.urandom(32 * 300_000)  # batches of about 1,000 keys: 300 and more
        p.record(A, True, "CPU", "LOCAL", Keys.unpack(packed, 32, 300_000), time.time())
        wait_sent(p)
        sent = p.sent
        got = replay(ctx, p.replay_endpoint, 0, delay=0.002)
        assert [s for _, s, _ in got] == list(range(1, sent + 1))
        assert {t for t, _, _ in got} == {TOPIC_A}
        middle = max(1, sent - 5)
        got = replay(ctx, p.replay_endpoint, middle)  # from the middle: the rest
        assert [s for _, s, _ in got] == list(range(middle, sent + 1))
        # A peer that asks again before it read the first answer gets both, one after the other.
        got = replay(ctx, p.replay_endpoint, 1, times=2)
        assert [s for _, s, _ in got] == list(range(1, sent + 1)) * 2
    finally:
        p.close()


def test_one_sequence_numbers_the_whole_stream_and_replays_carry_each_batchs_topic(ctx, vllm_classes):
    """A subscriber that finds gaps and asks for replays subscribes to the whole stream and keeps
    the topics it wants by the topic frame (docs/integrations.md)."""
    p = ZmqPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        router = Router(subscriber(ctx, p.endpoint, b"kvserver/"), vllm_classes)
        for step in range(3):  # A and B in turn, a batch each
            p.record(A, True, "CPU", "LOCAL", keys(0xA, [step]), time.time())
            time.sleep(0.12)
            p.record(B, True, "CPU", "LOCAL", keys(0xB, [step]), time.time())
            time.sleep(0.12)
        router.until(lambda: len(router.frames) == 6)
        assert [s for _, s, _ in router.frames] == list(range(1, 7)), "no gap in the whole stream"
        got = replay(ctx, p.replay_endpoint, 1)
        assert [(t, s) for t, s, _ in got] == [(t, s) for t, s, _ in router.frames]
        only_a = Router(None, vllm_classes)
        for t, s, payload in got:
            if t == TOPIC_A:
                only_a.apply(t, s, payload)
        assert only_a.view == {TOPIC_A: hashes(0xA, range(3))}
    finally:
        p.close()
