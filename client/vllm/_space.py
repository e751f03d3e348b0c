"""The KV spaces a vLLM engine uses, read from its configs the same way in the scheduler process
and in every worker: model name, per-token layout, dtype, page (= vLLM block) size, layer count,
TP and PP sizes. Keys are vLLM's own block hashes, where they are the same in every process.

A model with one KV cache group is one space. A hybrid model under vLLM's hybrid KV cache manager
(full-attention and sliding-window layers, as Gemma 2/3, gpt-oss or Mistral's sliding window)
has one group per kind of layer, each with its own block table: each group is a space of its own
(the model's name tagged with the group), whose layers are numbered 0.. in model order.

Importing this module does not import vLLM (it reads vLLM's objects by attribute).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvclient.weights import weights_identity
from kvserver.protocol.layout import KVLayout

logger = logging.getLogger("kvclient.vllm")

# The per-layer specs whose pages kvserver stores whole: dense K/V (K and V side by side in one
# row, [B, H, N, 2 * head_size]) or the MLA latent ([B, 1, N, latent]), for every token
# (full attention) or for the tokens of a sliding window. Matched by class name: subclasses
# (sink, RSWA, sparse or hidden-state caches) hold more than that and are refused.
STORABLE_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")
WINDOW_SPEC = "SlidingWindowSpec"
# Not per-token KV: a request's state is one running value per block, which a prefix of pages
# cannot describe.
STATE_SPECS = ("MambaSpec",)  # vLLM 0.33's spec for Mamba, linear attention, GDN and short conv
# vLLM's hash algorithms whose block hashes are the same in every process without PYTHONHASHSEED.
STABLE_HASHES = ("sha256", "sha256_cbor")
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Space:
    model: str
    layout: KVLayout
    dtype: torch.dtype  # on the wire (fp8 as its float8 type; vLLM keeps it in uint8)
    page_size: int  # tokens: one vLLM block
    num_layers: int
    tp_size: int
    pp_size: int
    hash_stride: int  # vLLM block hashes per block (block_size // hash_block_size)
    weights: str = ""  # the weights' identity beyond the model's name (kvclient.weights)


@dataclass(frozen=True)
class Group:
    """One of vLLM's KV cache groups as kvserver stores it: its own KV space and block table."""

    index: int  # vLLM's group index: block_ids[index] is its block table
    space: Space
    layer_names: tuple[str, ...]  # in model order
    # Sliding window: the trailing blocks a hit of h blocks needs (those vLLM keeps below h);
    # None: full attention, every leading block.
    window_blocks: int | None = None
    # The group's layers are numbered 0.. in model order in its space (several groups); else
    # they keep the model's layer ids.
    local_ids: bool = False


def layer_index(name: str) -> int:
    """The model's layer index in a vLLM layer name ("model.layers.3.self_attn.attn" -> 3)."""
    for part in reversed(name.split(".")):
        if part.isdigit():
            return int(part)
    raise ValueError(f"no layer index in the layer name {name!r}")


def extra_config(vllm_config) -> dict:
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def _check_spec(spec) -> None:
    name = type(spec).__name__
    if name in STATE_SPECS:
        raise ValueError(f"KVServerConnector does not store {name} layers: Mamba / linear-attention state "
                         "is one running value per request, not per-token KV a prefix of pages describes")
    if name not in STORABLE_SPECS:
        raise ValueError(f"KVServerConnector stores full-attention, sliding-window or MLA KV "
                         f"({', '.join(STORABLE_SPECS)}); not {name}")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", str(quant)) != "NONE":
        # vLLM 0.33 gives every fp8 --kv-cache-dtype per-tensor scales (FP8_PER_TENSOR): a page's
        # bytes mean nothing without the scales that wrote them.
        raise ValueError(f"KVServerConnector does not store quantised KV with scales "
                         f"(kv_quant_mode {getattr(quant, 'name', quant)}: vLLM sets one for every quantised "
                         "--kv-cache-dtype, fp8 included); serve with --kv-cache-dtype auto")
    # A FullAttentionSpec with a sliding_window or attention_chunk_size (hybrid models with vLLM's
    # hybrid manager off) keeps every block: stored as full attention.
    for attr in ("num_head_slots", "state_content_bytes", "model_version"):
        if getattr(spec, attr, None) is not None:
            raise ValueError(f"KVServerConnector does not store this KV cache ({name}.{attr} = "
                             f"{getattr(spec, attr)!r}): its pages hold more than dense K/V or the latent")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise ValueError("KVServerConnector stores one KV state per token")


def _groups(kv_cache_config) -> list:
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("KVServerConnector needs at least one KV cache group")
    for g in groups:
        _check_spec(g.kv_cache_spec)
    return groups


def wire_dtype(spec, vllm_config) -> torch.dtype:
    """The dtype the daemon is told: the spec's, or for a uint8 cache its fp8 type. (vLLM 0.33
    gives its fp8 caches scales, which ``_check_spec`` refuses first.)"""
    dtype = spec.dtype
    if dtype == torch.uint8:  # vLLM's fp8 caches are uint8 tensors
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "") or "")
        if cache_dtype not in FP8:
            raise ValueError(f"a uint8 KV cache with cache_dtype {cache_dtype!r} is not one kvserver stores")
        return FP8[cache_dtype]
    return dtype


