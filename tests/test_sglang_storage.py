"""kvclient.sglang.storage.KVServerStorage against SGLang 0.5.23's real classes and a real daemon.

The backend is built as SGLang's cache controller builds it: the storage config from
HiCacheController._generate_storage_config, StorageBackendFactory.create_backend("dynamic", ...),
register_mem_pool_host, on_host_pools_registered; the host pools are SGLang's own
MHATokenToKVPoolHost / MLATokenToKVPoolHost on the CPU. Skipped where scripts/install_sglang.sh
has not run.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import sglang_env
import torch
from conftest import DaemonThread

from kvclient.errors import KVClientError

if not sglang_env.sglang_installed():
    pytest.skip("sglang not installed (scripts/install_sglang.sh)", allow_module_level=True)

PAGE = 16
MODULE = "kvclient.sglang.storage"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@pytest.fixture(scope="module", autouse=True)
def _sglang():
    sglang_env.setup()
    yield
    sglang_env.restore()


# ---- SGLang's objects -------------------------------------------------------------------------


def _storage_config(device_pool, host, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, metrics=False,
                    model="sglang-test", **extra):
    """The HiCacheStorageConfig SGLang's cache controller builds (its own
    _generate_storage_config, with this rank's place in the parallel groups), with the JSON of
    --hicache-storage-backend-extra-config as extra_config."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    controller = SimpleNamespace(mem_pool_device=device_pool, mem_pool_host=host, storage_host_pool=host,
                                 enable_storage_metrics=metrics, get_attn_cp_rank_and_size=lambda: (0, 1))
    extra_config = {"backend_name": "kvserver", "module_path": MODULE, "class_name": "KVServerStorage",
                    "interface_v1": 1, **extra}
    with get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                 attn_dcp_size=1, attn_dcp_rank=0):
        return HiCacheController._generate_storage_config(controller, model, extra_config)


def _attach(config, host):
    """What HiCacheController.attach_storage_backend does with the backend."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def _device_pool(kind="mha", *, num_layers=10, pp_size=1, pp_rank=0, dtype=None, size=512):
    return sglang_env.stage_pool(kind, num_layers, pp_size, pp_rank, size=size, page_size=PAGE, dtype=dtype)


def _engine(address, kind="mha", *, layout="page_first", num_layers=10, pp_size=1, pp_rank=0, kv_dtype=None,
            tp_rank=0, tp_size=1, device_pool=None, ratio=1.5, metrics=False, **extra):
    """One engine's host pool and its backend, over the daemon at ``address``; ``extra`` is the
    rest of the extra_config JSON."""
    dev = device_pool if device_pool is not None else _device_pool(
        kind, num_layers=num_layers or 10, pp_size=pp_size, pp_rank=pp_rank, dtype=kv_dtype)
    host = sglang_env.host_pool(dev, layout=layout, ratio=ratio)
    if num_layers is not None:  # None: the backend works it out (the last PP stage can)
        extra.setdefault("num_layers", num_layers)
    config = _storage_config(dev, host, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                             metrics=metrics, address=address, timeout_s=2.0, **extra)
    return _attach(config, host), host


def _hashes(n, seed=0):
    """n chained SGLang storage hashes (64 hex digits) of whole pages."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = list(range(10_000 * seed, 10_000 * seed + n * PAGE))
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def _slots(pages):
    """Host token indices of whole pages, as the controller passes them."""
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _randomize(host, seed):
    """Random bytes in the whole host pool (fp8 pools too: bytes, not values)."""
    raw = host.kv_buffer.view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _is_mla(host):
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return isinstance(host, MLATokenToKVPoolHost)


