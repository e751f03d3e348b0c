"""KVServerConnector with a hybrid model (sliding-window and full-attention layers) under vLLM
0.33's hybrid KV cache manager: the KV cache groups, their block tables and the per-layer views
come from vLLM's own planner (``get_kv_cache_configs``) and its real Scheduler, the worker role
over those views in shared memory, a real daemon (tests/vllm_engine.py, ``window=``).

Layers 0 and 2 attend a window of WINDOW tokens, layers 1 and 3 everything. vLLM keeps a window
layer's blocks only for the last WINDOW - 1 tokens (the rest become its null block), so a window
group stores what it holds and a hit needs, in each window group, only the blocks below the hit
that vLLM keeps. Loads are asynchronous (vLLM takes a hybrid model's failed loads per request
only): the request waits in WAITING_FOR_REMOTE_KVS and is scheduled once its Gets ended.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import vllm_env
from conftest import DaemonThread

from kvserver.config import ServerConfig

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)

import vllm_engine  # noqa: E402
from vllm_engine import BLOCK, NULL_BLOCK, Engine, expected_kv, leases  # noqa: E402

WINDOW = 32  # tokens: vLLM keeps the last 2 blocks below a hit (cdiv(WINDOW - 1, BLOCK))
PROMPT = [(11 * i) % 400 + 5 for i in range(150)]  # 9 whole blocks before the last token
HIT = 144


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


@pytest.fixture(scope="module")
def server():
    with tempfile.TemporaryDirectory(prefix="kvs-vllm-hybrid-") as d:
        daemon = DaemonThread(ServerConfig(socket=os.path.join(d, "kv.sock"), host_memory=256 << 20))
        yield daemon
        daemon.stop()


@pytest.fixture(scope="module")
def vcfg(server):
    cfg = vllm_engine.config(server.address)
    cfg.model_config.max_model_len = cfg.scheduler_config.max_model_len = 256
    # The engines of this module have the 4 layers of HYBRID_LAYERS (vllm_env.model_dir()'s config
    # says 2): the model says so too, as a real hybrid model's does.
    cfg.model_config.model_arch_config.total_num_hidden_layers = len(vllm_engine.HYBRID_LAYERS)
    return cfg


@pytest.fixture()
def engines(vcfg, server):
    yield from vllm_engine.engines(vcfg, server.address, window=WINDOW, num_blocks=96)


def spaces(e: Engine) -> dict:
    """The daemon's Stats of each space of the engine's tenant, by name."""
    return {s.space.model: s for s in e.worker._worker.client.stats().spaces}


def until_running(e: Engine, rid: str, steps: int = 50) -> None:
    """Steps until ``rid`` has been scheduled to compute (its asynchronous load ended)."""
    for _ in range(steps):
        e.step()
        if rid in e.admitted:
            return
        time.sleep(0.002)
    raise AssertionError(f"{rid} never scheduled")


def window_blocks(e: Engine, rid: str) -> list[int]:
    return [b for b in e.block_ids(rid, e.group_of[e.layers[0]]) if b != NULL_BLOCK]


def store_prefix(engines, model: str, tokens=PROMPT, **kw) -> Engine:
    a = engines(model, **kw)
    a.add("a", tokens, max_tokens=1)
    a.run()
    assert a.finished_sending == {"a"}
    return a


# ---- the groups --------------------------------------------------------------------------------


def test_each_kv_cache_group_of_vllms_planner_is_a_space_of_its_own(engines, server):
    from kvclient.vllm._space import read_groups

    e = engines("hybrid-groups")
    groups = read_groups(e.config, e.kv_cache_config)
    kinds = {g.space.model: (g.window_blocks, g.layer_names) for g in groups}
    assert kinds == {
        "hybrid-groups#kv0-swa32": (2, vllm_engine.HYBRID_LAYERS[0::2]),
        "hybrid-groups#kv1-full": (None, vllm_engine.HYBRID_LAYERS[1::2]),
    }
    assert all(g.space.num_layers == 2 and g.local_ids for g in groups)
    # Each group registered by a client of its own, its layers numbered 0.. in its space.
    links = e.worker._worker.links
    got = [(link.registrar.registered, link.registrar.kwargs["model"], link.layer_ids) for link in links]
    assert got == [(True, "hybrid-groups#kv0-swa32", (0, 1)), (True, "hybrid-groups#kv1-full", (0, 1))]


# ---- hits --------------------------------------------------------------------------------------


def test_a_prefix_one_engine_computed_loads_in_another_bit_for_bit(engines, server):
    stats = spaces(store_prefix(engines, "hybrid-hit"))
    print({k: (v.complete_pages, v.counters) for k, v in stats.items()})
    # Every full block; of the window group every block the prefill computed (it holds them all
    # during the step that computes them), stored as they filled.
    assert stats["hybrid-hit#kv1-full"].complete_pages == 9
    assert stats["hybrid-hit#kv0-swa32"].complete_pages == 9
    b = engines("hybrid-hit")
    b.add("b", PROMPT + [9] * 20, max_tokens=2)
    until_running(b, "b")
    assert b.admitted["b"] == [HIT]  # the whole stored prefix, loaded before it was scheduled
    assert "b" in b.finished_recving and not b.failed_recving
    assert window_blocks(b, "b")[:2] == b.block_ids("b", 0)[7:9]  # the window: blocks 7 and 8
    # Full layers: all 144 positions; window layers: the 32 positions of blocks 7-8 (and what the
    # step computed since), bit for bit, as the stand-in model computes them.
    assert b.expect_kv("b", PROMPT + [9] * 20, HIT) == 2 * (2 * HIT + 2 * 32)
    b.run()
    assert leases(server) == 0


def store_pages(e: Engine, group: int, which: list[int], tokens=PROMPT) -> None:
    """Puts the model's own K/V of blocks ``which`` of ``tokens`` into group ``group``'s space,
    from the engine's blocks 1.. (any it does not use)."""
    from kvclient.vllm._meta import KVServerConnectorMetadata, SaveJob

    keys = [bytes(h) for h in vllm_env.request("x", tokens, block_size=BLOCK).block_hashes]
    w = e.worker._worker
    layers = [i for i, n in enumerate(e.layers) if e.group_of[n] == group]
    blocks = list(range(1, 1 + len(which)))
    for block, i in zip(blocks, which, strict=True):
        for layer in layers:
            for slot in range(BLOCK):
                for part in (0, 1):
                    e.kv(block, slot, layer, part).copy_(expected_kv(tokens, i * BLOCK + slot, layer, part))
    w.wait_for_save(KVServerConnectorMetadata(saves=[SaveJob("s", b"".join(keys[i] for i in which),
                                                             blocks, group=group)]))
    deadline = time.monotonic() + 5
    while w._inflight and time.monotonic() < deadline:
        time.sleep(0.01)


