"""SGLang 0.5.23's own classes import and construct in the CPU-only venv (tests/sglang_env.py).

Groundwork for the SGLang integration (issue 10): every object here is SGLang's, built on a CPU;
only triton, torchvision and IPython are stand-ins (tests/sglang_standins/). Skipped where
scripts/install_sglang.sh has not run.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time

import pytest
import sglang_env
import torch

if not sglang_env.sglang_installed():
    pytest.skip("sglang not installed (scripts/install_sglang.sh)", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _sglang():
    # Not at import: pytest imports every module at collection, and the stand-ins must not be
    # visible to the rest of the suite or to the processes it spawns.
    sglang_env.setup()
    yield
    sglang_env.restore()

# The abstract contract of 0.5.23: a linker that misses one of these cannot be built.
LINKER_ABSTRACT = {
    "lookup", "load", "start_layer_wise_loading", "finish_layer_wise_loading",
    "cancel_queued_load", "offload", "num_completed_offloads", "pop_completed_offload", "reset",
    "close",
}
STORAGE_ABSTRACT = {"get", "batch_get", "set", "batch_set", "exists"}


# ---- environment -----------------------------------------------------------------------------


def test_pinned_sglang_and_cpu_torch():
    from importlib.metadata import version

    import sglang

    assert version("sglang") == sglang_env.SGLANG_VERSION
    assert sglang.__version__ == sglang_env.SGLANG_VERSION
    assert torch.__version__.endswith("+cpu"), torch.__version__
    assert not torch.cuda.is_available()


def test_standins_are_standins_and_torch_sees_no_triton():
    import IPython
    import torchvision
    import triton
    from torch.utils._triton import has_triton, has_triton_package

    for mod in (triton, torchvision, IPython):
        assert getattr(mod, "KVSERVER_STANDIN", False), mod
        assert str(sglang_env.STANDINS) in mod.__file__
    # torch answered its triton probes before the stand-in was on sys.path.
    assert not has_triton_package() and not has_triton()

    @triton.jit
    def kernel(x):
        pass

    with pytest.raises(RuntimeError, match="stand-in"):
        kernel[(1,)](0)


def test_modules_import():
    import sglang.srt.mem_cache.hicache_storage as hs
    import sglang.srt.mem_cache.unified_cache.linker_factory as lf
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        UnifiedCacheLinker,
        UnifiedCacheLinkerWrapper,
    )

    assert callable(lf.create_unified_cache_linker)
    for name in ("HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "PoolName",
                 "PoolTransfer", "PoolHitPolicy", "PoolTransferResult"):
        assert hasattr(hs, name), name
    assert hs.PoolName.KV.value == "kv"
    assert set(UnifiedCacheLinker.__abstractmethods__) == LINKER_ABSTRACT
    assert set(hs.HiCacheStorage.__abstractmethods__) == STORAGE_ABSTRACT
    assert inspect.isclass(UnifiedCacheLinkerWrapper)


# ---- token pools -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pool_single_stage_on_cpu(kind):
    pool = sglang_env.mha_pool(layer_num=4) if kind == "mha" else sglang_env.mla_pool(layer_num=4)
    assert pool.device == "cpu"
    assert pool.start_layer == 0
    # Without an explicit end_layer SGLang stores layer_num - 1 (inclusive)...
    assert pool.end_layer == 3
    assert pool.model_layer_ids == (0, 1, 2, 3)
    bufs = [pool.k_buffer, pool.v_buffer] if kind == "mha" else [pool.kv_buffer]
    for buf in bufs:
        assert isinstance(buf, list) and len(buf) == 4
        # size + page_size rows: slot 0..page_size-1 is SGLang's padding page.
        assert buf[0].shape[0] == pool.size + pool.page_size
        assert buf[0].device.type == "cpu" and buf[0].dtype == torch.bfloat16
    if kind == "mha":
        assert tuple(pool.k_buffer[0].shape[1:]) == (pool.head_num, pool.head_dim)
    else:
        assert tuple(pool.kv_buffer[0].shape[1:]) == (1, pool.kv_lora_rank + pool.qk_rope_head_dim)
    # Distinct storage per layer.
    ptrs = {b.data_ptr() for buf in bufs for b in buf}
    assert len(ptrs) == 4 * len(bufs)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pool_pp_stage_uses_global_layer_ids(kind):
    pool = sglang_env.stage_pool(kind, 10, 3, 2)  # layers 6..9 of 10
    # ...while under PP the ModelRunner passes get_pp_indices' exclusive end.
    assert (pool.start_layer, pool.end_layer, pool.layer_num) == (6, 10, 4)
    assert pool.model_layer_ids == (6, 7, 8, 9)
    first = pool.get_key_buffer(6)
    expect = pool.k_buffer[0] if kind == "mha" else pool.kv_buffer[0]
    assert first.data_ptr() == expect.data_ptr()
    assert pool.get_key_buffer(9).data_ptr() == (
        pool.k_buffer[3] if kind == "mha" else pool.kv_buffer[3]).data_ptr()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_hicache_host_pool_mirrors_a_pp_stage_on_cpu(kind):
    dev = sglang_env.stage_pool(kind, 10, 2, 1)  # layers 5..9
    (info,) = dev.get_device_pool_infos()
    assert info.pool_name.value == "kv" and info.layer_ids == (5, 6, 7, 8, 9)
    host = sglang_env.host_pool(dev)
    assert (host.start_layer, host.end_layer, host.layer_num) == (5, 10, 5)
    assert host.layout == "page_first" and host.kv_buffer.device.type == "cpu"
    # page_first: the token axis before the layer axis (MHA has K and V in front).
    shape = tuple(host.kv_buffer.shape)
    if kind == "mha":
        assert shape == (2, host.size, 5, dev.head_num, dev.head_dim)
    else:
        assert shape == (host.size, 5, 1, dev.kv_lora_rank + dev.qk_rope_head_dim)


# ---- PP layer split --------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [10, 32])
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_pp_split(num_layers, pp_size, monkeypatch):
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    ranges = sglang_env.pp_split(num_layers, pp_size)
    assert len(ranges) == pp_size
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end == start
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1
    # The extra layers go to the last stages.
    assert sizes == sorted(sizes)


def test_pp_split_exact_values(monkeypatch):
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    assert sglang_env.pp_split(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert sglang_env.pp_split(32, 3) == [(0, 10), (10, 21), (21, 32)]
    assert sglang_env.pp_split(10, 2) == [(0, 5), (5, 10)]
    assert sglang_env.pp_split(32, 1) == [(0, 32)]
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "2,8")
    assert sglang_env.pp_split(10, 2) == [(0, 2), (2, 10)]


# ---- LayerWiseLoadCounter with a real pool's wait hook ---------------------------------------


def test_layer_wise_load_counter_cycle_through_pool():
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter

    pool = sglang_env.stage_pool("mha", 10, 2, 1)  # layers 5..9
    counter = LayerWiseLoadCounter(pool.layer_num)
    pool.register_layer_transfer_counter(counter)
    assert pool.layer_transfer_counter is counter

    index = counter.update_producer()
    counter.set_consumer(index)
    released = []

    def attention():
        for layer_id in pool.model_layer_ids:  # global ids, as the attention layers pass them
            pool.get_key_buffer(layer_id)
            released.append(layer_id)

    t = threading.Thread(target=attention)
    t.start()
    time.sleep(0.05)
    assert released == []  # blocked on local layer 0
    for local in range(pool.layer_num):
        counter.complete(index, local)  # the loader reports local layer ids
        deadline = time.monotonic() + 2
        while len(released) <= local and time.monotonic() < deadline:
            time.sleep(0.001)
        assert released == list(pool.model_layer_ids[: local + 1])
    t.join(2)
    assert counter.finish(index) is True
    assert index not in counter.futures

    # A failed layer does not raise into the forward; finish() reports it.
    index = counter.update_producer()
    counter.set_consumer(index)
    counter.complete(index, 0)
    counter.fail(index, RuntimeError("daemon gone"))
    pool.get_key_buffer(9)
    assert counter.finish(index) is False
    counter.reset()
    assert (counter.producer_index, counter.consumer_index) == (-1, -1)
    pool.get_key_buffer(5)  # no batch registered: no wait


# ---- linker factory, ServerArgs, CacheInitParams ---------------------------------------------


# SGLang-derived classes for the factories, which find them by name in this module (the linker
# factory and StorageBackendFactory import `linker_module_path` / `module_path` and getattr the
# class). Built on first use, after setup(): a module-level subclass would import sglang at
# collection time.
FIXTURE_CLASSES = ("HalfLinker", "WholeLinker", "NotALinker", "MinimalStorage")


@functools.cache
def _fixture_classes() -> dict[str, type]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
        UnifiedCacheLinker,
    )

    class HalfLinker(UnifiedCacheLinker):
        """Misses most of the contract: the factory must refuse it."""

        def __init__(self, *args, **kwargs):
            raise AssertionError("must not be constructed")

        def lookup(self, rid, transfers):
            return []


    class WholeLinker(UnifiedCacheLinker):
        """Every abstract method, doing nothing: only to see what the factory passes."""

        def __init__(self, server_args, params, *, components, extra_config, forward_stream=None):
            self.got = (server_args, params, components, extra_config, forward_stream)
            self.layer_done_counter = LayerWiseLoadCounter(params.token_to_kv_pool_allocator
                                                           .get_kvcache().layer_num)
            self.pools = {}
            self.forward_stream = forward_stream

        def lookup(self, rid, transfers):
            return []

        def load(self, rid, transfers):
            return False

        def start_layer_wise_loading(self):
            return -1

        def finish_layer_wise_loading(self, counter_index):
            return True

        def cancel_queued_load(self, rid):
            return False

        def offload(self, transfers, session_id=None):
            return False

        def num_completed_offloads(self):
            return 0

        def pop_completed_offload(self):
            return False

        def reset(self):
            pass

        def close(self):
            pass


    class NotALinker:
        pass

    class MinimalStorage(HiCacheStorage):
        """Only HiCacheStorage's abstract methods, doing nothing: to see what the factory passes."""

        def __init__(self, storage_config, kwargs=None):
            self.storage_config, self.kwargs = storage_config, kwargs

        def get(self, key, target_location=None, target_sizes=None):
            return None

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            return [None] * len(keys)

        def set(self, key, value=None, target_location=None, target_sizes=None):
            return False

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            return False

        def exists(self, key):
            return False

    return {name: value for name, value in locals().items() if name in FIXTURE_CLASSES}


