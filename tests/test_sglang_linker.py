"""kvclient.sglang.linker.KVServerLinker against SGLang 0.5.23's real classes and a real daemon.

CPU tensors as the device pool: SGLang's own MHA/MLA token pools, their buffers moved into shared
memory by share_cpu_pool (the daemon can only reach a CPU pool there). Skipped where
scripts/install_sglang.sh has not run.
"""

from __future__ import annotations

import inspect
import threading
import time

import grpc
import pytest
import sglang_env
import torch
from conftest import DaemonThread

from kvclient.errors import KVClientError

if not sglang_env.sglang_installed():
    pytest.skip("sglang not installed (scripts/install_sglang.sh)", allow_module_level=True)

PAGE = 16
MODULE = "kvclient.sglang.linker"


@pytest.fixture(scope="module", autouse=True)
def _sglang():
    sglang_env.setup()
    yield
    sglang_env.restore()


def _engine(daemon_address, kind="mha", *, num_layers=10, pp_size=1, pp_rank=0, dtype=None,
            pool_class=None, params_overrides=None, server_args=None, pool=None, **extra):
    """One SGLang-shaped engine (one TP rank of it: ``tp_rank``/``tp_size`` in ``extra``): its
    pool in shared memory, CacheInitParams, and the linker as SGLang's registry builds it
    (create_unified_cache_linker, then the counter registered on the pool)."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    from kvclient.sglang.linker import share_cpu_pool

    if pool is None:
        pool = sglang_env.stage_pool(kind, num_layers, pp_size, pp_rank, size=128, page_size=PAGE,
                                     dtype=dtype)
    share_cpu_pool(pool)
    if pool_class is not None:  # a subclass of SGLang's pool, holding more than K/V or the latent
        pool.__class__ = pool_class
    params = sglang_env.cache_init_params(pool, pp_rank=pp_rank, pp_size=pp_size)
    for name, value in (params_overrides or {}).items():
        setattr(params, name, value)
    config = {"linker": "KVServerLinker", "linker_module_path": MODULE,
              "linker_extra_config": {"address": daemon_address, "model": "sglang-test",
                                      "num_layers": num_layers, "timeout_s": 2.0,
                                      "load_timeout_s": 10.0, **extra}}
    linker = create_unified_cache_linker(server_args or sglang_env.server_args(pp_size=pp_size), params,
                                         backend="dynamic", config=config,
                                         components={ComponentType.FULL})
    pool.register_layer_transfer_counter(linker.layer_done_counter)
    return linker, pool, params.token_to_kv_pool_allocator


def _buffers(pool):
    return [pool.kv_buffer] if hasattr(pool, "kv_lora_rank") else [pool.k_buffer, pool.v_buffer]


def _fill(pool, slots, seed):
    g = torch.Generator().manual_seed(seed)
    for bufs in _buffers(pool):
        for buf in bufs:
            if buf.dtype == torch.uint8:  # an fp8 pool's store dtype
                buf[slots] = torch.randint(0, 256, buf[slots].shape, generator=g, dtype=torch.uint8)
            else:
                buf[slots] = torch.randn(buf[slots].shape, generator=g).to(buf.dtype)


def _rows(pool, slots):
    return [[buf[slots].clone() for buf in bufs] for bufs in _buffers(pool)]


def _assert_same_bytes(expect, got):
    for exp_part, got_part in zip(expect, got, strict=True):
        for e, g in zip(exp_part, got_part, strict=True):
            assert torch.equal(e.view(torch.uint8), g.view(torch.uint8))


def _hashes(tokens):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=PAGE)


def _kv(**kw):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return PoolTransfer(name=PoolName.KV, **kw)


def _completed(linker, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while linker.num_completed_offloads() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return linker.num_completed_offloads()


def _store(linker, pool, alloc, first_token: int, seed: int):
    """Two pages of fresh KV written through ``linker`` (an offload that completes True); returns
    (their hashes, their slots)."""
    hashes = _hashes(list(range(first_token, first_token + 2 * PAGE)))
    slots = alloc.alloc(2 * PAGE)
    _fill(pool, slots, seed=seed)
    assert linker.offload([_kv(device_indices=slots, keys=hashes)]) is True
    assert _completed(linker, 1) == 1 and linker.pop_completed_offload() is True
    return hashes, slots


def _forward(pool, released):
    """The attention layers: global ids through the pool's wait hook."""
    for layer_id in pool.model_layer_ids:
        pool.get_key_buffer(layer_id)
        released.append(layer_id)


# ---- contract ---------------------------------------------------------------------------------