def test_no_whole_window_below_the_full_prefix_is_a_miss_for_every_group(engines, server):
    e = engines("hybrid-partial")

    def store(group: int, which: list[int]) -> None:
        store_pages(e, group, which)

    store(1, list(range(9)))  # every full-attention page of the prefix
    store(0, [8])  # of the window only its last block: the one below it (7) is missing
    b = engines("hybrid-partial")
    b.add("b", PROMPT, max_tokens=1)
    b.step()
    assert b.admitted["b"] == [0] and not b.finished_recving  # a miss: nothing loaded
    assert leases(server) == 0  # the full group's pin went with the miss
    b.run()
    c = engines("hybrid-partial")  # b computed and stored the window: now a hit of all 9 blocks
    c.add("c", PROMPT, max_tokens=4)
    until_running(c, "c")
    assert c.admitted["c"] == [HIT]
    c.expect_kv("c", PROMPT, HIT)
    c.run()


def test_a_window_missing_below_the_full_prefix_steps_the_hit_down(engines, server):
    e = engines("hybrid-down")
    store_pages(e, 1, list(range(9)))  # the full prefix: 9 blocks
    store_pages(e, 0, list(range(7)))  # the window's blocks 7 and 8 are missing
    b = engines("hybrid-down")
    b.add("b", PROMPT, max_tokens=4)
    until_running(b, "b")
    # Below 9 blocks, then 8, the window misses its block 7; below 7 it has blocks 5 and 6.
    assert b.admitted["b"] == [7 * BLOCK]
    b.expect_kv("b", PROMPT, 7 * BLOCK)
    b.run()
    assert leases(server) == 0