def __getattr__(name):
    if name in FIXTURE_CLASSES:
        return _fixture_classes()[name]
    raise AttributeError(name)


def _factory(linker_name, extra=None):
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    params = sglang_env.cache_init_params(sglang_env.mha_pool(layer_num=4))
    config = {"linker": linker_name, "linker_module_path": __name__}
    if extra is not None:
        config["linker_extra_config"] = extra
    linker = create_unified_cache_linker(
        sglang_env.server_args(), params, backend="dynamic", config=config,
        components={ComponentType.FULL},
    )
    return linker, params


def test_factory_rejects_abstract_subclass():
    with pytest.raises(ValueError, match="must implement all UnifiedCacheLinker methods") as e:
        _factory("HalfLinker")
    for name in LINKER_ABSTRACT - {"lookup"}:
        assert name in str(e.value)


def test_factory_rejects_non_subclass_and_bad_config():
    with pytest.raises(ValueError, match="must be a UnifiedCacheLinker subclass"):
        _factory("NotALinker")
    with pytest.raises(ValueError, match="must be a JSON object"):
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

        create_unified_cache_linker(None, None, backend="dynamic", config="x", components=set())
    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig

    with pytest.raises(ValueError, match="unknown fields"):
        UnifiedCacheLinkerConfig.from_dict({"linker": "a", "linker_module_path": "b", "x": 1})


