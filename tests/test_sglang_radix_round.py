"""KVServerLinker driven through SGLang 0.5.23's own UnifiedRadixCache and
UnifiedCacheLinkerWrapper, with SGLang's real Req, the way the scheduler calls them, against a real
daemon. Two engines of 10 layers, each with its own MHA pool in shared memory, allocator,
ReqToTokenPool and radix cache, the linker built by create_unified_cache_linker and attached as
SGLang's registry does (init_cache_linker, then the counter registered on the pool).

The scheduler's calls, in its order (scheduler.py, schedule_policy.py, mem_cache/common.py):
- admission: ``req.init_next_round_input(cache)`` (match_kv_cache -> match_prefix(MatchPrefixParams(
  key, req)) -> wrapper.match -> linker.lookup), then for a host hit ``cache.init_load_back(
  InitLoadBackParams(best_match_node, host_hit_length, req))`` (wrapper.load_back -> the FULL
  component allocates the slots -> linker.load), ``req.host_loaded_length, req.last_node = ...``,
  ``req.prefix_len += host_loaded_length``;
- batch build: ``batch.hicache_consumer_index = cache.ready_to_load_host_cache()``, then the
  request's row gets ``cache.prefix_device_indices(req)`` and extend slots (prepare_for_extend);
- forward: ``counter.set_consumer(index)`` (TpModelWorker.set_hicache_consumer), the attention
  layers' ``pool.get_key_buffer(layer_id)``;
- after it: ``cache.finish_external_linker_loads(batch.reqs)``, then ``checkpoint_kv_cache(req,
  cache)`` (cache_unfinished_req's insert; write-through -> wrapper.offload_nodes ->
  linker.offload);
- every step: ``cache.check_hicache_events()`` (num_completed -> take -> commit);
- a cache flush (``Scheduler.flush_cache``, as after an in-place weight update): ``cache.reset()``.

What is not SGLang's own object here, and why (CPU only, no model):
- No Scheduler, ScheduleBatch or ModelRunner: they need a model, CUDA and a process group. The
  test makes their calls itself, in their order, with the parameters they pass. The forward is
  a loop over the pool's get_key_buffer for the model's layer ids (what the attention
  backends call); a "prefill" writes random KV into the request's slots where the model would.
- Slot allocation for a prefill (alloc_for_extend needs a ScheduleBatch): SGLang's own
  ReqToTokenPool.alloc and PagedTokenToKVPoolAllocator.alloc of whole pages, the row written with
  ReqToTokenPool.write, ``req.kv.kv_allocated_len`` and ``req.extend_end`` set as
  prepare_for_extend does.
- The runtime config (get_disagg() and the rest) is SGLang's RuntimeContext built by
  create_context from an unresolved ServerArgs and activated by use_context for this module only.
- The MIN all-reduces are local (no torch.distributed groups), as in a TP=1 engine.
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass

import pytest
import sglang_env
import torch

if not sglang_env.sglang_installed():
    pytest.skip("sglang not installed (scripts/install_sglang.sh)", allow_module_level=True)

PAGE = 16
NUM_LAYERS = 10
MODEL = "sglang-radix-test"
PROMPT = list(range(2000, 2000 + 3 * PAGE + 5))  # 3 whole pages and a partial one
STORED_PAGES = 3


@pytest.fixture(scope="module", autouse=True)
def _sglang():
    sglang_env.setup()
    with sglang_env.runtime_context(sglang_env.server_args()):
        yield
    sglang_env.restore()


@dataclass
class Engine:
    cache: object  # UnifiedRadixCache
    pool: object  # MHATokenToKVPool
    params: object  # CacheInitParams
    linker: object  # KVServerLinker

    @property
    def wrapper(self):
        return self.cache.linker  # UnifiedCacheLinkerWrapper

    @property
    def allocator(self):
        return self.params.token_to_kv_pool_allocator

    def close(self) -> None:
        self.cache.release_host_resources()  # -> wrapper.close -> linker.close


def _engine(address: str, **extra) -> Engine:
    """registry.py's order: the tree, the linker from the factory with the tree's components,
    init_cache_linker, the counter registered on the pool."""
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    from kvclient.sglang.linker import KVServerLinker, share_cpu_pool

    pool = sglang_env.mha_pool(layer_num=NUM_LAYERS, size=256, page_size=PAGE)
    share_cpu_pool(pool)
    params = sglang_env.cache_init_params(pool)
    cache = sglang_env.unified_radix_cache(params)
    config = {"linker": "KVServerLinker", "linker_module_path": "kvclient.sglang.linker",
              "linker_extra_config": {"address": address, "model": MODEL, "num_layers": NUM_LAYERS,
                                      "timeout_s": 2.0, "load_timeout_s": 10.0, **extra}}
    linker = create_unified_cache_linker(sglang_env.server_args(), params,
                                         backend="dynamic", config=config,
                                         components=set(cache.components))
    assert type(linker) is KVServerLinker
    cache.init_cache_linker(linker)
    pool.register_layer_transfer_counter(cache.linker.layer_done_counter)
    assert cache.write_through_threshold == 1  # the wrapper forces write-through
    return Engine(cache, pool, params, linker)


def _fill(pool, slots, seed):
    g = torch.Generator().manual_seed(seed)
    for bufs in (pool.k_buffer, pool.v_buffer):
        for buf in bufs:
            buf[slots] = torch.randn(buf[slots].shape, generator=g).to(buf.dtype)


def _rows(pool, slots):
    return [[buf[slots].clone() for buf in bufs] for bufs in (pool.k_buffer, pool.v_buffer)]


def _same_bytes(expect, got) -> bool:
    return all(torch.equal(e.view(torch.uint8), g.view(torch.uint8))
               for exp_part, got_part in zip(expect, got, strict=True)
               for e, g in zip(exp_part, got_part, strict=True))


def _give_row(engine: Engine, req, prefix_slots: torch.Tensor) -> torch.Tensor:
    """prepare_for_extend's allocation: a req_to_token row holding the prefix's slots, then fresh
    whole pages for the extend (fill ids [prefix_len, len)). Returns the extend slots."""
    total = len(req.full_untruncated_fill_ids)
    prefix = len(prefix_slots)
    (row,) = engine.params.req_to_token_pool.alloc([req])
    pages = -(-(total - prefix) // PAGE)
    extend = engine.allocator.alloc(pages * PAGE)
    assert extend is not None
    pool = engine.params.req_to_token_pool
    if prefix:
        pool.write((row, slice(0, prefix)), prefix_slots.to(torch.int32))
    pool.write((row, slice(prefix, total)), extend[: total - prefix].to(torch.int32))
    req.kv.kv_allocated_len = total
    req.extend_end = total
    return extend[: total - prefix]


def _prefill_and_insert(engine: Engine, req, seed: int) -> tuple[torch.Tensor, list]:
    """Engine A: admission (a miss everywhere), the prefill writing its KV, the insert."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    req.init_next_round_input(engine.cache)
    assert (req.prefix_len, req.host_hit_length) == (0, 0)
    slots = _give_row(engine, req, torch.empty(0, dtype=torch.int64))
    _fill(engine.pool, slots, seed)
    expect = _rows(engine.pool, slots[: STORED_PAGES * PAGE])
    checkpoint_kv_cache(req, engine.cache)  # the insert: write-through -> linker.offload
    return slots, expect


