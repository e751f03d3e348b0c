"""vLLM 0.33.0's own classes import and construct in the CPU-only venv (tests/vllm_env.py).

Groundwork for the vLLM connector (issue 11): the connector base classes and their exact
signatures, vLLM's KVConnectorFactory loading a connector by module path, vLLM's real v1 Scheduler
built on a CPU running steps with a connector, and the per-layer KV cache layouts 0.33 ships.
Only FlashInfer is a stand-in (tests/vllm_standins/). Skipped where scripts/install_vllm.sh has
not run.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import vllm_env

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)

RECORDING = "vllm_recording_connector"


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    # Not at import: the stand-ins must not be visible to the rest of the suite or to the
    # processes it spawns.
    vllm_env.setup()
    yield
    vllm_env.restore()


@pytest.fixture(scope="module")
def recording_config():
    # One ModelConfig per module: each one inspects the architecture in a subprocess (~15 s).
    return vllm_env.vllm_config(kv_connector="RecordingConnector",
                                kv_connector_module_path=RECORDING)


@pytest.fixture()
def calls():
    import vllm_recording_connector as rec

    rec.CALLS.clear()
    return rec.CALLS


# ---- environment -----------------------------------------------------------------------------


def test_pinned_vllm_and_cpu_torch():
    from importlib.metadata import version

    import vllm

    assert version("vllm") == vllm_env.VLLM_VERSION
    assert vllm.__version__ == vllm_env.VLLM_VERSION
    assert torch.__version__.startswith("2.13") and torch.__version__.endswith("+cpu")
    assert not torch.cuda.is_available()


def test_flashinfer_is_a_standin_and_vllm_sees_none():
    import flashinfer
    from vllm.utils.flashinfer import has_flashinfer

    assert flashinfer.KVSERVER_STANDIN
    assert not has_flashinfer()
    with pytest.raises(RuntimeError, match="stand-in"):
        flashinfer.BatchPrefillWithPagedKVCacheWrapper()


# ---- the connector contract --------------------------------------------------------------------

# Every KVConnectorBase_V1 method a kvserver connector implements or relies on, as 0.33.0 declares
# it (inspect.signature, annotations as written). A change here is a change of vLLM's contract.
BASE_SIGNATURES = {
    # scheduler side
    "get_num_new_matched_tokens":
        "(self, request: 'Request', num_computed_tokens: int) -> tuple[int | None, bool]",
    "update_state_after_alloc":
        "(self, request: 'Request', blocks: 'KVCacheBlocks', num_external_tokens: int)",
    "build_connector_meta":
        "(self, scheduler_output: vllm.v1.core.sched.output.SchedulerOutput)"
        " -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata",
    "update_connector_output": "(self, connector_output: vllm.v1.outputs.KVConnectorOutput)",
    "request_finished":
        "(self, request: 'Request', block_ids: list[int]) -> tuple[bool, dict[str, typing.Any] | None]",
    "take_events": "(self) -> collections.abc.Iterable['KVCacheEvent']",
    "get_required_kvcache_layout": "(vllm_config: 'VllmConfig') -> str | None",
    "requires_piecewise_for_cudagraph": "(extra_config: dict[str, typing.Any]) -> bool",
    "on_new_request": "(self, request: 'Request') -> None",
    "reset_cache": "(self) -> bool | None",
    # worker side
    "register_kv_caches": "(self, kv_caches: dict[str, torch.Tensor])",
    "start_load_kv": "(self, forward_context: 'ForwardContext', **kwargs: Any) -> None",
    "wait_for_layer_load": "(self, layer_name: str) -> None",
    "save_kv_layer":
        "(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: 'AttentionMetadata',"
        " **kwargs: Any) -> None",
    "wait_for_save": "(self)",
    "get_finished":
        "(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]",
    "get_block_ids_with_load_errors": "(self) -> set[int]",
    "handle_preemptions":
        "(self, kv_connector_metadata: "
        "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata)",
    "build_connector_worker_meta":
        "(self) -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorWorkerMetadata"
        " | None",
    "shutdown": "(self)",
    # both
    "__init__":
        "(self, vllm_config: 'VllmConfig', role: "
        "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorRole, "
        "kv_cache_config: 'KVCacheConfig')",
}
ABSTRACT = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"}


def test_base_class_signatures_and_abstract_methods():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    got = {name: str(inspect.signature(getattr(KVConnectorBase_V1, name)))
           for name in BASE_SIGNATURES}
    assert got == BASE_SIGNATURES
    assert KVConnectorBase_V1.__abstractmethods__ == frozenset(ABSTRACT)


def test_supports_hma_exists_with_request_finished_all_groups():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    assert SupportsHMA.__abstractmethods__ == frozenset({"request_finished_all_groups"})
    assert str(inspect.signature(SupportsHMA.request_finished_all_groups)) == (
        "(self, request: 'Request', block_ids: tuple[list[int], ...])"
        " -> tuple[bool, dict[str, typing.Any] | None]")


def test_factory_loads_a_connector_from_its_module_path(recording_config):
    import vllm_recording_connector as rec
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    kv_transfer = recording_config.kv_transfer_config
    assert kv_transfer.kv_connector_module_path == RECORDING
    assert KVConnectorFactory.get_connector_class(kv_transfer) is rec.RecordingConnector
    # SupportsHMA is what keeps vLLM's hybrid KV cache manager on (supports_hma_config), but on
    # a CPU platform VllmConfig switches HMA off whatever the connector (support_hybrid_kv_cache).
    assert KVConnectorFactory.supports_hma_config(kv_transfer)
    assert recording_config.scheduler_config.disable_hybrid_kv_cache_manager
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(recording_config, role,
                                                   vllm_env.kv_cache_config())
        assert isinstance(conn, rec.RecordingConnector) and conn.role is role


def test_hma_is_off_on_a_cpu_and_example_connector_lacks_it():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform

    assert not current_platform.support_hybrid_kv_cache()
    # ExampleConnector (vLLM's own) does not subclass SupportsHMA: on a GPU VllmConfig would
    # turn HMA off for it and log "Turning off hybrid kv cache manager...".
    assert not KVConnectorFactory.supports_hma_config(
        _example_transfer_config())


def _example_transfer_config():
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")


# ---- vLLM's real Scheduler on a CPU --------------------------------------------------------------


def test_scheduler_runs_steps_with_the_connector(recording_config, calls):
    import vllm_recording_connector as rec

    sched = vllm_env.scheduler(recording_config)
    assert isinstance(sched.connector, rec.RecordingConnector)
    req = vllm_env.request("a", range(40), max_tokens=2)
    sched.add_request(req)

    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 40}
    assert isinstance(out.kv_connector_metadata, rec.RecordingMetadata)
    assert out.kv_connector_metadata.new_req_ids == ["a"]
    methods = [m for _, m, _ in calls]
    assert methods == ["get_num_new_matched_tokens", "update_state_after_alloc",
                       "build_connector_meta"]
    assert calls[0][2] == ("a", 0)  # no local prefix hit on an empty cache
    (block_ids,) = calls[1][2][1]  # one KV cache group
    assert len(block_ids) == 3 and calls[1][2][2] == 0  # ceil(40 / 16) blocks, 0 external
    # block hashes: one per full block (2 of 40 tokens), sha256 as vLLM's tests set
    assert len(req.block_hashes) == 2

    calls.clear()
    sched.update_from_output(out, vllm_env.model_runner_output([req]))
    out = sched.schedule()  # decode step
    assert out.num_scheduled_tokens == {"a": 1}
    sched.update_from_output(out, vllm_env.model_runner_output([req]))
    # update_connector_output is called only when the step's output carries a
    # KVConnectorOutput (none here). max_tokens reached: a SupportsHMA connector gets
    # request_finished_all_groups (every group's block ids) even with HMA off, never the plain
    # request_finished.
    assert [m for _, m, _ in calls] == ["build_connector_meta", "request_finished_all_groups"]
    assert calls[1][2] == ("a", (block_ids,))
    assert not sched.requests


def test_scheduler_asks_the_connector_after_the_local_prefix_hit(recording_config, calls):
    # The second request shares the first's 32-token prefix: vLLM's own prefix cache hits 2
    # blocks and asks the connector only for tokens beyond them (num_computed_tokens = 32).
    sched = vllm_env.scheduler(recording_config)
    first = vllm_env.request("p1", list(range(32)) + [900, 901], max_tokens=1)
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out, vllm_env.model_runner_output([first]))
    assert not sched.requests
    calls.clear()
    second = vllm_env.request("p2", list(range(32)) + [700, 701, 702], max_tokens=1)
    sched.add_request(second)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p2": 3}
    assert calls[0][1:] == ("get_num_new_matched_tokens", ("p2", 32))


def test_external_hit_is_scheduled_as_computed(calls):
    config = vllm_env.vllm_config(kv_connector="RecordingConnector",
                                  kv_connector_module_path=RECORDING,
                                  kv_connector_extra_config={"matched_tokens": 32})
    sched = vllm_env.scheduler(config)
    req = vllm_env.request("x", range(40), max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()
    # 32 tokens come from the connector (loaded in this step), 8 are computed
    assert out.num_scheduled_tokens == {"x": 8}
    alloc = [d for _, m, d in calls if m == "update_state_after_alloc"]
    assert alloc[0][2] == 32 and len(alloc[0][1][0]) == 3


# ---- the per-layer KV cache layouts of 0.33 --------------------------------------------------------


def test_kv_cache_layouts_and_strides():
    # 0.33 has no get_kv_cache_shape / get_kv_cache_stride_order: every attention layer's cache is
    # a logical [L, B, H, N, C] (layers, blocks, heads, tokens in a block, content bytes) with one
    # of six physical permutations (vllm/v1/kv_cache_layout.py, RFC #42082). For full attention
    # C is K then V of one head of one token (2 * head_size elements); for MLA one latent.
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout as L

    assert {x.name: x.value for x in L} == {
        "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
        "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=20, dtype=torch.float16)
    assert compute_layer_kv_cache_shape_bytes(full, 10) == (10, 2, 16, 32)
    assert compute_layer_kv_cache_shape_bytes(mla, 10) == (10, 1, 16, 40)
    # byte strides in logical [L, B, H, N, C] order, 3 layers of 10 blocks
    assert {x.name: compute_layout_strides(full, 10, 3, x) for x in L} == {
        "LBHNC": (10240, 1024, 512, 32, 1), "LBNHC": (10240, 1024, 32, 64, 1),
        "LHBNC": (10240, 512, 5120, 32, 1), "BLHNC": (1024, 3072, 512, 32, 1),
        "BLNHC": (1024, 3072, 32, 64, 1), "BHLNC": (512, 3072, 1536, 32, 1)}
    assert {x.name: compute_layout_strides(mla, 10, 3, x) for x in L} == {
        "LBHNC": (6400, 640, 640, 40, 1), "LBNHC": (6400, 640, 40, 40, 1),
        "LHBNC": (6400, 640, 6400, 40, 1), "BLHNC": (640, 1920, 640, 40, 1),
        "BLNHC": (640, 1920, 40, 40, 1), "BHLNC": (640, 1920, 1920, 40, 1)}
    assert [x.name for x in L if x.is_layer_compact] == ["LBHNC", "LBNHC", "LHBNC"]
    assert [x.name for x in L if x.is_block_compact] == ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


def test_backends_declare_their_layouts():
    # What each backend accepts on this (CPU) platform; None = any layout, vLLM's default
    # preference then picks LBNHC (NHD). FlashInfer answers LBHNC/BLHNC only on SM 10.x.
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLABackend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
    from vllm.v1.kv_cache_layout import KVCacheLayout as L

    for backend in (FlashAttentionBackend, FlashInferBackend):
        assert not backend.is_mla() and backend.supported_kv_cache_layouts() is None
    for backend in (FlashMLABackend, TritonMLABackend, FlashInferMLABackend):
        assert backend.is_mla() and backend.supported_kv_cache_layouts() is None
    assert CPUAttentionBackend.supported_kv_cache_layouts() == (L.LBHNC,)
    assert FlexAttentionBackend.supported_kv_cache_layouts() == (L.LBNHC,)
    assert _DEFAULT_LAYOUT_PREFERENCE[0] is L.LBNHC


# ---- block hashes ----------------------------------------------------------------------------------


def test_sha256_block_hashes_are_stable_across_processes_without_pythonhashseed(monkeypatch):
    # 0.33: with the default prefix_caching_hash_algo "sha256" the root (NONE_HASH) seed is the
    # fixed "vllm-none-hash" unless PYTHONHASHSEED is set; only xxhash/xxhash_cbor draw a random
    # per-process seed. So two replicas with default settings agree on every block hash.
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED, resolve_none_hash_seed

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert resolve_none_hash_seed(sha256) == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert resolve_none_hash_seed(sha256) == "7"
    assert vllm_env.vllm_config().cache_config.prefix_caching_hash_algo == "sha256"
    a = vllm_env.request("h1", range(32))
    b = vllm_env.request("h2", range(32))
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2


def test_per_layer_views_built_by_vllm_in_each_layout():
    # vLLM's own create_kv_cache_views over one raw int8 buffer shared by 3 layers: each layer gets
    # a 4D [B, H, N, 2 * head_size] view in the spec's dtype (element strides below), K in
    # [..., :head_size] and V in [..., head_size:] of the same row.
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout as L

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    expected = {  # (element strides of layer 0's view, element offset of layer 1)
        "LBHNC": ((512, 256, 16, 1), 5120), "LBNHC": ((512, 16, 32, 1), 5120),
        "LHBNC": ((256, 2560, 16, 1), 5120), "BLHNC": ((1536, 256, 16, 1), 512),
        "BLNHC": ((1536, 16, 32, 1), 512), "BHLNC": ((1536, 768, 16, 1), 256)}
    for layout in L:
        strides = compute_layout_strides(full, 10, 3, layout)
        tensor = KVCacheTensor(size=full.page_size_bytes * 30, layers=["l0", "l1", "l2"],
                               layer_stride=strides[0], block_stride=strides[1])
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(raw, full, 10, layout, tensor)
        assert len(views) == 3
        assert all(v.shape == (10, 2, 16, 16) and v.dtype == torch.float16 for v in views)
        assert (views[0].stride(), views[1].storage_offset()) == expected[layout.name], layout
        # the three layers tile the buffer exactly, no overlap
        for i, v in enumerate(views):
            v.fill_(i + 1)
        assert torch.bincount(raw.view(torch.float16).to(torch.int64)).tolist()[1:] == [
            10 * 2 * 16 * 16] * 3