def test_contract_real_base_real_signatures(daemon):
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
        UnifiedCacheLinker,
    )

    from kvclient.sglang.linker import KVServerLinker

    assert issubclass(KVServerLinker, UnifiedCacheLinker)
    assert not inspect.isabstract(KVServerLinker) and not KVServerLinker.__abstractmethods__
    # The pinned version's contract: a method missing here (or renamed upstream) fails.
    abstract = set(UnifiedCacheLinker.__abstractmethods__)
    assert abstract == {"lookup", "load", "start_layer_wise_loading", "finish_layer_wise_loading",
                        "cancel_queued_load", "offload", "num_completed_offloads",
                        "pop_completed_offload", "reset", "close"}
    for name in abstract:
        mine = getattr(KVServerLinker, name)
        assert mine is not getattr(UnifiedCacheLinker, name), name
        assert inspect.signature(mine) == inspect.signature(getattr(UnifiedCacheLinker, name)), name
    # The constructor SGLang's factory calls.
    params = list(inspect.signature(KVServerLinker.__init__).parameters.values())
    assert [p.name for p in params] == ["self", "server_args", "params", "components",
                                        "extra_config", "forward_stream"]
    assert [p.kind for p in params[3:]] == [inspect.Parameter.KEYWORD_ONLY] * 3
    assert params[-1].default is None

    linker, pool, _ = _engine(daemon.address)
    try:
        assert type(linker) is KVServerLinker
        assert isinstance(linker.layer_done_counter, LayerWiseLoadCounter)
        assert pool.layer_transfer_counter is linker.layer_done_counter
        assert linker.layer_done_counter.num_layers == pool.layer_num == 10
        assert linker.layer_ids == tuple(range(10))  # from model_layer_ids
        reg = linker._register_kwargs
        assert (reg["start_layer"], reg["end_layer"], reg["num_layers"]) == (0, 10, 10)
        assert (reg["pp_rank"], reg["pp_size"], reg["tp_rank"], reg["tp_size"]) == (0, 1, 0, 1)
        assert linker.forward_stream is None
        assert len(linker.record_offload_ready()) == 1
    finally:
        linker.close()


def test_a_cpu_pool_outside_shared_memory_is_refused(daemon):
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    pool = sglang_env.mha_pool(layer_num=4)
    params = sglang_env.cache_init_params(pool)
    config = {"linker": "KVServerLinker", "linker_module_path": MODULE,
              "linker_extra_config": {"address": daemon.address}}
    with pytest.raises(ValueError, match="not in shared memory"):
        create_unified_cache_linker(sglang_env.server_args(), params, backend="dynamic",
                                    config=config, components={ComponentType.FULL})


# ---- behaviour --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,dtype", [("mha", None), ("mla", None), ("mha", "fp8")])
def test_two_engines_share_a_prefix_layer_by_layer(daemon, kind, dtype):
    dtype = torch.float8_e4m3fn if dtype == "fp8" else None
    a, pool_a, alloc_a = _engine(daemon.address, kind, dtype=dtype)
    b, pool_b, alloc_b = _engine(daemon.address, kind, dtype=dtype)
    if dtype is not None:  # SGLang stores fp8 as uint8; the daemon is told fp8
        assert pool_a.k_buffer[0].dtype == torch.uint8
        assert pool_a.kvserver_shm_pool.dtype == torch.float8_e4m3fn
    try:
        tokens = list(range(1000, 1000 + 3 * PAGE + 5))
        hashes = _hashes(tokens[: 3 * PAGE])  # whole pages only, as the wrapper cuts them
        assert len(hashes) == 3 and all(len(h) == 64 for h in hashes)

        # Engine A: the forward wrote its KV; write-through offloads the node.
        slots_a = alloc_a.alloc(3 * PAGE)
        _fill(pool_a, slots_a, seed=7)
        expect = _rows(pool_a, slots_a)
        assert a.lookup("a0", [_kv(keys=hashes)]) == []
        assert a.offload([_kv(device_indices=slots_a, keys=hashes)], session_id=None) is True
        assert _completed(a, 1) == 1
        assert a.pop_completed_offload() is True
        assert a.num_completed_offloads() == 0

        # Engine B: match -> lookup, load_back -> load, prefill -> start, forward, finish.
        assert b.lookup("r1", [_kv(keys=hashes)]) == [1, 2, 3]
        assert b.lookup("r2", [_kv(keys=hashes + _hashes(tokens[PAGE: 2 * PAGE]))]) == [1, 2, 3]
        assert b.cancel_queued_load("r2") is False  # never queued (its lease is released)
        slots_b = alloc_b.alloc(3 * PAGE)
        assert b.load("r1", [_kv(keys=hashes, device_indices=slots_b)]) is True
        counter = b.layer_done_counter
        waits = []
        real_wait = counter.wait_until

        def recording_wait(local):
            real_wait(local)
            waits.append(local)

        counter.wait_until = recording_wait
        completed = []
        real_complete = counter.complete

        def recording_complete(idx, local):
            completed.append((idx, local))
            real_complete(idx, local)

        counter.complete = recording_complete
        index = b.start_layer_wise_loading()
        assert index >= 0
        counter.set_consumer(index)
        released = []
        forward = threading.Thread(target=_forward, args=(pool_b, released))
        forward.start()
        forward.join(10)
        assert released == list(pool_b.model_layer_ids)  # global ids through the pool
        assert waits == list(range(pool_b.layer_num))  # the counter saw local ids, in order
        assert b.finish_layer_wise_loading(index) is True
        # The loader released SGLang's counter once per local layer, in order.
        assert completed == [(index, local) for local in range(pool_b.layer_num)]
        _assert_same_bytes(expect, _rows(pool_b, slots_b))
        # Nothing queued: -1, and finishing it is True.
        assert b.start_layer_wise_loading() == -1
        assert b.finish_layer_wise_loading(-1) is True
    finally:
        a.close()
        b.close()