def _token(host, layer, part, token):
    """[heads, dim] of (local layer, part, token) where SGLang's init_kv_buffer puts it."""
    kv, ps = host.kv_buffer, host.page_size
    if _is_mla(host):
        return {"layer_first": lambda: kv[layer, token], "page_first": lambda: kv[token, layer],
                "page_first_direct": lambda: kv[token // ps, layer, token % ps]}[host.layout]()
    return {"layer_first": lambda: kv[part, layer, token], "page_first": lambda: kv[part, token, layer],
            "page_first_direct": lambda: kv[part, token // ps, layer, token % ps]}[host.layout]()


def _page_bytes(host, page):
    """Every byte of one host page, in (layer, part, token) order, read SGLang's way."""
    parts = 1 if _is_mla(host) else 2
    rows = [_token(host, layer, part, page * PAGE + t).reshape(-1)
            for layer in range(host.target_layer_num) for part in range(parts) for t in range(PAGE)]
    return torch.stack(rows).view(torch.uint8)


def _same_pages(host_a, pages_a, host_b, pages_b):
    for pa, pb in zip(pages_a, pages_b, strict=True):
        assert torch.equal(_page_bytes(host_a, pa), _page_bytes(host_b, pb)), (pa, pb)


# ---- contract ---------------------------------------------------------------------------------

# The pinned version's abstract methods and the v1 methods the controller calls with interface_v1.
PINNED_ABSTRACT = {"get", "batch_get", "set", "batch_set", "exists"}
V1 = ("batch_get_v1", "batch_set_v1", "batch_exists")
ALSO = ("register_mem_pool_host", "register_mem_host_pool_v2", "batch_exists_v2", "batch_get_v2",
        "batch_set_v2", "clear", "get_stats")


def test_contract_real_base_real_signatures():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from kvclient.sglang.storage import KVServerStorage

    assert issubclass(KVServerStorage, HiCacheStorage)
    assert not inspect.isabstract(KVServerStorage) and not KVServerStorage.__abstractmethods__
    # A method missing upstream (renamed, removed) or a new abstract one fails here.
    assert set(HiCacheStorage.__abstractmethods__) == PINNED_ABSTRACT
    for name in (*sorted(PINNED_ABSTRACT), *V1, *ALSO):
        base = getattr(HiCacheStorage, name)
        mine = getattr(KVServerStorage, name)
        assert mine is not base, f"{name} is not implemented"
        # Both modules use postponed annotations: the strings must be SGLang's own spelling.
        assert str(inspect.signature(mine)) == str(inspect.signature(base)), name
    assert callable(KVServerStorage.close)
    # The factory calls backend_class(storage_config, kwargs) with kwargs a positional dict.
    params = list(inspect.signature(KVServerStorage.__init__).parameters)
    assert params == ["self", "storage_config", "kwargs"]


def test_the_factory_builds_it_from_the_extra_config_json(daemon):
    from kvclient.sglang.storage import KVServerStorage

    backend, host = _engine(daemon.address, pp_size=2, pp_rank=1, num_layers=None)
    try:
        assert type(backend) is KVServerStorage
        assert backend.storage_config.extra_config["address"] == daemon.address
        reg = backend._registrar.kwargs
        # The last stage knows the model's layer count from its own end.
        assert (reg["start_layer"], reg["end_layer"], reg["num_layers"]) == (5, 10, 10)
        assert (reg["pp_rank"], reg["pp_size"], reg["tp_rank"], reg["tp_size"]) == (1, 2, 0, 1)
        assert reg["host_tokens"] == 0 and reg["page_size"] == PAGE and reg["model"] == "sglang-test"
        assert backend.staging.pool.num_tokens == 128 * PAGE  # STORAGE_BATCH_SIZE pages
        assert backend.client.connected
        assert backend.get_stats() is None  # no --enable-storage-metrics
    finally:
        backend.close()


def test_engines_of_other_weights_never_share(daemon):
    """extra_config weights (else SGLang's model path, revision and quantisation) is part of the
    KV space: the same model name with other weights finds nothing."""
    keys = _hashes(2, seed=4)
    a, host_a = _engine(daemon.address, weights="rev-a")
    b, _ = _engine(daemon.address, weights="rev-b")
    c, _ = _engine(daemon.address, weights="rev-a")
    try:
        assert a._registrar.kwargs["weights"] == "rev-a"
        _randomize(host_a, seed=1)
        assert a.batch_set_v1(keys, _slots([3, 4])) == [True] * 2
        assert b.batch_get_v1(keys, _slots([6, 7])) == [False] * 2
        assert c.batch_get_v1(keys, _slots([6, 7])) == [True] * 2
        spaces = {s.space.weights for s in a.client.stats().spaces if s.space.model == "sglang-test"}
        assert {"rev-a", "rev-b"} <= spaces
    finally:
        for backend in (a, b, c):
            backend.close()


def test_configuration_errors_raise_at_registration(daemon):
    # A host layout kvserver does not copy.
    dev = _device_pool()
    host = sglang_env.host_pool(dev, layout="page_head")
    config = _storage_config(dev, host, address=daemon.address)
    with pytest.raises(ValueError, match="'page_head'"):
        _attach(config, host)
    # A stage that is not the last cannot know the layer count.
    with pytest.raises(ValueError, match="num_layers"):
        _engine(daemon.address, pp_size=2, pp_rank=0, num_layers=None)
    # An fp8 host pool stores uint8: which fp8 must be said.
    with pytest.raises(ValueError, match="dtype"):
        _engine(daemon.address, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not match"):
        _engine(daemon.address, dtype="fp8_e4m3")  # a bf16 pool
    # More layers than the model has.
    with pytest.raises(ValueError, match="below this stage's layers"):
        _engine(daemon.address, pp_size=2, pp_rank=1, num_layers=10,
                device_pool=_device_pool(num_layers=12, pp_size=2, pp_rank=1))
    # A refusal by the daemon that is not its absence raises too (here: a model name over 256).
    with pytest.raises(KVClientError) as err:
        _engine(daemon.address, model="m" * 300)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value


# ---- behaviour --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,dtype", [("mha", None), ("mla", None), ("mha", "fp8"), ("mla", "fp8")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_engines_share_pages_bit_exact(daemon, kind, dtype, layout):
    """Engine A stores random pages from its host pool; engine B, with another host layout, sees
    them and loads them bit-exact into other host pages of its own pool."""
    fp8 = {"dtype": "fp8_e4m3"} if dtype else {}
    torch_dtype = torch.float8_e4m3fn if dtype else None
    other = LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)]
    a, host_a = _engine(daemon.address, kind, layout=layout, kv_dtype=torch_dtype, **fp8)
    b, host_b = _engine(daemon.address, kind, layout=other, kv_dtype=torch_dtype, **fp8)
    try:
        if dtype:
            assert host_a.kv_buffer.dtype == torch.uint8 and a.staging.pool.dtype == torch.float8_e4m3fn
        _randomize(host_a, seed=1)
        _randomize(host_b, seed=2)
        keys = _hashes(5, seed=3)
        pages_a, pages_b = [7, 2, 30, 11, 4], [1, 9, 3, 20, 14]
        assert b.batch_exists(keys) == 0
        assert a.batch_set_v1(keys, _slots(pages_a)) == [True] * 5
        # What the daemon copied is each token where SGLang's own layout keeps it.
        staging = a.staging.pool
        for i, page in enumerate(pages_a):
            for layer in range(host_a.target_layer_num):
                for part in range(1 if kind == "mla" else 2):
                    got = staging.buffers[layer][part][i * PAGE:(i + 1) * PAGE].view(torch.uint8)
                    want = torch.stack([_token(host_a, layer, part, page * PAGE + t) for t in range(PAGE)])
                    assert torch.equal(got, want.view(torch.uint8)), (page, layer, part)
        before = [_page_bytes(host_b, p) for p in range(host_b.page_num)]
        assert b.batch_exists(keys) == 5 and b.exists(keys[0])
        assert b.batch_get_v1(keys, _slots(pages_b)) == [True] * 5
        _same_pages(host_a, pages_a, host_b, pages_b)
        untouched = set(range(host_b.page_num)) - set(pages_b)
        assert all(torch.equal(before[p], _page_bytes(host_b, p)) for p in untouched)
        # Stored once: A's second store finds every page present.
        assert a.batch_set_v1(keys, _slots(pages_a)) == [True] * 5
    finally:
        a.close()
        b.close()


def _controller(address, **extra):
    """SGLang's own HiCacheController with the backend attached at construction, as the radix
    cache builds it (--hicache-storage-backend dynamic and the extra-config JSON)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    dev = _device_pool(num_layers=4, size=256)
    host = sglang_env.host_pool(dev)
    params = sglang_env.cache_init_params(dev)
    config = {"backend_name": "kvserver", "module_path": MODULE, "class_name": "KVServerStorage",
              "interface_v1": 1, "address": address, "timeout_s": 2.0, **extra}
    ranks = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    with get_parallel().override(**ranks):
        controller = HiCacheController(params.token_to_kv_pool_allocator, host, PAGE, None, threading.Event(),
                                       storage_backend="dynamic", model_name="sglang-test",
                                       storage_backend_extra_config=config)
    return controller, host


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_sglangs_cache_controller_backs_up_prefetches_and_detaches(daemon, interface_v1):
    """SGLang's controller and its threads: the backup thread stores a prefix (batch_set_v1, or
    batch_set of flat pages without interface_v1), another engine's prefetch thread finds it
    (batch_exists) and its io thread loads it (batch_get_v1, or batch_get); detach closes the
    backend."""
    from kvclient.sglang.storage import KVServerStorage

    a, host_a = _controller(daemon.address, interface_v1=interface_v1)
    b, host_b = _controller(daemon.address, interface_v1=interface_v1)
    backends = [a.storage_backend, b.storage_backend]
    try:
        assert all(type(x) is KVServerStorage for x in backends)
        zero_copy = "_page_get_zero_copy" if interface_v1 else "_generic_page_get"
        assert a.page_get_func.__name__ == zero_copy
        assert backends[0].client.connected and backends[0].staging is not None
        tokens = list(range(5 * PAGE))
        slots_a = host_a.alloc(5 * PAGE)
        _randomize(host_a, seed=50)
        a.write_storage(slots_a, tokens, hash_value=_hashes_of(tokens), prefix_keys=[])
        assert a.ack_backup_queue.get(timeout=20).completed_tokens == 5 * PAGE

        b.prefetch("r", tokens, None, [])
        hit = b.prefetch_hit_queue.get(timeout=20)
        assert hit.storage_hit_count == 5 * PAGE and hit.hash_value == _hashes_of(tokens)
        hit.host_indices = host_b.alloc(5 * PAGE)
        b.prefetch_buffer.put(hit)
        acks = [b.ack_prefetch_queue.get(timeout=20)]
        while not getattr(acks[-1], "completed_req", False):
            acks.append(b.ack_prefetch_queue.get(timeout=20))
        assert [x.completed_tokens for x in acks[:-1]] == [5 * PAGE]
        pages_a = (slots_a[::PAGE] // PAGE).tolist()
        pages_b = (hit.host_indices[::PAGE] // PAGE).tolist()
        _same_pages(host_a, pages_a, host_b, pages_b)
    finally:
        a.detach_storage_backend()
        b.detach_storage_backend()
    assert all(x.staging is None and x._closed for x in backends)


def test_the_controllers_order_partial_hit(daemon):
    """SGLang's own controller loops (_storage_hit_query: batch_exists in batches of 128 pages
    with prefix keys; _page_transfer: batch_get_v1 per batch, counted up to the first False)
    over a prefix stored only in part: the counts stop at the first missing page, and the host
    pages after the stored prefix are untouched."""
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation

    a, host_a = _engine(daemon.address, ratio=12.0)
    b, host_b = _engine(daemon.address, ratio=12.0)
    calls = []
    real_exists = b.batch_exists

    def exists(keys, extra_info=None):
        calls.append((len(keys), extra_info.prefix_keys is not None if extra_info else None))
        return real_exists(keys, extra_info)

    b.batch_exists = exists
    try:
        tokens = list(range(300 * PAGE))
        _randomize(host_a, seed=4)
        # Engine A backs up the first 150 pages through the controller's backup loop.
        ctl_a = SimpleNamespace(page_size=PAGE, storage_backend=a)
        ctl_a.page_set_func = lambda *args: HiCacheController._page_set_zero_copy(ctl_a, *args)
        hashes = _hashes_of(tokens)
        backup = StorageOperation(_slots(range(1, 151)), tokens[: 150 * PAGE], hash_value=hashes[:150],
                                  prefix_keys=[])
        HiCacheController._page_backup(ctl_a, backup)
        assert backup.completed_tokens == 150 * PAGE

        # Engine B's prefetch of all 300 pages.
        ctl_b = SimpleNamespace(page_size=PAGE, storage_backend=b)
        op = PrefetchOperation("r", tokens, None, prefix_keys=[])
        hit_hashes, hit_tokens = HiCacheController._storage_hit_query(ctl_b, op)
        assert hit_tokens == 150 * PAGE and hit_hashes == hashes[:150]
        assert calls == [(128, True), (128, True)]  # batches of 128; stops at the short one

        # The transfer of a longer list than is stored (the hit was 150; ask 200).
        _randomize(host_b, seed=5)
        before = [_page_bytes(host_b, p) for p in range(151, 251)]
        ctl_b.prefetch_sync_queue = SimpleNamespace(put=lambda ack: None)
        ctl_b.page_get_func = lambda *args: HiCacheController._page_get_zero_copy(ctl_b, *args)
        ctl_b._page_transfer_kv_batch = lambda *args: HiCacheController._page_transfer_kv_batch(ctl_b, *args)
        op.hash_value = hashes[:200]
        op.host_indices = _slots(range(51, 251))
        assert HiCacheController._page_transfer(ctl_b, op) == 150
        _same_pages(host_a, range(1, 151), host_b, range(51, 201))
        after = [_page_bytes(host_b, p) for p in range(201, 251)]
        assert all(torch.equal(x, y) for x, y in zip(before[50:], after, strict=True))
        # batch_get_v1 itself: True for the stored prefix, False after.
        results = b.batch_get_v1(hashes[140:160], _slots(range(260, 280)))
        assert results == [True] * 10 + [False] * 10
    finally:
        a.close()
        b.close()


def _hashes_of(tokens):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=PAGE)


def test_mla_tp2_rank1_stores_nothing_and_reads_rank0s_pages(daemon):
    dev = _device_pool("mla")
    rank0, host0 = _engine(daemon.address, "mla", tp_rank=0, tp_size=2, device_pool=dev)
    rank1, host1 = _engine(daemon.address, "mla", tp_rank=1, tp_size=2, device_pool=_device_pool("mla"))
    try:
        assert rank0.storage_config.is_storage_writer and not rank1.storage_config.is_storage_writer
        _randomize(host0, seed=6)
        _randomize(host1, seed=7)
        keys = _hashes(4, seed=8)
        # Rank 1 first: True (the writer stores them), but nothing is written.
        assert rank1.batch_set_v1(keys, _slots([1, 2, 3, 4])) == [True] * 4
        assert rank1.batch_exists(keys) == 0
        assert rank0.batch_set_v1(keys, _slots([5, 6, 7, 8])) == [True] * 4
        space = _cache_space(rank0)
        assert space.counters.pages == 4, "MLA is stored once across TP ranks"
        assert rank1.batch_exists(keys) == 4
        assert rank1.batch_get_v1(keys, _slots([10, 11, 12, 13])) == [True] * 4
        _same_pages(host0, [5, 6, 7, 8], host1, [10, 11, 12, 13])
    finally:
        rank0.close()
        rank1.close()


def _cache_space(backend, model="sglang-test"):
    """The daemon's Stats entry of the test model's KV space (the backend's own tenant)."""
    stats = backend.client.stats()
    spaces = [s for s in stats.spaces if s.space.model == model]
    assert len(spaces) == 1, stats.spaces
    return spaces[0]


@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_every_pp_stage_stores_and_loads_its_own_layers(daemon, pp_size, caplog):
    """SGLang's own split (get_pp_indices) of 10 layers: each stage's two engines share pages
    over the stage's global layers; a page is complete once every stage holds it."""
    ranges = sglang_env.pp_split(10, pp_size)
    keys = _hashes(3, seed=9)
    for rank, (start, end) in enumerate(ranges):
        a, host_a = _engine(daemon.address, num_layers=10, pp_size=pp_size, pp_rank=rank)
        b, host_b = _engine(daemon.address, num_layers=10, pp_size=pp_size, pp_rank=rank)
        try:
            assert host_a.target_layer_num == end - start and host_a.start_layer == start
            reg = a._registrar.kwargs
            assert (reg["start_layer"], reg["end_layer"], reg["num_layers"]) == (start, end, 10)
            _randomize(host_a, seed=rank)
            assert a.batch_set_v1(keys, _slots([3, 4, 5])) == [True] * 3
            assert b.batch_get_v1(keys, _slots([6, 7, 8])) == [True] * 3
            _same_pages(host_a, [3, 4, 5], host_b, [6, 7, 8])
            space = _cache_space(a)
            assert space.parts_seen == rank + 1
            assert space.complete_pages == (3 if rank == pp_size - 1 else 0)
        finally:
            a.close()
            b.close()
    if pp_size == 1:
        return
    # A backend whose host pool claims other layers for a stage fixed by a registration that
    # stands: refused (the daemon names both ranges), and every call misses.
    start, end = ranges[1]
    holder, _ = _engine(daemon.address, num_layers=10, pp_size=pp_size, pp_rank=1)
    wrong = sglang_env.mha_pool(layer_num=end - start + 1, start_layer=start - 1, end_layer=end, size=512,
                                page_size=PAGE)
    with caplog.at_level(logging.WARNING):
        odd, host_odd = _engine(daemon.address, num_layers=10, pp_size=pp_size, pp_rank=1, device_pool=wrong)
    try:
        refusals = [r.getMessage() for r in caplog.records if "FAILED_PRECONDITION" in r.getMessage()]
        assert refusals, caplog.text
        assert f"[{start}, {end})" in refusals[0] and f"[{start - 1}, {end})" in refusals[0], refusals[0]
        assert odd.batch_exists(keys) == 0
        assert odd.batch_set_v1(keys, _slots([1, 2, 3])) == [False] * 3
        assert odd.batch_get_v1(keys, _slots([1, 2, 3])) == [False] * 3
    finally:
        odd.close()
        holder.close()


def test_daemon_stops_and_comes_back(daemon_factory):
    """The daemon stops mid-run: every call misses, none raises into SGLang. It comes back on the
    same socket (empty): the backend stores and hits again."""
    d = daemon_factory()
    a, host_a = _engine(d.address, retry_register_s=0.0)
    b, host_b = _engine(d.address, retry_register_s=0.0)
    again = None
    try:
        _randomize(host_a, seed=10)
        keys = _hashes(3, seed=11)
        assert a.batch_set_v1(keys, _slots([1, 2, 3])) == [True] * 3
        assert b.batch_exists(keys) == 3

        d.stop()

        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, _slots([4, 5, 6])) == [False] * 3
        assert a.batch_set_v1(keys, _slots([1, 2, 3])) == [False] * 3
        assert b.batch_get([keys[0]], [host_b.get_dummy_flat_data_page()]) == [None]

        again = DaemonThread(d.config)
        deadline = time.monotonic() + 20
        stored = False
        while not stored and time.monotonic() < deadline:
            stored = a.batch_set_v1(keys, _slots([1, 2, 3])) == [True] * 3
            if not stored:
                time.sleep(0.2)
        assert stored, "A never stored again after the daemon came back"
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, _slots([4, 5, 6])) == [True] * 3
        _same_pages(host_a, [1, 2, 3], host_b, [4, 5, 6])
    finally:
        a.close()
        b.close()
        if again is not None:
            again.stop()


