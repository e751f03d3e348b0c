"""vLLM 0.33.0's own classes, importable and constructible in the CPU-only test venv.

Installed by scripts/install_vllm.sh: the pinned wheel without its dependencies and a few small
PyPI packages. The connector's import chains (kv_connector.v1.base, the factory, the v1 Scheduler,
ModelConfig) need no stand-in; tests/vllm_standins/ holds one only for FlashInfer, which
vllm/v1/attention/backends/flashinfer.py (and mla/flashinfer_mla.py) import at module level, so
that the tests can read those backends' KV cache layout answers. Call `setup()` (or any helper
here, which calls it) before importing anything from `vllm`.

Order matters, as for SGLang (tests/sglang_env.py): vLLM probes for FlashInfer with
`vllm.utils.flashinfer.has_flashinfer()` (importlib.util.find_spec, functools.cache'd). `setup()`
imports vllm and answers that probe (and torch's Triton probes) with no stand-in visible, and only
then puts the stand-ins on sys.path, so vLLM never believes FlashInfer is installed.

Importing vllm sets variables in os.environ (TORCHINDUCTOR_CACHE_DIR, TORCHINDUCTOR_COMPILE_THREADS,
PYTORCH_NVML_BASED_CUDA_CHECK, TRITON_CACHE_AUTOTUNING, TILELANG_CLEANUP_TEMP_FILES). `restore()`
takes the stand-ins off sys.path and out of sys.modules and puts os.environ back. Use both from a
fixture, never at import time: pytest imports every test module at collection.

Building a ModelConfig runs `python -m vllm.model_executor.models.registry` in a subprocess to
inspect the model's architecture (about 15 s on 2 CPUs); `model_dir()` writes the tiny local
Llama config.json it reads (no hub access, no weights, no tokenizer).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import standins

VLLM_VERSION = "0.33.0"
STANDINS = Path(__file__).resolve().parent / "vllm_standins"
STANDIN_MODULES = ("flashinfer",)
EOS_TOKEN_ID = 2

_ready = False
_environ_before: dict[str, str] | None = None
_model_dir: str | None = None
_none_hash_ready = False


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def setup() -> None:
    """Import vllm and answer its and torch's package probes, then put the stand-ins on sys.path.
    Idempotent; after restore() it puts the stand-ins back."""
    global _ready, _environ_before
    if _environ_before is None:
        _environ_before = dict(os.environ)
    if _ready:
        if str(STANDINS) not in sys.path:
            sys.path.insert(0, str(STANDINS))
        return
    for name in STANDIN_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and not getattr(mod, "KVSERVER_STANDIN", False):
            raise RuntimeError(f"a real {name} is imported; the vLLM stand-ins expect none")
    import torch  # noqa: F401
    from torch.utils._triton import has_triton, has_triton_package

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm  # noqa: F401
        import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
        import vllm.v1.core.sched.scheduler  # noqa: F401
        from vllm.utils.flashinfer import has_flashinfer

    if str(STANDINS) not in sys.path:
        # Probes answered (and cached) with no stand-in visible.
        assert not has_triton_package() and not has_triton()
        assert not has_flashinfer()
        sys.path.insert(0, str(STANDINS))
    _ready = True


def restore() -> None:
    """Undo what setup() left visible outside vLLM: the stand-ins on sys.path and in sys.modules
    (the vLLM modules already imported keep their references) and os.environ."""
    global _environ_before
    standins.undo(STANDINS, STANDIN_MODULES, _environ_before)
    _environ_before = None


# ---- builders for vLLM's real objects on a CPU ---------------------------------------------------


def model_dir() -> str:
    """A folder holding only a tiny Llama config.json (2 layers, 2 KV heads of 16), which is all
    ModelConfig reads with skip_tokenizer_init. Made once per process."""
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.mkdtemp(prefix="kvserver-vllm-model-")
        atexit.register(shutil.rmtree, _model_dir, True)  # (ignore_errors)
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1,
            "eos_token_id": EOS_TOKEN_ID,
        }
        Path(_model_dir, "config.json").write_text(json.dumps(config))
    return _model_dir


def vllm_config(*, kv_connector: str = "ExampleConnector", kv_connector_module_path=None,
                kv_role: str = "kv_both", kv_connector_extra_config=None, block_size: int = 16,
                max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                max_model_len: int = 1024, kv_load_failure_policy: str = "recompute"):
    """A VllmConfig on a CPU with a KV connector, as vLLM's tests/v1/kv_connector/unit/utils.py
    create_vllm_config builds it (there with facebook/opt-125m from the hub; here model_dir())."""
    setup()
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=model_dir(), tokenizer=model_dir(), skip_tokenizer_init=True,
                        dtype="float16", seed=42)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_chunked_prefill=True,
                                is_encoder_decoder=model.is_encoder_decoder)
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    kv_transfer = KVTransferConfig(kv_connector=kv_connector,
                                   kv_connector_module_path=kv_connector_module_path,
                                   kv_role=kv_role,
                                   kv_connector_extra_config=kv_connector_extra_config or {},
                                   kv_load_failure_policy=kv_load_failure_policy)
    return VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=cache,
                      kv_transfer_config=kv_transfer, device_config=DeviceConfig("cpu"))


def kv_cache_config(block_size: int = 16, num_blocks: int = 128, *, num_kv_heads: int = 2,
                    head_size: int = 16, layers=("model.layers.0.self_attn.attn",
                                                 "model.layers.1.self_attn.attn")):
    """vLLM's KVCacheConfig of one full-attention group over `layers` (no tensors: the scheduler
    needs only the block count and specs)."""
    setup()
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)])


def scheduler(config, kv_cache_cfg=None):
    """vLLM's real v1 Scheduler (AsyncScheduler, its subclass, under async scheduling, 0.33's
    default), its KV connector built by the factory in the scheduler role, as create_scheduler in
    vLLM's connector unit tests builds it."""
    setup()
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = config.cache_config.block_size
    kv_cache_cfg = kv_cache_cfg or kv_cache_config(block_size)
    config.cache_config.num_gpu_blocks = kv_cache_cfg.num_blocks
    # 0.33 defaults to async scheduling; create_scheduler picks the class the same way.
    cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
    return cls(vllm_config=config, kv_cache_config=kv_cache_cfg, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=block_size)


def request(request_id: str, prompt_token_ids, *, max_tokens: int = 4, block_size: int = 16):
    """vLLM's own v1 Request with its block hasher (sha256, as create_request), for token ids."""
    global _none_hash_ready
    setup()
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                   sampling_params=params, pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def model_runner_output(reqs, *, token_id: int = 0, finished_sending=None, finished_recving=None,
                        invalid_block_ids=None):
    """vLLM's ModelRunnerOutput for one sampled token per request, with a KVConnectorOutput when
    any connector field is given (as create_model_runner_output in vLLM's tests)."""
    setup()
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = [r.request_id for r in reqs]
    connector = None
    if finished_sending is not None or finished_recving is not None or invalid_block_ids:
        connector = KVConnectorOutput(finished_sending=finished_sending,
                                      finished_recving=finished_recving,
                                      invalid_block_ids=invalid_block_ids or set())
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token_id] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             kv_connector_output=connector)
