"""The vLLM connector's KV events: with vLLM's KV events on, every page of the engine's space that
the node's cache gains or loses (another engine's stores, evictions it did not cause) reaches the
engine's own publisher as vLLM's BlockStored / BlockRemoved with the engine's block hashes, medium
CPU and locality LOCAL, and a subscriber decodes them with vLLM's KVEventBatch. vLLM 0.33.0's real
Scheduler and publisher, a real daemon. Skipped where scripts/install_vllm.sh has not run."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import vllm_env
import zmq

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)

import vllm_engine  # noqa: E402
from cache_engine import CacheEngine  # noqa: E402
from mooncake_master import free_port  # noqa: E402

PROMPT = [(11 * i) % 500 + 5 for i in range(70)]  # 4 whole blocks


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


@pytest.fixture()
def daemon(daemon_factory):
    return daemon_factory(host_memory=24 << 20)


@pytest.fixture()
def vcfg(daemon):
    return vllm_engine.config(daemon.address)


def wait_connected(monitor, timeout: float = 10) -> None:
    from zmq.utils.monitor import recv_monitor_message

    assert monitor.poll(int(timeout * 1000)), "vLLM's publisher never connected"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED


def wait_subscribed(publisher, sub, timeout: float = 10) -> None:
    """ZMQ's slow joiner: a PUB drops what it sends until the SUB's subscription has reached it,
    which may be after the handshake (a loaded machine). Empty batches go out through vLLM's
    publisher until one arrives; those still on their way decode to no events."""
    from vllm.distributed.kv_events import KVEventBatch

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        if sub.poll(50):
            while sub.poll(0):
                sub.recv_multipart()
            return
    raise AssertionError("nothing vLLM's publisher sent reached the subscriber")


def test_the_connector_publishes_the_node_caches_events_through_vllms_publisher(vcfg, daemon):
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvclient.vllm._space import block_keys

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")  # vLLM's publisher connects to an address without '*'
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    gen = vllm_engine.engines(vcfg, daemon.address)
    make = next(gen)
    try:
        vcfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                               endpoint=f"tcp://127.0.0.1:{port}", topic="engine-a")
        try:
            a = make("events", settings={"events_interval_ms": 20})
        finally:
            vcfg.kv_events_config = None
        feed = a.connector._scheduler.events
        assert feed is not None
        deadline = time.monotonic() + 10  # the feed's first read starts the space's log
        while not all(log_id for log_id, _ in feed._where) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(log_id for log_id, _ in feed._where), "the feed never read the daemon's events"
        wait_connected(monitor)  # vLLM's publisher has connected
        wait_subscribed(a.scheduler.kv_event_publisher, sub)  # and nothing it sends is lost
        b = make("events")  # another engine of the same model, its events off
        b.add("b1", PROMPT, max_tokens=1)
        keys = block_keys(b.scheduler.requests["b1"], 1)
        expected = {maybe_convert_block_hash(k) for k in keys}
        assert len(expected) == 4
        b.run()

        def stored() -> int:
            return daemon.run(lambda: sum(s.counters.pages for s in daemon.core.cache._spaces.values()
                                          if s.key.model == "events"))

        deadline = time.monotonic() + 10
        while stored() < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stored() >= 4, f"engine B's blocks were not stored ({stored()} pages)"

        def heard(kind, medium: str = "CPU") -> set:
            got: set = set()
            deadline = time.monotonic() + 10
            while got != expected and time.monotonic() < deadline:
                a.step()  # each step of engine A publishes what its connector heard
                while sub.poll(50):
                    _, _, payload = sub.recv_multipart()
                    for ev in decode(payload).events:
                        if isinstance(ev, kind) and ev.medium == medium:
                            assert ev.locality == "LOCAL" and ev.group_idx == 0
                            got |= set(ev.block_hashes) & expected
            return got

        got = heard(BlockStored)
        assert got == expected, (f"heard {len(got)} of B's blocks; the feed: read to {feed._where}, "
                                 f"{feed.gaps} gaps, {feed.dropped_keys} keys dropped")  # under A's identity
        # Another model's pages of the same size fill host memory: the least recently used of
        # that size go first, B's among them (evictions engine A did not cause).
        page = daemon.run(lambda: next(p.key.page_bytes for s in daemon.core.cache._spaces.values()
                                       if s.key.model == "events" for p in s.parts.values()))
        with CacheEngine(daemon.address, pages=128, model="filler", page_size=page // 512, end=1,
                         num_layers=1) as filler:
            assert filler.page_bytes == page
            for i in range(0, (24 << 20) // page + 256, 128):
                ks = [f"fill-{j:06d}".encode() for j in range(i, i + 128)]
                filler.fill(ks, np.arange(128))
                filler.put(ks, np.arange(128))
        assert heard(BlockRemoved) == expected
        assert feed.dropped_keys == 0
    finally:
        gen.close()
        ctx.destroy(linger=0)