def test_a_kept_cache_answers_sglang_after_its_daemon_restarts(daemon_factory):
    """--host-memory-dir: pages an engine stored before the daemon stopped are found by an engine
    that starts after the new daemon did, with nothing stored since, bit-exact; the engine that
    stored them finds them too once its backend has registered again."""
    kept = f"/dev/shm/kvserver-test-sglang-kept-{os.getpid()}-{os.urandom(3).hex()}"
    d = daemon_factory(host_memory_dir=kept)
    a, host_a = _engine(d.address, retry_register_s=0.0)
    b = again = None
    try:
        _randomize(host_a, seed=20)
        keys = _hashes(3, seed=21)
        assert a.batch_set_v1(keys, _slots([1, 2, 3])) == [True] * 3
        d.stop()
        again = DaemonThread(d.config)
        assert again.run(lambda: again.core.recovery.adopted_pages) == 3
        b, host_b = _engine(d.address, retry_register_s=0.0)
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, _slots([4, 5, 6])) == [True] * 3
        _same_pages(host_a, [1, 2, 3], host_b, [4, 5, 6])
        deadline = time.monotonic() + 20
        while a.batch_exists(keys) != 3:
            assert time.monotonic() < deadline, "the first engine never found its pages again"
            time.sleep(0.2)
    finally:
        a.close()
        if b is not None:
            b.close()
        if again is not None:
            again.stop()
        shutil.rmtree(kept, ignore_errors=True)