def test_a_model_of_windows_only_hits_a_stored_prefix_of_a_longer_prompt(engines, server):
    a = engines("hybrid-windows", windows_only=True)
    assert [g.kv_cache_spec.sliding_window for g in a.kv_cache_config.kv_cache_groups] == [WINDOW]
    a.add("a", PROMPT, max_tokens=1)
    a.run()
    b = engines("hybrid-windows", windows_only=True)
    tokens = PROMPT + [21] * 60  # the stored 9 blocks, then 3 more not stored
    b.add("b", tokens, max_tokens=4)
    until_running(b, "b")
    assert b.admitted["b"] == [HIT]
    b.expect_kv("b", tokens, HIT)
    b.run()
    assert leases(server) == 0


def test_a_local_hit_loads_only_the_rest_of_each_group(engines, server):
    store_prefix(engines, "hybrid-local", PROMPT[:100])  # 6 blocks stored
    b = engines("hybrid-local")
    b.add("b0", PROMPT[:40], max_tokens=1)  # vLLM's own cache: blocks 0-1 (window blocks 0-1)
    b.run()
    b.add("b", PROMPT, max_tokens=4)
    until_running(b, "b")
    assert b.admitted["b"] == [96]  # 32 local + 64 loaded
    b.expect_kv("b", PROMPT, 96)
    b.run()


# ---- faults ------------------------------------------------------------------------------------


def test_a_failed_load_is_recomputed_whole_and_never_stored(engines, daemon_factory):
    d = daemon_factory(host_memory=64 << 20)
    store_prefix(engines, "hybrid-fail", address=d.address)

    def evict(engine, so):
        if any(job.req_id == "b" for job in so.kv_connector_metadata.loads):
            d.run(lambda: d.core.cache.evict_all())  # every unpinned page goes

    tokens = PROMPT[:64] + [13] * 40
    b = engines("hybrid-fail", address=d.address, settings={"lookup_pin_ms": 0}, before_load=evict)
    b.add("b", tokens, max_tokens=1)
    until_running(b, "b")
    assert b.failed_recving == {"b"} and b.admitted["b"] == [0]  # recomputed from the start
    b.run()
    c = engines("hybrid-fail", address=d.address)  # what b stored is what it computed again
    c.add("c", tokens + [3] * 8, max_tokens=4)
    until_running(c, "c")
    assert c.admitted["c"] == [96]
    c.expect_kv("c", tokens + [3] * 8, 96)
    c.run()


def test_a_window_block_given_out_again_is_read_by_its_queued_put_first(engines, vcfg, monkeypatch):
    # vLLM frees a window's blocks while their request runs (chunked prefill: a chunk's blocks
    # fall below the next chunk's window) and hands them out again. Puts made slow: without the
    # workers' wait (KVServerConnectorMetadata.reused), a queued Put reads a block after the next
    # forward wrote other K/V into it, and stores it under the old key.
    monkeypatch.setattr(vcfg.scheduler_config, "async_scheduling", False)
    e = engines("hybrid-reuse", num_blocks=20)  # vLLM's planner makes it a pool of 40 blocks
    w = e.worker._worker
    put = w.links[0].client.put
    overlaps: list[int] = []  # per step: queued Puts reading a block the step gives out again
    flush = w._flush_reused

    def watched(reused: set[int]) -> None:
        with w._lock:
            overlaps.append(sum(not reused.isdisjoint(job.block_ids) for job in w._inflight.values()))
        flush(reused)

    w._flush_reused = watched

    def slow_put(*args, **kwargs):
        time.sleep(0.15)
        return put(*args, **kwargs)

    w.links[0].client.put = slow_put
    tokens = PROMPT + [17] * 30  # 180 tokens: chunks of 64, each freeing the window below it
    e.add("a", tokens, max_tokens=1)
    e.add("z", [t + 1 for t in tokens[:100]], max_tokens=1)  # takes the freed blocks
    e.run(timeout=60)
    assert any(overlaps)  # the hazard happened
    # Every stored window page is the model's: probe k hits k blocks and loads (or finds in
    # vLLM's own cache, from probe k - 1) the window below them, blocks k - 2 and k - 1.
    c = engines("hybrid-reuse")
    for k in range(2, 12):
        probe = tokens[:k * BLOCK] + [4] * 4
        c.add(f"c{k}", probe, max_tokens=4)
        until_running(c, f"c{k}")
        assert c.admitted[f"c{k}"] == [k * BLOCK]
        c.expect_kv(f"c{k}", probe, k * BLOCK)
        c.run()