def test_factory_builds_complete_subclass_with_its_arguments():
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.server_args import ServerArgs

    extra = {"address": "unix:///tmp/kvserver.sock"}
    linker, params = _factory("WholeLinker", extra)
    server_args, got_params, components, extra_config, forward_stream = linker.got
    assert isinstance(server_args, ServerArgs) and got_params is params
    assert components == {ComponentType.FULL}
    assert extra_config == extra and extra_config is not extra  # deep-copied
    assert forward_stream is None
    # The base class's offload gate works on a CPU too (torch.cpu.Event; no forward stream).
    assert len(linker.record_offload_ready()) == 1


def test_server_args_and_cache_init_params_construct_on_cpu():
    sa = sglang_env.server_args(page_size=16, pp_size=2)
    assert sa.model_path == "dummy" and sa.page_size == 16 and sa.pp_size == 2
    for name in ("enable_unified_cache_external_linker", "unified_cache_external_linker_backend",
                 "unified_cache_external_linker_config", "hicache_storage_backend",
                 "hicache_storage_backend_extra_config"):
        assert hasattr(sa, name), name
    pool = sglang_env.stage_pool("mla", 32, 3, 1)
    params = sglang_env.cache_init_params(pool, pp_rank=1, pp_size=3)
    assert params.token_to_kv_pool_allocator.get_kvcache() is pool
    assert (params.pp_rank, params.pp_size, params.page_size) == (1, 3, 16)
    # SGLang's paged allocator runs on a CPU (no Triton path there); page 0 is padding.
    alloc = params.token_to_kv_pool_allocator
    assert not alloc.use_triton_kernels
    slots = alloc.alloc(32)
    assert slots.tolist() == list(range(16, 48)) and alloc.available_size() == pool.size - 32
    alloc.free(slots)
    assert alloc.available_size() == pool.size