def test_engines_of_other_weights_never_share(daemon):
    """The weights' identity (linker_extra_config weights, else read from the model path) is part
    of the KV space: the same model name with other weights finds nothing."""
    a, pool_a, alloc_a = _engine(daemon.address, weights="rev-a")
    b, _, _ = _engine(daemon.address, weights="rev-b")
    c, _, _ = _engine(daemon.address, weights="rev-a")
    try:
        hashes = _hashes(list(range(2000, 2000 + 3 * PAGE)))
        slots = alloc_a.alloc(3 * PAGE)
        _fill(pool_a, slots, seed=3)
        assert a.offload([_kv(device_indices=slots, keys=hashes)], session_id=None) is True
        assert _completed(a, 1) == 1
        assert b.lookup("b", [_kv(keys=hashes)]) == []
        assert c.lookup("c", [_kv(keys=hashes)]) == [1, 2, 3]
    finally:
        for linker in (a, b, c):
            linker.close()


def test_cancel_queued_load_and_reset(daemon):
    a, pool_a, alloc_a = _engine(daemon.address)
    try:
        hashes = _hashes(list(range(2 * PAGE)))
        slots = alloc_a.alloc(2 * PAGE)
        assert a.offload([_kv(device_indices=slots, keys=hashes)]) is True
        assert _completed(a, 1) == 1 and a.pop_completed_offload() is True
        assert a.lookup("r", [_kv(keys=hashes)]) == [1, 2]
        other = alloc_a.alloc(2 * PAGE)
        assert a.load("r", [_kv(keys=hashes, device_indices=other)]) is True
        assert a.cancel_queued_load("r") is True
        assert a.cancel_queued_load("r") is False
        assert a.start_layer_wise_loading() == -1
        # Slots that are not whole pages are refused, not loaded.
        assert a.load("s", [_kv(keys=hashes, device_indices=other + 1)]) is False
        assert a.offload([_kv(device_indices=slots, keys=hashes)]) is True
        a.reset()
        assert a.num_completed_offloads() == 0
        assert a.layer_done_counter.producer_index == -1
    finally:
        a.close()


def test_pages_only_the_daemons_disk_holds_are_hits_only_when_asked(daemon_factory, tmp_path):
    """By default the linker's lookups count the daemon's host memory only: SGLang's load cannot
    fall back to a recompute, and a disk page is read back inside it. ``disk_hits`` counts them;
    the load then reads them back, bit-exact."""
    d = daemon_factory(host_memory=64 << 20, disk_cache=str(tmp_path / "disk"), disk_size=256 << 20)
    a, pool_a, alloc_a = _engine(d.address)
    b, pool_b, alloc_b = _engine(d.address, disk_hits=True)
    try:
        hashes, slots_a = _store(a, pool_a, alloc_a, 700, seed=5)
        expect = _rows(pool_a, slots_a)
        deadline = time.monotonic() + 10
        while d.run(lambda: d.core.disk.counters.written_pages) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        d.run(lambda: d.core.cache.evict_all())  # in host memory no more: on disk only
        assert a.lookup("r", [_kv(keys=hashes)]) == []
        assert b.lookup("r", [_kv(keys=hashes)]) == [1, 2]
        slots_b = alloc_b.alloc(2 * PAGE)
        assert b.load("r", [_kv(keys=hashes, device_indices=slots_b)]) is True
        index = b.start_layer_wise_loading()
        released: list[int] = []
        _forward(pool_b, released)
        assert b.finish_layer_wise_loading(index) is True
        _assert_same_bytes(expect, _rows(pool_b, slots_b))
        assert a.lookup("r2", [_kv(keys=hashes)]) == [1, 2]  # read back: in host memory now
    finally:
        a.close()
        b.close()