def _drain_offloads(engine: Engine, timeout: float = 10.0) -> None:
    """The scheduler's per-step check_hicache_events, until the wrapper has nothing pending."""
    deadline = time.monotonic() + timeout
    while engine.wrapper.pending_offloads and time.monotonic() < deadline:
        engine.cache.check_hicache_events()
        time.sleep(0.005)
    assert not engine.wrapper.pending_offloads, "the offload was never committed"


def _counters(engine: Engine):
    """The daemon's cache counters for the model's KV space (CacheCounters)."""
    (space,) = [s for s in engine.linker.client.stats().spaces if s.space.model == MODEL]
    return space.counters


def _stored_pages(engine: Engine) -> int:
    return _counters(engine).pages


def _admit(engine: Engine, req):
    """schedule_policy's admission of a request with a host hit: match, then init_load_back with
    the parameters it passes, and the request fields it sets from the result."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    req.init_next_round_input(engine.cache)
    promised = req.host_hit_length
    loaded = engine.cache.init_load_back(InitLoadBackParams(
        best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
    req.host_loaded_length, req.last_node = loaded
    req.prefix_len += req.host_loaded_length
    return promised, loaded


def _forward(pool, released: list) -> threading.Thread:
    """The attention layers: their ids through the pool's wait hook."""
    def run():
        for layer_id in pool.model_layer_ids:
            pool.get_key_buffer(layer_id)
            released.append(layer_id)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _kv_lookup(tokens):
    """The FULL component's LOOKUP transfer for ``tokens``' whole pages (SGLang's own hashes)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    whole = len(tokens) // PAGE * PAGE
    return PoolTransfer(name=PoolName.KV, keys=get_storage_hash_str(tokens[:whole], None, page_size=PAGE))


def _device_match(engine: Engine, tokens) -> int:
    """What the tree alone holds for `tokens` (no req: the linker is not asked)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", tokens))
    return engine.cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len