def test_a_request_aborted_while_its_load_runs_keeps_its_blocks_until_the_load_ended(engines, monkeypatch):
    # Preempted after it stored blocks (so it once had Puts), it resumes with an asynchronous
    # load of its own prefix, and is aborted while that load still writes its blocks: vLLM must
    # hold them until the workers report the load, never free them at a report of its Puts.
    from vllm.v1.request import RequestStatus

    from kvclient.load_handle import LoadHandle

    e = engines("hybrid-abort")
    e.add("a", PROMPT, max_tokens=60)
    for _ in range(6):
        e.step()
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts it
    held = {"on": True}
    ended = LoadHandle.ended
    monkeypatch.setattr(LoadHandle, "ended", lambda self: False if held["on"] else ended(self))
    so = e.step()
    assert {job.req_id for job in so.kv_connector_metadata.loads} == {"a"}
    e.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        e.step()
    assert "a" in e.scheduler.requests and "a" not in e.finished_sending  # its blocks still held
    held["on"] = False
    for _ in range(50):
        if "a" not in e.scheduler.requests:
            break
        time.sleep(0.005)
        e.step()
    assert "a" in e.finished_recving and "a" not in e.scheduler.requests  # freed once it ended
    assert not e.worker._worker._async and not e.connector._scheduler._async_loading


def test_a_failed_asynchronous_load_is_not_tried_again(engines):
    store_prefix(engines, "hybrid-retry")
    b = engines("hybrid-retry")

    def refused(*args, **kwargs):
        raise RuntimeError("get refused")

    for link in b.worker._worker.links:
        link.client.get = link.client.get_parts = refused
    b.add("b", PROMPT, max_tokens=1)
    loads = 0
    for _ in range(30):
        so = b.step()
        loads += len({job.req_id for job in so.kv_connector_metadata.loads})
        if "b" in b.admitted:
            break
    assert loads == 1 and b.failed_recving == {"b"}
    assert b.admitted["b"] == [0]  # computed from its start, as after a failed synchronous load
    b.run()


def test_blocks_a_step_only_reads_are_not_waited_for(engines):
    e = engines("hybrid-reads")
    e.add("a", PROMPT[:80], max_tokens=1)
    e.run()
    e.add("b", PROMPT[:80] + [3] * 20, max_tokens=1)
    so = e.step()  # vLLM's own cache: 4 blocks of a; the daemon's: a fifth, loaded
    loaded = {b for job in so.kv_connector_metadata.loads for b in job.block_ids}
    assert loaded and so.kv_connector_metadata.reused == loaded
    for _ in range(50):
        so = e.step()
        if "b" in so.num_scheduled_tokens:
            break
        time.sleep(0.002)
    assert e.admitted["b"] == [80]
    read = {b for g in range(2) for b in e.block_ids("b", g)[:5]} - {NULL_BLOCK}  # hit and loaded
    written = {b for g in range(2) for b in e.block_ids("b", g)[5:]} - {NULL_BLOCK}
    assert so.kv_connector_metadata.reused == written and not read & written
    e.run()