def test_daemon_stopped_mid_request_gives_misses(daemon_factory):
    d = daemon_factory()
    a, pool_a, alloc_a = _engine(d.address, retry_register_s=0.0)
    b, pool_b, alloc_b = _engine(d.address, retry_register_s=0.0)
    try:
        hashes, slots_a = _store(a, pool_a, alloc_a, 500, seed=3)
        assert b.lookup("r", [_kv(keys=hashes)]) == [1, 2]
        slots_b = alloc_b.alloc(2 * PAGE)
        assert b.load("r", [_kv(keys=hashes, device_indices=slots_b)]) is True

        d.stop()  # between SGLang's load_back and the batch's prefill

        index = b.start_layer_wise_loading()
        b.layer_done_counter.set_consumer(index)
        released = []
        forward = threading.Thread(target=_forward, args=(pool_b, released))
        forward.start()
        forward.join(15)
        assert not forward.is_alive(), "the forward must not hang on a failed load"
        assert b.finish_layer_wise_loading(index) is False  # SGLang aborts those requests (503)
        assert b.lookup("r2", [_kv(keys=hashes)]) == []
        if a.offload([_kv(device_indices=slots_a, keys=hashes)]):
            assert _completed(a, 1) == 1
            assert a.pop_completed_offload() is False
        assert a.pop_completed_offload() is False  # nothing left: False, not an exception

        # The daemon comes back (same socket, empty cache): the clients re-register by
        # themselves, A's next write-through stores, B hits and loads again.
        again = DaemonThread(d.config)
        try:
            deadline = time.monotonic() + 20
            stored = False
            while not stored and time.monotonic() < deadline:
                if a.offload([_kv(device_indices=slots_a, keys=hashes)]):
                    _completed(a, 1)
                    stored = a.pop_completed_offload()
                if not stored:
                    time.sleep(0.2)
            assert stored, "A never stored again after the daemon came back"
            # B's lookups miss at once until its probe (off the scheduler's thread) finds the
            # daemon answering again, within the probe's backoff cap.
            deadline = time.monotonic() + b.away.cap + 5
            while b.lookup("r3", [_kv(keys=hashes)]) != [1, 2] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert b.lookup("r3", [_kv(keys=hashes)]) == [1, 2]
            assert b.load("r3", [_kv(keys=hashes, device_indices=slots_b)]) is True
            index = b.start_layer_wise_loading()
            b.layer_done_counter.set_consumer(index)
            _forward(pool_b, [])
            assert b.finish_layer_wise_loading(index) is True
            _assert_same_bytes(_rows(pool_a, slots_a), _rows(pool_b, slots_b))
        finally:
            a.close()
            b.close()
            again.stop()
    finally:
        a.close()
        b.close()


def test_a_load_after_the_client_knows_its_registration_lost_is_refused(daemon_factory):
    """The daemon goes after a hit and the client has marked its registration lost before SGLang
    calls load(): with one rank the load is refused (SGLang recomputes), not accepted and failed
    (finish_layer_wise_loading False: SGLang aborts the request with 503)."""
    d = daemon_factory()
    a, pool_a, alloc_a = _engine(d.address, retry_register_s=0.0)
    b, pool_b, alloc_b = _engine(d.address, retry_register_s=0.0)
    try:
        hashes, _ = _store(a, pool_a, alloc_a, 500, seed=5)
        assert b.lookup("r", [_kv(keys=hashes)]) == [1, 2]
        d.stop()
        deadline = time.monotonic() + 10
        while b.client.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not b.client.connected, "the client never marked its registration lost"
        slots_b = alloc_b.alloc(2 * PAGE)
        assert b.load("r", [_kv(keys=hashes, device_indices=slots_b)]) is False
        assert b.start_layer_wise_loading() == -1
    finally:
        a.close()
        b.close()