# ---- 1. engine A: the insert's write-through stores, check_hicache_events commits ----------


def test_an_insert_writes_through_to_the_daemon_and_the_step_commits_it(daemon):
    a = _engine(daemon.address)
    try:
        req = sglang_env.req("a-0", PROMPT)
        _prefill_and_insert(a, req, seed=11)
        # The insert kept the whole pages and issued their write-through.
        assert _device_match(a, PROMPT) == STORED_PAGES * PAGE
        assert len(a.wrapper.pending_offloads) == 1
        _drain_offloads(a)
        assert _stored_pages(a) == STORED_PAGES
        assert a.linker.num_completed_offloads() == 0  # popped by the commit
    finally:
        a.close()


# ---- 2. engine B: match -> load_back -> the layer-wise load in the forward -> finish ------------


def test_a_second_engine_loads_the_prefix_through_its_radix_cache(daemon):
    a = _engine(daemon.address)
    b = _engine(daemon.address)
    try:
        _, expect = _prefill_and_insert(a, sglang_env.req("a-0", PROMPT), seed=21)
        _drain_offloads(a)
        b.allocator.alloc(2 * PAGE)  # another request's pages: B's slots are not A's

        req = sglang_env.req("b-0", PROMPT + [7, 8, 9])
        promised, (loaded, last_node) = _admit(b, req)
        assert promised == STORED_PAGES * PAGE  # host_hit_length: the stored whole pages
        assert req.host_hit_length == STORED_PAGES * PAGE
        assert loaded == STORED_PAGES * PAGE and last_node == b.cache.root_node_handle()
        assert req.prefix_len == STORED_PAGES * PAGE
        assert req.rid in b.wrapper.inflight_load_rids

        index = b.cache.ready_to_load_host_cache()
        assert index >= 0
        slots = b.cache.prefix_device_indices(req)  # the loaded tail, private to the request
        assert len(slots) == STORED_PAGES * PAGE
        _give_row(b, req, slots)

        waits = []
        counter = b.wrapper.layer_done_counter
        real_wait = counter.wait_until

        def recording_wait(local):
            real_wait(local)
            waits.append(local)

        counter.wait_until = recording_wait
        counter.set_consumer(index)
        released = []
        _forward(b.pool, released).join(15)
        assert released == list(range(NUM_LAYERS))  # the pool was asked for each layer
        assert waits == list(range(NUM_LAYERS))  # the counter saw each, in order

        assert b.cache.finish_external_linker_loads([req]) == []
        assert req.discard_output_reason is None and not req.skip_radix_cache_insert
        assert _same_bytes(expect, _rows(b.pool, slots)), "B's slots do not hold A's KV"

        # The request inserts the loaded pages like computed KV; they are in the store already.
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        checkpoint_kv_cache(req, b.cache)
        assert _device_match(b, PROMPT) == STORED_PAGES * PAGE
        # SGLang 0.5.23 writes the inserted tail through again (nothing marks a loaded tail as
        # stored); the daemon finds every page present and stores nothing twice.
        assert len(b.wrapper.pending_offloads) == 1
        _drain_offloads(b)
        counters = _counters(b)
        assert (counters.pages, counters.dedup_pages) == (STORED_PAGES, STORED_PAGES)
    finally:
        a.close()
        b.close()


