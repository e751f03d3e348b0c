"""SGLang 0.5.23's own classes, importable and constructible in the CPU-only test venv.

Installed by scripts/install_sglang.sh: the pinned wheel without its dependencies, a few small
PyPI packages, and the stand-ins in tests/sglang_standins/ for the GPU-only or heavy imports
(triton, torchvision, IPython) that SGLang's import chain reaches. Call `setup()` (or any helper
here, which calls it) before importing anything from `sglang`.

Order matters: torch and transformers probe for triton/torchvision when their modules are first
imported and cache the answer. `setup()` imports those probing modules first, with the stand-ins
NOT yet on sys.path, so torch never believes Triton is installed (it would then try to compile
through it) and transformers never believes torchvision is; only then does it put the stand-ins
on sys.path for SGLang's own module-level imports.

Importing sglang also sets cache variables in os.environ (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR...)
and patches transformers (sglang/srt/utils/hf_transformers_patches.py). `restore()` takes the
stand-ins off sys.path and out of sys.modules and puts os.environ back, so that later tests and the
processes they spawn (which inherit sys.path and the environment) never see a stand-in; the
transformers patches stay for the rest of the process. Use both from a fixture, never at import
time: pytest imports every test module at collection.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import standins

SGLANG_VERSION = "0.5.23"
STANDINS = Path(__file__).resolve().parent / "sglang_standins"
STANDIN_MODULES = ("triton", "torchvision", "IPython")

_ready = False
_environ_before: dict[str, str] | None = None


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def setup() -> None:
    """Prime torch/transformers' package probes, then put the stand-ins on sys.path and import
    sglang. Idempotent; after restore() it puts the stand-ins back."""
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
            raise RuntimeError(f"a real {name} is imported; the SGLang stand-ins expect none")
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.runtime.hints  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import transformers.utils.import_utils as hf_imports
    from torch.utils._triton import has_triton, has_triton_package

    if str(STANDINS) not in sys.path:
        # Probes answered (and cached) with no stand-in visible.
        assert not has_triton_package() and not has_triton()
        hf_imports.is_torchvision_available()
        hf_imports.is_triton_available()
        hf_imports.is_ipython_available()
        sys.path.insert(0, str(STANDINS))
    with warnings.catch_warnings():
        # Quantization modules warn at import that they need CUDA.
        warnings.simplefilter("ignore", UserWarning)
        import sglang  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
    _ready = True


def restore() -> None:
    """Undo what setup() left visible outside SGLang: the stand-ins on sys.path and in sys.modules
    (the SGLang modules already imported keep their references) and os.environ."""
    global _environ_before
    standins.undo(STANDINS, STANDIN_MODULES, _environ_before)
    _environ_before = None


# ---- builders for SGLang's real objects on a CPU -------------------------------------------------


def pp_split(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """[start, end) of each PP stage, from SGLang's own get_pp_indices (what make_layers uses)."""
    setup()
    from sglang.srt.distributed.utils import get_pp_indices

    return [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]


def mha_pool(*, layer_num: int = 4, start_layer: int | None = None, end_layer: int | None = None,
             size: int = 64, page_size: int = 16, head_num: int = 2, head_dim: int = 8,
             dtype=None, device: str = "cpu"):
    """SGLang's MHATokenToKVPool on a CPU. As SGLang's ModelRunner does under PP, pass the stage's
    [start_layer, end_layer) with layer_num = end_layer - start_layer (end_layer exclusive)."""
    setup()
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=size, page_size=page_size, dtype=dtype or torch.bfloat16, head_num=head_num,
        head_dim=head_dim, layer_num=layer_num, device=device, enable_memory_saver=False,
        start_layer=start_layer, end_layer=end_layer,
    )


def mla_pool(*, layer_num: int = 4, start_layer: int | None = None, end_layer: int | None = None,
             size: int = 64, page_size: int = 16, kv_lora_rank: int = 16, qk_rope_head_dim: int = 4,
             dtype=None, device: str = "cpu"):
    """SGLang's MLATokenToKVPool on a CPU (one latent buffer per layer, 1 head of
    kv_lora_rank + qk_rope_head_dim)."""
    setup()
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=size, page_size=page_size, dtype=dtype or torch.bfloat16, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, device=device,
        enable_memory_saver=False, start_layer=start_layer, end_layer=end_layer,
    )


def stage_pool(kind: str, num_layers: int, pp_size: int, pp_rank: int, **kw):
    """The pool a PP stage's ModelRunner builds: its own layers, global ids from get_pp_indices."""
    start, end = pp_split(num_layers, pp_size)[pp_rank]
    build = {"mha": mha_pool, "mla": mla_pool}[kind]
    return build(layer_num=end - start, start_layer=start, end_layer=end, **kw)


def server_args(**overrides):
    """SGLang's ServerArgs, unresolved (construction does no work; resolve_once() would load the
    model config). model_path "dummy" is what SGLang itself uses for no model."""
    setup()
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(**{"model_path": "dummy", **overrides})


def cache_init_params(kvcache, *, page_size: int | None = None, req_slots: int = 4,
                      max_context_len: int = 256, **overrides):
    """SGLang's CacheInitParams over a real ReqToTokenPool and PagedTokenToKVPoolAllocator for
    `kvcache` (its size and page size), with tree_components (FULL,) as registry.py sets for a
    plain full-attention model."""
    setup()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    page_size = page_size or kvcache.page_size
    req_to_token = ReqToTokenPool(size=req_slots, max_context_len=max_context_len, device="cpu",
                                  enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(kvcache.size, page_size, kvcache.dtype, "cpu", kvcache,
                                            False)
    fields = {"disable": False, "req_to_token_pool": req_to_token,
              "token_to_kv_pool_allocator": allocator, "page_size": page_size,
              "tree_components": (ComponentType.FULL,), **overrides}
    return CacheInitParams(**fields)


def unified_radix_cache(params):
    """SGLang's UnifiedRadixCache (the tree that owns a UnifiedCacheLinkerWrapper) on a CPU."""
    setup()
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache(params)


def host_pool(device_pool, *, ratio: float = 2.0, layout: str = "page_first"):
    """SGLang's HiCache host pool (MHATokenToKVPoolHost / MLATokenToKVPoolHost) mirroring
    `device_pool`, built from its get_device_pool_infos() as SGLang's assembler does; unpinned,
    since pinning needs CUDA."""
    setup()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    (info,) = device_pool.get_device_pool_infos()
    common = dict(pin_memory=False, device_capacity_tokens=device_pool.size,
                  start_layer=device_pool.start_layer, end_layer=device_pool.end_layer)
    if isinstance(device_pool, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info.buffer_info, ratio, 0, device_pool.page_size, layout,
                                    target_layer_num=device_pool.layer_num, **common)
    return MHATokenToKVPoolHost(info.buffer_info, ratio, 0, device_pool.page_size, layout, **common)


def runtime_context(server_args, *, role: str = "scheduler"):
    """A context manager activating SGLang's runtime config (get_disagg(), get_memory()...) built
    from `server_args`, as a scheduler process has it after publish(); create_context/use_context
    leave the process-wide context as it was once the block ends. Needed by UnifiedRadixCache's
    match_prefix (it reads get_disagg().disaggregation_mode)."""
    setup()
    from sglang.srt import runtime_context as rc

    return rc.use_context(rc.create_context(server_args, role=role))


def req(rid: str, tokens, *, max_new_tokens: int = 4):
    """SGLang's own Req for a text prompt of token ids (no tokenizer: origin_input_text is empty),
    as the scheduler builds it from a TokenizedGenerateReqInput."""
    setup()
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=max_new_tokens))