def test_no_daemon_at_startup_constructs_and_misses(socket_dir):
    backend, host = _engine(f"unix://{socket_dir}/absent.sock", retry_register_s=60.0)
    try:
        keys = _hashes(2)
        assert not backend.client.connected
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, _slots([1, 2])) == [False, False]
        assert backend.batch_set_v1(keys, _slots([1, 2])) == [False, False]
        assert backend.get(keys[0], host.get_dummy_flat_data_page()) is None
        assert backend.set(keys[0], host.get_data_page(PAGE)) is False
    finally:
        backend.close()


@pytest.mark.parametrize("one_copy", [True, False])
def test_a_chunked_call_round_trips(daemon, monkeypatch, one_copy):
    """More keys than staging pages: done chunk by chunk, a partial hit stops mid-chunk. Also with
    the gather's fallback (one copy per layer and part, for a torch whose index_select would not
    write a strided chunk)."""
    from kvclient.sglang import storage

    monkeypatch.setattr(storage, "_strided_out_ok", lambda: one_copy)
    a, host_a = _engine(daemon.address, staging_pages=4)
    b, host_b = _engine(daemon.address, staging_pages=3, ratio=3.0)
    try:
        assert a.staging.pool.num_tokens == 4 * PAGE
        _randomize(host_a, seed=12)
        keys = _hashes(10, seed=13)
        assert a.batch_set_v1(keys, _slots(range(1, 11))) == [True] * 10
        assert b.batch_get_v1(keys, _slots(range(20, 30))) == [True] * 10
        _same_pages(host_a, range(1, 11), host_b, range(20, 30))
        more = keys + _hashes(20, seed=14)[10:]
        assert b.batch_exists(more) == 10
        assert b.batch_get_v1(more, _slots(range(30, 50))) == [True] * 10 + [False] * 10
    finally:
        a.close()
        b.close()