def test_no_daemon_at_startup_misses_everything(socket_dir):
    """The engine starts before the daemon: the linker constructs, and every call is a miss."""
    linker, pool, alloc = _engine(f"unix://{socket_dir}/absent.sock", retry_register_s=60.0)
    try:
        hashes = _hashes(list(range(PAGE)))
        slots = alloc.alloc(PAGE)
        assert linker.lookup("r", [_kv(keys=hashes)]) == []
        assert linker.load("r", [_kv(keys=hashes, device_indices=slots)]) is False
        # An offload is queued whatever the daemon (the answer depends on the transfers alone, as
        # SGLang's TP ranks pair their pending offloads by position) and completes False.
        assert linker.offload([_kv(device_indices=slots, keys=hashes)]) is True
        assert _completed(linker, 1) == 1 and linker.pop_completed_offload() is False
        assert linker.start_layer_wise_loading() == -1
        assert linker.finish_layer_wise_loading(-1) is True
        assert linker.num_completed_offloads() == 0 and linker.pop_completed_offload() is False
        linker.reset()
    finally:
        linker.close()


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_pipeline_parallelism_is_refused_at_construction_naming_what_to_use(daemon, pp_rank):
    """SGLang 0.5.23's PP stages each build their own batches, and its linker wrapper agrees on
    hits and load results over the attention TP group only, never across stages: stages that
    counted different hits would extend a request by different lengths. So every stage refuses
    to start, and says what serves PP instead (HiCache with the kvserver storage backend, whose
    hits and prefetches SGLang reduces over the PP group too)."""
    with pytest.raises(ValueError, match="pipeline parallelism") as refused:
        _engine(daemon.address, num_layers=10, pp_size=2, pp_rank=pp_rank)
    assert "KVServerStorage" in str(refused.value) and "--enable-hierarchical-cache" in str(refused.value)
    assert not daemon.run(lambda: len(daemon.core.clients)), "a refused stage must not register"


def test_an_engine_claiming_another_layer_range_misses_and_says_why(daemon, caplog):
    """Two engines of one model disagree on its layers (one's pool holds 4 of the 10 its
    num_layers says): the first fixes the part's range; the other's calls are refused, which the
    linker turns into misses, logging once the daemon's reason with both ranges."""
    hashes = _hashes(list(range(3, 3 + PAGE)))
    a, pool_a, alloc_a = _engine(daemon.address, num_layers=10)
    b, pool_b, alloc_b = _engine(daemon.address, num_layers=10,
                                 pool=sglang_env.mha_pool(layer_num=4, size=128, page_size=PAGE))
    try:
        assert (a.layer_ids, b.layer_ids) == (tuple(range(0, 10)), tuple(range(0, 4)))
        slots = alloc_a.alloc(PAGE)
        _fill(pool_a, slots, seed=1)
        assert a.offload([_kv(device_indices=slots, keys=hashes)]) is True
        assert _completed(a, 1) == 1 and a.pop_completed_offload() is True
        with caplog.at_level("WARNING"):
            assert b.lookup("r", [_kv(keys=hashes)]) == []
            assert b.lookup("r", [_kv(keys=hashes)]) == []
        said = [r.getMessage() for r in caplog.records if "[0, 10)" in r.getMessage()]
        assert said and "[0, 4)" in said[0], caplog.text
        from kvclient.sglang.linker import storage_keys

        assert a.client.lookup(storage_keys(hashes), key_bytes=32).pages == 1  # its own part: stored
        # A layer id outside the registered range, sent on the wire, is refused naming the range.
        with pytest.raises(KVClientError) as refused:
            a.client.get(storage_keys(hashes), [1], layers=[10], key_bytes=32).wait(5)
        assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert "[0, 10)" in refused.value.message, refused.value.message
    finally:
        a.close()
        b.close()


class _CudaHandle:
    """Stands in for a CUDA LoadHandle (no GPU here): records the stream waits asked of it."""

    def __init__(self, error: Exception | None = None) -> None:
        self.waits: list[int] = []
        self.error = error  # the daemon's answer, had the copy failed after its events were recorded

    def stream_wait_layer(self, layer_id: int, stream=None) -> bool:
        self.waits.append(layer_id)
        if self.error is not None:
            raise self.error
        return True


def test_the_cuda_counter_waits_on_the_stream_per_global_layer_and_reports_late_failures():
    """On CUDA the counter's layers are released once the events are recorded; each wait_until
    (local id, from SGLang's pool hook) then makes the stream wait for that layer's event, in
    every get of the batch, under its global id. A failed batch asks for no stream wait, and a
    get that fails after its events were handed out fails finish()."""
    from kvclient.sglang.linker import KVServerLayerCounter, KVServerLoadError

    counter = KVServerLayerCounter((4, 5, 6))
    index = counter.update_producer()
    handles = [_CudaHandle(), _CudaHandle()]
    counter.gpu_waits[index] = handles
    for local in range(3):
        counter.complete(index, local)
    counter.set_consumer(index)
    counter.wait_until(0)
    counter.wait_until(2)
    assert [h.waits for h in handles] == [[4, 6], [4, 6]]
    assert counter.finish(index) is True and index not in counter.gpu_waits

    failed = counter.update_producer()
    late = _CudaHandle()
    counter.gpu_waits[failed] = [late]
    counter.fail(failed, KVServerLoadError("3 of 4 pages stored"))
    counter.set_consumer(failed)
    counter.wait_until(1)  # returns (SGLang's contract) without a stream wait
    assert late.waits == [] and counter.finish(failed) is False

    landed = counter.update_producer()
    for local in range(3):
        counter.complete(landed, local)
    counter.late_fail(landed)
    assert counter.finish(landed) is False
    assert counter.finish(landed) is True  # an index already finished: nothing left to report

    broken = counter.update_producer()
    dead = _CudaHandle(KVClientError(grpc.StatusCode.INTERNAL, "load stream ended before the last layer"))
    counter.gpu_waits[broken] = [dead]
    for local in range(3):
        counter.complete(broken, local)
    counter.set_consumer(broken)
    counter.wait_until(0)  # does not raise into the forward
    assert dead.waits == [4] and counter.finish(broken) is False


