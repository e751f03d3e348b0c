"""The vLLM connector's worker side (kvclient.vllm._worker.WorkerSide, what KVServerConnector runs
in vLLM's worker processes) over every KV cache layout vLLM 0.33 ships, MHA and MLA: per-layer
views built by vLLM's own ``create_kv_cache_views`` in shared memory, registered as they lie;
blocks stored from one layout and loaded into another, bit for bit, each layer in place when its
wait returns; a Get that finds only a prefix reports the rest. Real daemon; skipped without vLLM.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
import vllm_env

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)

from kvserver.protocol.layout import KVLayout  # noqa: E402

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
BLOCKS = 12
SENTINEL = -7.0


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


def spec(kind: str):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if kind == "mha":
        return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.float16)


def space(kind: str):
    from kvclient.vllm._space import Space

    layout = KVLayout.mha(2, 16) if kind == "mha" else KVLayout.mla(32, 16)
    return Space(model=f"worker-{kind}", layout=layout, dtype=torch.float16, page_size=16,
                 num_layers=len(NAMES), tp_size=1, pp_size=1, hash_stride=1)


def views(kind: str, layout_name: str):
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvclient.views_pool import SharedKVMemory

    s = spec(kind)
    strides = compute_layout_strides(s, BLOCKS, len(NAMES), KVCacheLayout[layout_name])
    tensor = KVCacheTensor(size=s.page_size_bytes * BLOCKS * len(NAMES), layers=list(NAMES),
                           layer_stride=strides[0], block_stride=strides[1])
    mem = SharedKVMemory(tensor.size)
    return mem, list(create_kv_cache_views(mem.tensor.view(torch.int8), s, BLOCKS, KVCacheLayout[layout_name],
                                           tensor))


def keys(n: int, salt: str) -> bytes:
    out, h = b"", b""
    for i in range(n):
        h = hashlib.sha256(h + f"{salt}:{i}".encode()).digest()
        out += h
    return out


def worker(kind: str, address: str, layout_name: str):
    from kvclient.vllm._worker import WorkerSide

    mem, vs = views(kind, layout_name)
    w = WorkerSide(space(kind), {"address": address}, True)
    w.register_kv_caches(dict(zip(NAMES, vs, strict=True)))
    return w, mem, vs


def wait_finished(w, req_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = w.get_finished({req_id})
        if done == {req_id}:
            return
        time.sleep(0.01)
    raise AssertionError(f"{req_id}'s Puts did not finish")


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("src,dst", list(zip(LAYOUTS, LAYOUTS[1:] + LAYOUTS[:1], strict=True)))
def test_blocks_stored_in_one_layout_load_into_another_layer_by_layer(daemon, kind, src, dst):
    from kvclient.vllm._meta import KVServerConnectorMetadata, LoadJob, SaveJob

    a, mem_a, va = worker(kind, daemon.address, src)
    b, mem_b, vb = worker(kind, daemon.address, dst)
    try:
        g = torch.Generator().manual_seed(hash((kind, src)) & 0xFFFF)
        for v in va:
            v.copy_(torch.randint(0, 2000, v.shape, generator=g).to(torch.float16))
        for v in vb:
            v.fill_(SENTINEL)
        stored = [3, 7, 1, 9, 0]
        a.wait_for_save(KVServerConnectorMetadata(saves=[SaveJob("r", keys(5, src), stored)]))
        wait_finished(a, "r")

        target = [10, 2, 5, 11, 4, 6]  # the sixth key was never stored
        b.start_load_kv(KVServerConnectorMetadata(loads=[LoadJob("q", keys(5, src) + keys(6, "never")[-32:],
                                                                 target)]))
        for layer, name in enumerate(NAMES):
            b.wait_for_layer_load(name)
            for s_blk, d_blk in zip(stored, target, strict=False):
                assert torch.equal(vb[layer][d_blk], va[layer][s_blk]), (layer, s_blk, d_blk)
        assert b.load_errors() == {6}  # past the stored prefix: vLLM recomputes it
        assert bool((vb[0][6] == SENTINEL).all()) and bool((vb[2][8] == SENTINEL).all())
    finally:
        for w in (a, b):
            w.shutdown()
        mem_a.close()
        mem_b.close()


def test_a_load_without_a_daemon_reports_every_block(tmp_path):
    from kvclient.vllm._meta import KVServerConnectorMetadata, LoadJob

    w, mem, _ = worker("mha", f"unix://{tmp_path}/none.sock", "LBNHC")
    try:
        w.start_load_kv(KVServerConnectorMetadata(loads=[LoadJob("q", keys(3, "x"), [4, 5, 6])]))
        for name in NAMES:
            w.wait_for_layer_load(name)
        assert w.load_errors() == {4, 5, 6}
        assert w.load_errors() == set()  # reported once
    finally:
        w.shutdown()
        mem.close()


def test_registration_refuses_what_vllm_would_not_give(daemon):
    from kvclient.vllm._worker import WorkerSide

    mem, vs = views("mha", "LBNHC")
    try:
        w = WorkerSide(space("mha"), {"address": daemon.address}, True)
        with pytest.raises(ValueError, match="contiguous range"):
            w.register_kv_caches({NAMES[0]: vs[0], NAMES[2]: vs[2]})
        with pytest.raises(ValueError, match="a 3D KV cache"):
            w.register_kv_caches({NAMES[0]: vs[0][0]})
        w.shutdown()
    finally:
        mem.close()


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_a_lookup_counts_a_block_once_every_tp_rank_and_pp_stage_holds_it(daemon, split):
    # Two workers of one engine (TP ranks 0 and 1 of 2, or PP stages over layers [0, 2) and [2, 3)),
    # and the scheduler's lookup, which answers for the whole space.
    from kvclient.vllm._meta import KVServerConnectorMetadata, SaveJob
    from kvclient.vllm._scheduler import SchedulerSide
    from kvclient.vllm._space import Space
    from kvclient.vllm._worker import WorkerSide

    base = space("mha")
    sp = Space(**{**base.__dict__, "model": f"split-{split}", "tp_size": 2 if split == "tp" else 1,
                  "pp_size": 2 if split == "pp" else 1})
    workers, mems = [], []
    for rank in (0, 1):
        mem, vs = views("mha", "LBNHC")
        mems.append(mem)
        cfg = {"address": daemon.address, "tp_rank": rank if split == "tp" else 0,
               "pp_rank": rank if split == "pp" else 0}
        w = WorkerSide(sp, cfg, True)
        layers = list(zip(NAMES, vs, strict=True))
        if split == "pp":
            layers = layers[:2] if rank == 0 else layers[2:]
        w.register_kv_caches(dict(layers))
        workers.append(w)
    sched = SchedulerSide(sp, {"address": daemon.address}, True, lambda rid: ([],))
    req = vllm_env.request("r", list(range(1, 82)), block_size=16)  # 5 whole blocks
    try:
        def matched() -> int:
            n, _ = sched.get_num_new_matched_tokens(req, 0)
            return n

        assert matched() == 0
        block_keys = b"".join(bytes(h) for h in req.block_hashes[:5])
        first = KVServerConnectorMetadata(saves=[SaveJob("r", block_keys, [0, 1, 2, 3, 4])])
        workers[0].wait_for_save(first)
        wait_finished(workers[0], "r")
        assert matched() == 0  # one rank's (or stage's) part is not the whole block
        second = KVServerConnectorMetadata(saves=[SaveJob("r", block_keys[:3 * 32], [5, 6, 7])])
        workers[1].wait_for_save(second)
        wait_finished(workers[1], "r")
        assert matched() == 3 * 16  # complete for the first three blocks only
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()
        for m in mems:
            m.close()


def test_shutdown_unregisters_at_once(daemon):
    w, mem, _ = worker("mha", daemon.address, "LBHNC")
    try:
        assert daemon.run(lambda: len(daemon.core.clients)) == 1
        w.shutdown()  # the engine's exit: its pool is let go now, not when its session times out
        assert daemon.run(lambda: len(daemon.core.clients)) == 0
    finally:
        mem.close()


def test_a_finished_request_is_reported_only_once_its_puts_ran(daemon):
    # Under speculative decoding vLLM calls get_finished before wait_for_save; a request that
    # finished with its last Put in the same step's metadata must not be reported before it ran.
    from kvclient.vllm._meta import KVServerConnectorMetadata, SaveJob

    w, mem, _ = worker("mha", daemon.address, "LBNHC")
    try:
        meta = KVServerConnectorMetadata(saves=[SaveJob("r", keys(2, "spec"), [1, 2])])
        w.bind(meta)  # the connector's bind_connector_metadata
        assert w.get_finished({"r"}) == (None, None)  # its Put has not even been queued
        w.wait_for_save(meta)
        wait_finished(w, "r")
    finally:
        w.shutdown()
        mem.close()


def test_lookups_back_off_while_the_daemon_is_away(tmp_path):
    from kvclient.vllm._scheduler import SchedulerSide

    sched = SchedulerSide(space("mha"), {"address": f"unix://{tmp_path}/none.sock"}, True, lambda rid: ([],))
    req = vllm_env.request("r", list(range(1, 82)), block_size=16)
    try:
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        asked = sched.view.misses
        assert asked >= 1
        for _ in range(20):  # a scheduler's steps: none waits on the daemon again for a while
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.view.misses == asked
    finally:
        sched.shutdown()


def test_block_keys_read_only_the_blocks_asked_for():
    from kvclient.vllm._space import block_keys, hashed_blocks

    req = vllm_env.request("k", list(range(1, 82)), block_size=16)  # 5 whole blocks, 81 tokens
    hashes = [bytes(h) for h in req.block_hashes]
    assert hashed_blocks(req, 1) == 5
    assert block_keys(req, 1) == hashes
    assert block_keys(req, 1, 4, start=2) == hashes[2:4]
    assert block_keys(req, 1, 9, start=5) == []
    # a block of two hash units is named by its second: the chain up to the block's end
    assert block_keys(req, 2) == [hashes[1], hashes[3]]


@pytest.mark.parametrize("landed", [True, False])
def test_a_load_reported_after_its_request_finished_resolves_the_requests_that_read_it(daemon, landed):
    """vLLM frees a finished request before it hands the connector the step's report. A request x
    that hit v's unreported blocks in vLLM's own prefix cache waits for that report, even when v
    finished first: a good load lets x store; a failed one stops x's stores at the shared blocks,
    and marks x's own blocks (computed on them) for any later request that hits them."""
    from types import SimpleNamespace

    from kvclient.vllm._meta import KVServerConnectorMetadata, KVServerWorkerMeta, SaveJob
    from kvclient.vllm._scheduler import SchedulerSide

    w, mem, _ = worker("mha", daemon.address, "LBHNC")
    tokens = list(range(1, 71))  # 4 whole blocks before the last token
    v = vllm_env.request("v", tokens, block_size=16)
    x = vllm_env.request("x", tokens[:64] + [900 + i for i in range(30)], block_size=16)
    blocks = {"v": [0, 1, 2, 3, 4], "x": [0, 1, 2, 3, 5, 6]}  # x shares v's first four
    sched = SchedulerSide(space("mha"), {"address": daemon.address}, True, lambda rid: (blocks[rid],))

    def alloc(req, external: int):
        ids = blocks[req.request_id]
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), external)

    def x_saves(computed: int) -> list:
        x.num_computed_tokens = computed
        step = SimpleNamespace(num_scheduled_tokens={"x": 0}, preempted_req_ids=set())
        return [j for j in sched.build_connector_meta(step).saves if j.req_id == "x"]

    try:
        stored = b"".join(bytes(h) for h in v.block_hashes[:4])
        w.wait_for_save(KVServerConnectorMetadata(saves=[SaveJob("s", stored, [7, 8, 9, 10])]))
        wait_finished(w, "s")
        assert sched.get_num_new_matched_tokens(v, 0) == (64, False)
        alloc(v, 64)  # v loads blocks 0-3 (sync: vLLM caches them now, before they land)
        sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set()))
        assert sched.get_num_new_matched_tokens(x, 64) == (0, False)  # 64 tokens hit locally
        alloc(x, 0)
        assert x_saves(80) == []  # waits for v's report
        sched.request_finished(v, (blocks["v"],))  # v ends first, as vLLM frees it first
        report = KVServerWorkerMeta(loads={"v": landed})
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
        saves = x_saves(94)  # blocks 4 and 5 of x are full now
        if landed:
            assert [j.block_ids for j in saves] == [[5]]  # the fifth block (its first four: present)
        else:
            assert saves == []
            assert {b: owner for b, (owner, _) in sched._bad_blocks.items()} == \
                {0: "v", 1: "v", 2: "v", 3: "v", 5: "x"}
    finally:
        sched.shutdown()
        w.shutdown()
        mem.close()