def _layout(spec, model_config) -> KVLayout:
    if type(spec).__name__ == "MLAAttentionSpec":
        text = model_config.hf_text_config
        lora, rope = int(text.kv_lora_rank), int(text.qk_rope_head_dim)
        if lora + rope != spec.head_size:
            raise ValueError(f"MLA latent {spec.head_size} != kv_lora_rank {lora} + qk_rope_head_dim {rope}")
        return KVLayout.mla(lora, rope)
    if spec.head_size_v != spec.head_size:
        raise ValueError(f"K and V head sizes differ ({spec.head_size}, {spec.head_size_v})")
    return KVLayout.mha(int(spec.num_kv_heads), int(spec.head_size))


def read_groups(vllm_config, kv_cache_config) -> tuple[Group, ...]:
    """The spaces of this engine, one per KV cache group; raises ValueError for what the
    connector does not store."""
    cfg = extra_config(vllm_config)
    groups = _groups(kv_cache_config)
    par = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, attr, 1) or 1) > 1:
            raise ValueError(f"KVServerConnector does not store context-parallel KV ({attr} > 1): the ranks "
                             "hold different tokens of one block")
    model_config = vllm_config.model_config
    model = cfg.get("model") or (getattr(model_config, "served_model_name", None) or model_config.model)
    if isinstance(model, (list, tuple)):
        model = model[0]
    block_sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(block_sizes) != 1:
        raise ValueError(f"KVServerConnector stores hybrid models whose KV cache groups share one block "
                         f"size; these have {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    hash_block = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    if block_size % hash_block:
        raise ValueError(f"block size {block_size} is not a multiple of the hash block size {hash_block}")
    load = getattr(vllm_config, "load_config", None)
    weights = weights_identity(str(model_config.model), getattr(model_config, "revision", None),
                               getattr(model_config, "quantization", None), cfg.get("weights"),
                               cache_dir=getattr(load, "download_dir", None),
                               load_format=getattr(load, "load_format", None))
    several = len(groups) > 1
    if several and int(par.pipeline_parallel_size) > 1:
        raise ValueError("KVServerConnector stores hybrid models (several KV cache groups) without pipeline "
                         "parallelism: a stage knows only its own layers of each group")
    model_layers = int(cfg.get("num_layers") or model_config.get_total_num_hidden_layers())
    past = [n for g in groups for n in g.layer_names if layer_index(n) >= model_layers]
    if past:
        raise ValueError(
            f"KVServerConnector: the KV cache groups hold layers past the model's {model_layers} "
            f"({', '.join(sorted(past)[:3])}): a speculative decoding drafter's (EAGLE, MTP), which vLLM "
            "puts in the target's group; the connector does not store a drafter's KV (vLLM's own "
            "prefix cache computes a hit's last block again for it, the connector would not): run "
            "it without speculative decoding")
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        windowed = type(spec).__name__ == WINDOW_SPEC
        names = tuple(sorted(g.layer_names, key=layer_index))
        if several:
            kind = f"swa{int(spec.sliding_window)}" if windowed else "full"
            name, num_layers = f"{model}#kv{i}-{kind}", len(names)
        else:
            name = str(model)
            num_layers = model_layers
        space = Space(model=name, layout=_layout(spec, model_config), dtype=wire_dtype(spec, vllm_config),
                      page_size=block_size, num_layers=num_layers, tp_size=int(par.tensor_parallel_size),
                      pp_size=int(par.pipeline_parallel_size), hash_stride=block_size // hash_block,
                      weights=weights)
        window = None
        if windowed:
            retained = int(getattr(spec, "num_retained_tokens", int(spec.sliding_window) - 1))
            window = max(1, -(-retained // block_size))
        out.append(Group(index=i, space=space, layer_names=names, window_blocks=window, local_ids=several))
    return tuple(out)


def keys_shareable(vllm_config) -> bool:
    """vLLM's block hashes are the same in every process under sha256 / sha256_cbor (a fixed root
    seed) or, for xxhash, when PYTHONHASHSEED is set (the same on every replica). Otherwise the
    root is random per process: nothing stored would ever be found by another engine or after a
    restart, so the connector stores and finds nothing, and says so once."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in STABLE_HASHES or os.environ.get("PYTHONHASHSEED") is not None:
        return True
    logger.warning("kvserver: prefix_caching_hash_algo=%s draws a random per-process seed unless "
                   "PYTHONHASHSEED is set, so no other engine (or this one after a restart) could find "
                   "what it stores: the KV connector is off (every lookup misses, nothing is stored). Use "
                   "--prefix-caching-hash-algo sha256 (the default) or the same PYTHONHASHSEED on every "
                   "replica.", algo)
    return False


def hashed_blocks(request, hash_stride: int) -> int:
    """How many of ``request``'s blocks have a hash (are full and known)."""
    return len(request.block_hashes) // hash_stride


def block_keys(request, hash_stride: int, upto: int | None = None, start: int = 0) -> list[bytes]:
    """One key per full block ``start`` .. ``upto`` of ``request``: vLLM's chained block hash of
    the block's last hash unit, which names the whole prefix up to it (tokens, LoRA, multimodal
    inputs, cache salt). Only the blocks asked for are read: a step stores a long request's few
    new blocks, not its whole prefix again."""
    hashes = request.block_hashes
    n = hashed_blocks(request, hash_stride)
    if upto is not None:
        n = min(n, upto)
    return [bytes(hashes[(i + 1) * hash_stride - 1]) for i in range(start, n)]