def test_pools_holding_more_than_kv_and_context_parallel_ranks_are_refused(daemon):
    """A subclass of SGLang's pools (MXFP8 with its scales, DSA with its indexer, ...) holds
    buffers the linker does not store, and context-parallel ranks hold different tokens of one
    page: either would load silently wrong KV, so construction refuses them, saying why."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    class MLAWithIndexer(MLATokenToKVPool):
        pass

    class MHAWithScales(MHATokenToKVPool):
        pass

    with pytest.raises(ValueError, match="not MLAWithIndexer"):
        _engine(daemon.address, "mla", pool_class=MLAWithIndexer)
    with pytest.raises(ValueError, match="not MHAWithScales"):
        _engine(daemon.address, "mha", pool_class=MHAWithScales)
    with pytest.raises(ValueError, match="context-parallel"):
        _engine(daemon.address, params_overrides={"attn_cp_size": 2})


def test_reset_drops_the_offloads_it_finds_queued(daemon):
    """SGLang's reset releases every pending offload's node once the linker's reset returns, and
    their slots may then be reused: a queued offload must not Put them afterwards, nor complete
    into the next generation's queue. The one already running finishes first."""
    a, pool, alloc = _engine(daemon.address)
    gate, entered, puts = threading.Event(), threading.Event(), []
    real_put = a.client.put

    def gated_put(*args, **kw):  # the real Put, held at its start while the test queues more
        puts.append(args[0])
        entered.set()
        gate.wait(10)
        return real_put(*args, **kw)

    a.client.put = gated_put
    try:
        batches = [_hashes(list(range(100 * i, 100 * i + PAGE))) for i in range(4)]
        for keys in batches:
            slots = alloc.alloc(PAGE)
            _fill(pool, slots, seed=len(puts))
            assert a.offload([_kv(device_indices=slots, keys=keys)]) is True
        assert entered.wait(10)
        resetting = threading.Thread(target=a.reset)
        resetting.start()
        time.sleep(0.2)
        assert resetting.is_alive()  # waits for the Put that is running
        gate.set()
        resetting.join(10)
        assert not resetting.is_alive()
        assert len(puts) == 1 and a.num_completed_offloads() == 0
        from kvclient.sglang.linker import storage_keys

        stored = [a.client.lookup(storage_keys(keys), key_bytes=32).pages for keys in batches]
        assert stored == [1, 0, 0, 0]
        slots = alloc.alloc(PAGE)
        assert a.offload([_kv(device_indices=slots, keys=batches[1])]) is True  # after the reset:
        assert _completed(a, 1) == 1 and a.pop_completed_offload() is False  # queued, stores nothing
        assert a.client.lookup(storage_keys(batches[1]), key_bytes=32).pages == 0
    finally:
        gate.set()
        a.close()


def test_leases_of_lookups_that_never_load_are_forgotten_after_their_pin(daemon):
    """A request aborted after its lookup (or refused slots, or missed on another rank) never
    loads: past the pin the daemon has ended its lease, and the linker lets go of it too (its
    time is kept a while, so that a late load of it is refused, then forgotten)."""
    a, pool, alloc = _engine(daemon.address, lookup_pin_ms=200)
    try:
        keys = _hashes(list(range(PAGE)))
        slots = alloc.alloc(PAGE)
        _fill(pool, slots, seed=3)
        assert a.offload([_kv(device_indices=slots, keys=keys)]) is True
        assert _completed(a, 1) == 1 and a.pop_completed_offload() is True
        for i in range(5):
            assert a.lookup(f"gone-{i}", [_kv(keys=keys)]) == [1]
        assert len(a._leases) == 5
        time.sleep(0.3)
        assert a.lookup("live", [_kv(keys=keys)]) == [1]
        assert [rid for rid, (lease, _) in a._leases.items() if lease] == ["live"]
        time.sleep(2.0)  # past ten pins
        assert a.lookup("later", [_kv(keys=keys)]) == [1]
        assert list(a._leases) == ["later"]
    finally:
        a.close()