def test_unified_radix_cache_takes_a_linker_on_cpu():
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinkerWrapper

    linker, params = _factory("WholeLinker")
    cache = sglang_env.unified_radix_cache(params)
    cache.init_cache_linker(linker)
    assert isinstance(cache.linker, UnifiedCacheLinkerWrapper)
    assert cache.linker.layer_done_counter is linker.layer_done_counter
    assert cache.linker.num_completed_offloads() == 0
    cache.reset()
    cache.release_host_resources()


# ---- HiCacheStorage --------------------------------------------------------------------------


def test_hicache_storage_dynamic_backend_constructs():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m",
        extra_config={"backend_name": "kvserver", "module_path": __name__,
                      "class_name": "MinimalStorage", "interface_v1": 1},
    )
    assert cfg.is_storage_writer  # MLA: rank 0 writes
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert type(backend) is _fixture_classes()["MinimalStorage"]
    # The dynamic factory passes (storage_config, kwargs): kwargs is a dict, positional.
    assert backend.storage_config is cfg and backend.kwargs == {}
    assert backend.batch_exists(["a", "b"]) == 0  # default: exists() page by page
    assert backend.batch_get_v1(["a"], torch.zeros(1)) is None  # base returns nothing: override it


def test_storage_page_hashes_chain_on_cpu():
    # The keys a linker/backend receives: one 64-hex SHA-256 per page, each chained on the previous.
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = list(range(48))
    full = get_storage_hash_str(tokens, None, page_size=16)
    assert len(full) == 3 and all(len(h) == 64 and int(h, 16) >= 0 for h in full)
    assert get_storage_hash_str(tokens[16:], full[0], page_size=16) == full[1:]
    # A trailing partial page gets a hash too: SGLang's callers cut keys to whole pages first.
    partial = get_storage_hash_str(tokens[:20], None, page_size=16)
    assert len(partial) == 2 and partial[0] == full[0] and partial[1] != full[1]


def test_restore_hides_the_standins_from_everything_else():
    import importlib
    import os
    import sys

    sglang_env.restore()
    try:
        assert str(sglang_env.STANDINS) not in sys.path
        assert "triton" not in sys.modules and "torchvision" not in sys.modules
        with pytest.raises(ImportError):
            importlib.import_module("triton")
        # import sglang set it (to ~/.cache/sglang/triton); restore() put os.environ back.
        assert "sglang" not in os.environ.get("TRITON_CACHE_DIR", "")
    finally:
        sglang_env.setup()
    assert importlib.import_module("triton").KVSERVER_STANDIN