def test_the_old_interface_with_flat_pages(daemon):
    """get/set/batch_get/batch_set with flat page tensors (SGLang's generic path without
    interface_v1: get_data_page, get_dummy_flat_data_page, set_from_flat_data_page)."""
    a, host_a = _engine(daemon.address, layout="layer_first")
    b, host_b = _engine(daemon.address, layout="page_first_direct")
    try:
        _randomize(host_a, seed=15)
        keys = _hashes(3, seed=16)
        assert a.batch_set(keys, [host_a.get_data_page(p * PAGE) for p in (2, 3, 4)]) is True
        assert a.set(_hashes(4, seed=16)[3], host_a.get_data_page(5 * PAGE)) is True
        dummies = [host_b.get_dummy_flat_data_page() for _ in range(5)]
        got = b.batch_get(_hashes(5, seed=16), dummies)
        assert [g is d for g, d in zip(got, dummies, strict=True)] == [True] * 4 + [False]
        assert got[4] is None
        for i, page in enumerate((7, 8, 9, 10)):
            host_b.set_from_flat_data_page(page * PAGE, got[i])
        _same_pages(host_a, [2, 3, 4, 5], host_b, [7, 8, 9, 10])
        assert b.get(keys[0], host_b.get_dummy_flat_data_page()) is not None
        # Raw pointers and sizes (a zero-copy caller's targets) cannot be served: a miss.
        assert b.get(keys[0], host_b.kv_buffer.data_ptr(), 64) is None
        assert b.batch_set(keys, None, [host_b.kv_buffer.data_ptr()] * 3, [64] * 3) is False
    finally:
        a.close()
        b.close()