def test_a_stopped_daemon_costs_the_scheduler_one_bounded_wait(socket_dir):
    """SGLang calls lookup, load and offload on its scheduler's thread: each waits at most
    lookup_timeout_s, and after one timed out none waits until the daemon answers again."""
    import os
    import signal

    from daemon_proc import DaemonProcess

    d = DaemonProcess(os.path.join(socket_dir, "stopped.sock"), host_memory="256MiB")
    linker, pool, alloc = _engine(d.address, lookup_timeout_s=0.5)
    try:
        hashes = _hashes(list(range(700, 700 + 2 * PAGE)))
        slots = alloc.alloc(2 * PAGE)
        assert linker.lookup("warm", [_kv(keys=hashes)]) == []  # registered, answering
        os.kill(d.proc.pid, signal.SIGSTOP)
        took, answers = [], []
        for i in range(4):
            t = time.monotonic()
            answers.append((linker.lookup(f"r{i}", [_kv(keys=hashes)]),
                            linker.load(f"r{i}", [_kv(keys=hashes, device_indices=slots)]),
                            linker.offload([_kv(device_indices=slots, keys=hashes)])))
            took.append(time.monotonic() - t)
            time.sleep(0.3)
        assert max(took) < 0.5 + 0.5, took
        assert sum(t > 0.2 for t in took) <= 1, took
        # Misses: nothing to load, and offloads queued as SGLang needs, each to complete False.
        assert answers == [([], False, True)] * 4
        assert _completed(linker, 4) == 4
        assert [linker.pop_completed_offload() for _ in range(4)] == [False] * 4
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        linker.close()
        d.stop()


def test_a_load_whose_pin_ran_out_is_refused_before_it_starts(daemon_factory):
    """A load SGLang has started cannot be taken back (a failure is a 503), so the linker refuses
    one that may fail for want of its pin: once the lookup's pin is gone or nearly so, load()
    answers False and SGLang recomputes those pages instead."""
    d = daemon_factory()
    a, pool_a, alloc_a = _engine(d.address)
    b, pool_b, alloc_b = _engine(d.address, lookup_pin_ms=400)
    try:
        hashes, slots_a = _store(a, pool_a, alloc_a, 900, seed=5)
        slots_b = alloc_b.alloc(2 * PAGE)
        assert b.lookup("fresh", [_kv(keys=hashes)]) == [1, 2]
        assert b.load("fresh", [_kv(keys=hashes, device_indices=slots_b)]) is True  # pinned: started
        assert b.cancel_queued_load("fresh") is True
        assert b.lookup("late", [_kv(keys=hashes)]) == [1, 2]
        time.sleep(0.45)  # past the pin
        assert b.load("late", [_kv(keys=hashes, device_indices=slots_b)]) is False
        assert b.start_layer_wise_loading() == -1  # nothing was queued
    finally:
        a.close()
        b.close()


def test_a_reset_turns_the_linker_off_for_the_rest_of_the_process(daemon, caplog):
    """SGLang resets its cache (tree_cache.reset -> linker.reset) when it flushes it, as it does
    after an in-place weight update (update_weights_from_*, flush_cache true by default). The
    daemon's pages were computed by the old weights under the same KV space, and nothing on the
    wire says the weights changed: after a reset the linker finds nothing (so loads nothing) and
    stores nothing, saying so once at WARNING. Engines that were not reset keep their pages."""
    from kvclient.sglang.linker import storage_keys

    a, pool_a, alloc_a = _engine(daemon.address)
    b, pool_b, alloc_b = _engine(daemon.address)
    try:
        hashes, _ = _store(b, pool_b, alloc_b, 1200, seed=4)
        assert b.lookup("before", [_kv(keys=hashes)]) == [1, 2]
        with caplog.at_level("WARNING", logger="kvclient.sglang"):
            b.reset()
            b.reset()
        said = [r.getMessage() for r in caplog.records if r.name == "kvclient.sglang"]
        assert len(said) == 1 and "reset" in said[0] and "weights" in said[0], said
        assert b.lookup("after", [_kv(keys=hashes)]) == []
        slots = alloc_b.alloc(2 * PAGE)
        assert b.load("after", [_kv(keys=hashes, device_indices=slots)]) is False
        assert b.start_layer_wise_loading() == -1
        # KV computed after the reset is never stored under the old space's keys.
        fresh = _hashes(list(range(1300, 1300 + 2 * PAGE)))
        _fill(pool_b, slots, seed=5)
        assert b.offload([_kv(device_indices=slots, keys=fresh)]) is True  # by the transfers alone
        assert _completed(b, 1) == 1 and b.pop_completed_offload() is False
        assert a.client.lookup(storage_keys(fresh), key_bytes=32).pages == 0
        assert a.lookup("other", [_kv(keys=hashes)]) == [1, 2]  # an engine not reset: its pages
        assert b.lookup("later", [_kv(keys=hashes)]) == []
    finally:
        a.close()
        b.close()