# ---- 3. the daemon stops between init_load_back and the forward -----------------------------


def test_a_load_lost_before_the_forward_aborts_the_request_and_inserts_nothing(daemon_factory):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    d = daemon_factory()
    a = _engine(d.address, retry_register_s=0.0)
    b = _engine(d.address, retry_register_s=0.0)
    try:
        _prefill_and_insert(a, sglang_env.req("a-0", PROMPT), seed=31)
        _drain_offloads(a)
        req = sglang_env.req("b-0", PROMPT + [7, 8, 9])
        promised, (loaded, _) = _admit(b, req)
        assert promised == loaded == STORED_PAGES * PAGE

        d.stop()  # between init_load_back and the batch's prefill

        index = b.cache.ready_to_load_host_cache()
        slots = b.cache.prefix_device_indices(req)
        _give_row(b, req, slots)
        b.wrapper.layer_done_counter.set_consumer(index)
        forward = _forward(b.pool, [])
        forward.join(15)
        assert not forward.is_alive(), "the forward must not hang on a lost load"

        assert b.cache.finish_external_linker_loads([req]) == [req]
        assert isinstance(req.discard_output_reason, FINISH_ABORT)
        assert req.skip_radix_cache_insert
        # The scheduler's insert after the forward leaves the tree as it was.
        checkpoint_kv_cache(req, b.cache)
        assert _device_match(b, PROMPT) == 0
        assert b.wrapper.pending_offloads == [] and b.wrapper.private_load_indices == {}
    finally:
        a.close()
        b.close()


# ---- 4. a cache flush (as after an in-place weight update) ------------------------------------


def test_after_a_flush_the_engine_loads_nothing_the_daemon_held_and_stores_nothing_new(daemon):
    """SGLang flushes its cache after an in-place weight update (flush_cache_after_weight_update ->
    Scheduler.flush_cache -> cache.reset() -> wrapper.reset -> linker.reset). What the daemon holds
    under the engine's KV space was computed by the old weights: after the flush the engine's
    admissions find no host hit, and its write-throughs store nothing another engine of the old
    weights would take as its own. An engine that was not flushed still loads what it stored."""
    a = _engine(daemon.address)
    b = _engine(daemon.address)
    try:
        _prefill_and_insert(a, sglang_env.req("a-0", PROMPT), seed=41)
        _drain_offloads(a)
        assert b.linker.lookup("warm", [_kv_lookup(PROMPT)]) == [1, 2, 3]

        b.cache.reset()  # what flush_cache does on every TP rank, once the engine is idle

        req = sglang_env.req("b-0", PROMPT + [7, 8, 9])
        promised, (loaded, _) = _admit(b, req)
        assert (promised, loaded, req.prefix_len) == (0, 0, 0)
        assert b.wrapper.inflight_load_rids == [] and b.cache.ready_to_load_host_cache() == -1
        # The new weights' prefill, inserted: its write-through completes without storing.
        other = [t + 1 for t in PROMPT]
        _prefill_and_insert(b, sglang_env.req("b-1", other), seed=42)
        _drain_offloads(b)
        assert a.linker.lookup("new", [_kv_lookup(other)]) == []
        assert _stored_pages(a) == STORED_PAGES
        # A pre-flush reader (engine A, not flushed) still hits its own pages.
        assert a.linker.lookup("old", [_kv_lookup(PROMPT)]) == [1, 2, 3]
    finally:
        a.close()
        b.close()