def test_concurrent_controller_threads_share_the_staging_pool(daemon):
    """SGLang's prefetch and backup threads at once through one backend (one staging pool): every
    load lands bit-exact, every store stores the right bytes."""
    a, host_a = _engine(daemon.address, ratio=6.0, staging_pages=4)
    b, host_b = _engine(daemon.address, ratio=6.0, staging_pages=4)
    try:
        _randomize(host_a, seed=17)
        _randomize(host_b, seed=18)
        n, rounds = 12, 6
        loads = [(_hashes(n, seed=20 + i), range(1 + n * i, 1 + n * (i + 1))) for i in range(rounds)]
        stores = [(_hashes(n, seed=40 + i), range(1 + n * (rounds + i), 1 + n * (rounds + i + 1)))
                  for i in range(rounds)]
        for keys, pages in loads:
            assert a.batch_set_v1(keys, _slots(pages)) == [True] * n
        results = []

        def prefetch(keys, pages):  # into b's pages of the same numbers as a's
            results.append(("get", b.batch_get_v1(keys, _slots(pages)) == [True] * n))

        def backup(keys, pages):
            results.append(("set", b.batch_set_v1(keys, _slots(pages)) == [True] * n))

        threads = [threading.Thread(target=prefetch, args=r) for r in loads]
        threads += [threading.Thread(target=backup, args=r) for r in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == sorted([("get", True)] * rounds + [("set", True)] * rounds)
        for _, pages in loads:
            _same_pages(host_a, pages, host_b, pages)
        for keys, pages in stores:  # what b stored, read back by a
            assert a.batch_get_v1(keys, _slots(pages)) == [True] * n
            _same_pages(host_b, pages, host_a, pages)
    finally:
        a.close()
        b.close()


def test_a_get_left_unconfirmed_replaces_the_staging_pool(daemon):
    """A Get whose copy the daemon could not confirm stopped may still write the staging pool:
    the backend misses, takes a new pool (a new registration) and works on with it."""
    from kvclient.load_handle import LoadHandle

    a, host_a = _engine(daemon.address)
    b, host_b = _engine(daemon.address)
    try:
        _randomize(host_a, seed=30)
        keys = _hashes(2, seed=31)
        assert a.batch_set_v1(keys, _slots([1, 2])) == [True, True]
        old_pool, old_id = b.staging.pool, b.client.client_id
        real_get = b.client.get

        def unconfirmed(*args, **kwargs):
            handle = LoadHandle.miss(list(range(10)), get=True)
            handle.confirmed = False
            return handle

        b.client.get = unconfirmed
        assert b.batch_get_v1(keys, _slots([3, 4])) == [False, False]
        b.client.get = real_get
        assert b.staging.pool is not old_pool
        assert b.batch_get_v1(keys, _slots([3, 4])) == [True, True]
        assert b.client.client_id != old_id
        _same_pages(host_a, [1, 2], host_b, [3, 4])
    finally:
        a.close()
        b.close()


def test_bad_host_indices_and_side_pools_miss(daemon):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    a, host_a = _engine(daemon.address, metrics=True)
    try:
        keys = _hashes(2, seed=40)
        assert a.batch_set_v1(keys, _slots([1, 2]) + 1) == [False, False]  # not aligned pages
        assert a.batch_set_v1(keys, _slots([1, 1])) == [False, False]  # the same page twice
        assert a.batch_set_v1(keys, _slots([1])) == [False, False]  # too few
        assert a.batch_set_v1(keys, _slots([1, 2])) == [True, True]
        assert a.batch_get_v1(keys, _slots([3, 4])) == [True, True]
        stats = a.get_stats()
        assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2] and len(stats.backup_bandwidth) == 1
        assert a.get_stats().backup_pgs == []
        side = [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], host_indices=_slots([1]))]
        assert a.batch_exists_v2(keys, side).kv_hit_pages == 0
        assert a.batch_exists_v2(keys).kv_hit_pages == 2
        assert a.batch_get_v2(side) == {PoolName.MAMBA: [False]}
        assert a.batch_set_v2(side) == {PoolName.MAMBA: [False]}
        a.clear()  # the node-wide cache is shared: nothing is removed
        assert a.batch_exists(keys) == 2
        # Keys that are not 64-hex hashes are stored and found too (by their SHA-256).
        tagged = [k + ".draft" for k in keys]
        assert a.batch_exists(tagged) == 0
        assert a.batch_set_v1(tagged, _slots([5, 6])) == [True, True]
        assert a.batch_exists(tagged) == 2
    finally:
        a.close()