def test_on_reset_keep_lets_a_flush_without_new_weights_keep_the_cache(daemon):
    """``on_reset`` "keep" (benchmarks' /flush_cache, which never comes with new weights): a reset
    only quiesces, and the pages stay hits; anything else than "stop" or "keep" is refused."""
    b, pool_b, alloc_b = _engine(daemon.address, on_reset="keep")
    try:
        hashes, _ = _store(b, pool_b, alloc_b, 1400, seed=6)
        b.reset()
        assert b.lookup("after", [_kv(keys=hashes)]) == [1, 2]
    finally:
        b.close()
    with pytest.raises(ValueError, match="on_reset"):
        _engine(daemon.address, on_reset="sometimes")


def _tp_engine(address: str, **extra):
    """Both TP ranks of one engine (tp_size 2: each registers its own part of the space)."""
    return [_engine(address, tp_rank=rank, tp_size=2, **extra) for rank in (0, 1)]


def _load_on_every_rank(ranks, rid: str, hashes) -> tuple[list[bool], list[bool], list]:
    """SGLang's calls on each rank: load_back's load, the prefill's start, the forward, finish.
    Returns (each rank's load answer, each rank's finish, each rank's slots)."""
    queued, landed, slots = [], [], []
    for linker, _, alloc in ranks:
        slots.append(alloc.alloc(len(hashes) * PAGE))
        queued.append(linker.load(rid, [_kv(keys=hashes, device_indices=slots[-1])]))
    for (linker, pool, _), ok in zip(ranks, queued, strict=True):
        if not ok:
            landed.append(True)  # nothing in flight: finish_loads is never entered
            continue
        index = linker.start_layer_wise_loading()
        linker.layer_done_counter.set_consumer(index)
        _forward(pool, [])
        landed.append(linker.finish_layer_wise_loading(index))
    return queued, landed, slots


def test_tp_ranks_answer_load_alike_and_a_rank_that_cannot_fails_the_batch_on_all(daemon):
    """SGLang's wrapper needs load()'s answer to depend on the transfers alone: every TP rank keeps
    its own in-flight loads and enters finish_loads' MIN all-reduce only with one, and a prefix
    that grew on some ranks only would be computed differently on the others. So with TP above 1
    a well-formed load is accepted on every rank; a rank that cannot serve it (its gate closed
    after a call that failed) fails its batch, and the MIN over the ranks' finish (SGLang's
    finish_loads) aborts the request on all of them. A rank whose lookup's pin ran out loads
    anyway: its pages are usually still there, and a refusal there would be a divergence."""
    writer = _tp_engine(daemon.address)
    gated = _tp_engine(daemon.address)
    late = _tp_engine(daemon.address, lookup_pin_ms=400)
    try:
        expect = []
        for rank, (a, pool, alloc) in enumerate(writer):
            hashes, slots = _store(a, pool, alloc, 1500, seed=10 + rank)
            expect.append(_rows(pool, slots))

        # 1. One rank's gate is closed (a call of its failed): both accept, the batch fails there.
        assert [b.lookup("r1", [_kv(keys=hashes)]) for b, _, _ in gated] == [[1, 2], [1, 2]]
        gated[1][0].away.first = 60.0  # no probe reopens it during the test
        gated[1][0].away.failed()
        queued, landed, _ = _load_on_every_rank(gated, "r1", hashes)
        assert queued == [True, True]
        assert landed == [True, False] and min(landed) is False  # SGLang aborts r1 on both ranks

        # 2. One rank's pin ran out before its load (its lookup came earlier): both load, bit-exact.
        b1 = late[1][0]
        assert b1.lookup("r2", [_kv(keys=hashes)]) == [1, 2]
        time.sleep(0.25)  # rank 1's pin has less than half its life left; rank 0's is fresh
        assert late[0][0].lookup("r2", [_kv(keys=hashes)]) == [1, 2]
        queued, landed, slots = _load_on_every_rank(late, "r2", hashes)
        assert queued == [True, True] and landed == [True, True]
        for rank, (_, pool, _) in enumerate(late):
            _assert_same_bytes(expect[rank], _rows(pool, slots[rank]))

        # 3. Malformed transfers are refused on every rank alike (their answer is the transfers').
        for b, _, alloc in gated:
            assert b.load("r3", [_kv(keys=hashes, device_indices=alloc.alloc(2 * PAGE) + 1)]) is False
    finally:
        for linker, _, _ in writer + gated + late:
            linker.close()