def test_a_hybrid_models_side_pools_fail_the_attach_and_a_late_one_stops_stores(daemon):
    """SGLang's hybrid cache controller registers a sliding-window or Mamba pool beside the KV pool:
    no prefetch of such a model could hit (its side pools are not stored), so the attach fails at
    startup, as docs/integrations.md says; a side pool added while serving stops the KV stores."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    dev = _device_pool(num_layers=10)
    host = sglang_env.host_pool(dev, ratio=1.5)
    side = sglang_env.host_pool(_device_pool(num_layers=10), ratio=1.5)  # stands for the SWA pool
    config = _storage_config(dev, host, address=daemon.address)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    try:
        backend.register_mem_pool_host(host)  # the hybrid controller's order
        backend.register_mem_host_pool_v2(host, PoolName.KV)
        backend.register_mem_host_pool_v2(side, PoolName.SWA)
        with pytest.raises(ValueError, match="full-attention KV only"):
            backend.on_host_pools_registered()
        # Closed by the refusal itself: SGLang drops the backend of a failed attach unclosed.
        assert daemon.run(lambda: len(daemon.core.clients)) == 0
    finally:
        backend.close()

    a, _ = _engine(daemon.address)
    try:
        keys = _hashes(2, seed=77)
        assert a.batch_set_v1(keys[:1], _slots([1])) == [True]
        a.register_mem_host_pool_v2(side, PoolName.MAMBA)  # a sidecar added while serving
        assert a.batch_set_v1(keys[1:], _slots([2])) == [False]
        assert a.batch_exists(keys) == 1
    finally:
        a.close()
