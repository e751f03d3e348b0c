"""A real model's KV cache survives a round trip through the daemon.

A tiny, randomly initialised Hugging Face Llama (GQA: 4 query heads, 2 KV heads) prefills a prompt.
Its per-layer K and V go into a shared-memory "device" pool at scattered slots, are offloaded to the
daemon, the pool is wiped, and the KV is loaded back, layer by layer, into other scattered slots. A
DynamicCache rebuilt from the pool must then continue generation with logits bit-identical to a run
that kept its original cache. The KV is also compared bit for bit: attention does not care about the
order of cached tokens (RoPE is applied before caching), so a slot mix-up that permutes whole tokens
can leave the logits unchanged (in bfloat16 they come out bit-identical); the KV comparison catches it.

Nothing is downloaded: the model is built from a config under a fixed seed.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvclient import KVClient, KVLayout, ShmKVPool

pytest.importorskip("transformers")

NUM_LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 128
PROMPT_TOKENS = 48  # three whole pages of 16
DECODE_STEPS = 5
POOL_TOKENS = 256  # device pool slots, far more than the prompt
MODEL_NAME = "tiny-random-llama"
TIMEOUT = 60.0

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V) of one layer, each [seq, kv_heads, head_dim]


# ---- the model ------------------------------------------------------------------------------


@dataclass
class Prefilled:
    """A model, its prompt's KV per layer, and the reference continuation with the original cache."""

    model: torch.nn.Module
    dtype: torch.dtype
    kv: list[KV]
    first_token: int  # greedy pick from the prefill's last logits
    ref_logits: list[torch.Tensor]  # one [vocab] row per decode step, original cache kept


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.x renamed ``past_key_values`` to ``cache``; 4.x only knows the old name.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (keys, values), each [batch, kv_heads, seq, head_dim]."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _to_pool_layout(t: torch.Tensor) -> torch.Tensor:
    """[1, heads, seq, dim] (the cache's layout) -> [seq, heads, dim] (a pool's token rows)."""
    return t[0].transpose(0, 1).contiguous()


def _to_cache_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0).contiguous()


def _build_model(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


@torch.no_grad()
def _decode(model: torch.nn.Module, cache, first_token: int, steps: int = DECODE_STEPS) -> list[torch.Tensor]:
    """Greedy decoding, one token per forward; returns each step's logits."""
    kw = _cache_kwarg(model)
    token = first_token
    logits = []
    for _ in range(steps):
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{kw: cache})
        cache = _output_cache(out)
        row = out.logits[0, -1].clone()
        logits.append(row)
        token = int(row.argmax())
    return logits


def _cache_from(kv: list[KV]):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(_to_cache_layout(k), _to_cache_layout(v), layer)
    return cache


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def prefilled(request) -> Prefilled:
    dtype = request.param
    model = _build_model(dtype)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
    cache = _output_cache(out)
    kv = []
    for layer in range(NUM_LAYERS):
        k, v = _layer_kv(cache, layer)
        assert k.shape == (1, KV_HEADS, PROMPT_TOKENS, HEAD_DIM), f"unexpected K shape {tuple(k.shape)}"
        assert k.dtype == dtype and v.dtype == dtype
        kv.append((_to_pool_layout(k), _to_pool_layout(v)))  # copies, safe from the decode below
    first_token = int(out.logits[0, -1].argmax())
    ref_logits = _decode(model, cache, first_token)
    return Prefilled(model, dtype, kv, first_token, ref_logits)


def _assert_kv_equal(got: list[KV], want: list[KV], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} layers back, expected {len(want)}"
    for layer, ((gk, gv), (wk, wv)) in enumerate(zip(got, want, strict=True)):
        for name, g, w in (("K", gk, wk), ("V", gv, wv)):
            assert g.dtype == w.dtype and g.shape == w.shape, (
                f"{what}: layer {layer} {name} is {g.dtype} {tuple(g.shape)}, "
                f"expected {w.dtype} {tuple(w.shape)}"
            )
            if not torch.equal(g, w):
                bad = (g != w).flatten(1).any(1).nonzero().flatten().tolist()
                raise AssertionError(
                    f"{what}: layer {layer} {name} differs at token positions {bad[:16]}"
                    f"{' ...' if len(bad) > 16 else ''} ({len(bad)} of {w.shape[0]} tokens)"
                )


def _assert_continues_exactly(pre: Prefilled, kv: list[KV], what: str) -> None:
    got = _decode(pre.model, _cache_from(kv), pre.first_token)
    for step, (g, r) in enumerate(zip(got, pre.ref_logits, strict=True)):
        assert torch.equal(g, r), (
            f"{what}: decode step {step} logits differ from the uninterrupted run "
            f"(max abs diff {(g.float() - r.float()).abs().max().item():.3g}, "
            f"argmax {int(g.argmax())} vs {int(r.argmax())})"
        )


# ---- the engine side of one pipeline stage ---------------------------------------------------


def _device_slots(rng: np.random.Generator, num_tokens: int, page_size: int) -> np.ndarray:
    """Scattered device slots for ``num_tokens`` tokens: whole pages, in shuffled order."""
    pages = rng.permutation(POOL_TOKENS // page_size)[: num_tokens // page_size]
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)


def _offload_and_reload(
    address: str,
    kv: list[KV],
    *,
    dtype: torch.dtype,
    start_layer: int,
    page_size: int,
    token_padding: int = 0,
    seed: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> list[KV]:
    """What an engine stage does with layers [start_layer, start_layer + len(kv)) of a model.

    Puts ``kv`` into its own shm pool at scattered slots, registers and offloads them, wipes the pool,
    loads them back into other scattered slots, and reads each layer from the pool as soon as
    ``wait_layer`` says it landed (passing it to ``on_layer``). Returns the KV read back.
    """
    seq = kv[0][0].shape[0]
    end_layer = start_layer + len(kv)
    rng = np.random.default_rng(seed)
    write_slots = _device_slots(rng, seq, page_size)
    load_slots = _device_slots(rng, seq, page_size)
    assert not np.array_equal(write_slots, load_slots)
    assert (np.diff(write_slots) != 1).sum() >= seq // page_size // 2, "device slots should be scattered"
    write_idx, load_idx = torch.from_numpy(write_slots), torch.from_numpy(load_slots)
    expected_bytes = seq * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize * len(kv)

    layout = KVLayout.mha(KV_HEADS, HEAD_DIM)
    with ShmKVPool(layout, dtype, len(kv), POOL_TOKENS, token_padding=token_padding) as pool:
        for local, (k, v) in enumerate(kv):
            pool.k_buffer(local)[write_idx] = k
            pool.v_buffer(local)[write_idx] = v
        client = KVClient(address)
        try:
            client.register(
                model=MODEL_NAME, pool=pool, start_layer=start_layer, end_layer=end_layer,
                num_layers=NUM_LAYERS, host_tokens=2 * seq, page_size=page_size,
                pp_rank=pp_rank, pp_size=pp_size,
            )
            host = client.alloc(seq)
            assert host.numel() == seq
            written = client.write(host_indices=host, device_indices=write_slots)
            assert written == expected_bytes, f"write moved {written} bytes, expected {expected_bytes}"
            if sync is not None:
                sync()

            for parts in pool.buffers:
                for buf in parts:
                    buf.zero_()
            handle = client.load(host_indices=host, device_indices=load_slots)
            loaded: list[KV] = []
            for layer in range(start_layer, end_layer):
                handle.wait_layer(layer, timeout=TIMEOUT)
                local = layer - start_layer
                k, v = pool.k_buffer(local)[load_idx], pool.v_buffer(local)[load_idx]  # copies
                loaded.append((k, v))
                if on_layer is not None:
                    on_layer(layer, k, v)
            nbytes = handle.wait(timeout=TIMEOUT)
            assert nbytes == expected_bytes, f"load reported {nbytes} bytes, expected {expected_bytes}"

            untouched = torch.ones(POOL_TOKENS, dtype=torch.bool)
            untouched[load_idx] = False
            for local, parts in enumerate(pool.buffers):
                for part, buf in enumerate(parts):
                    assert not buf[untouched].any(), (
                        f"layer {start_layer + local} part {part}: the load wrote outside its device slots"
                    )
            assert client.free(host) == seq
        finally:
            if client.registration is not None:
                client.unregister()
            client.close()
    return loaded


# ---- the checks can fail ---------------------------------------------------------------------


def test_logit_check_detects_corrupt_kv(prefilled: Prefilled) -> None:
    """The exact-logits oracle is not vacuous: damaged KV changes the continuation."""
    kv = prefilled.kv
    _assert_continues_exactly(prefilled, kv, "a cache rebuilt from the untouched KV")
    zeroed = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
    v_shifted = [(k, v.roll(1, dims=0)) for k, v in kv]  # K/V pairing off by one slot
    one_token_lost = [(k.clone(), v.clone()) for k, v in kv]
    for k, v in one_token_lost:
        k[PROMPT_TOKENS // 2] = 0
        v[PROMPT_TOKENS // 2] = 0
    layers_swapped = [kv[1], kv[0], *kv[2:]]
    corruptions = {
        "wiped pool (nothing loaded)": zeroed,
        "V read from the neighbouring slot": v_shifted,
        "one token's slot left empty": one_token_lost,
        "layers 0 and 1 swapped": layers_swapped,
    }
    for name, bad in corruptions.items():
        with pytest.raises(AssertionError, match="logits differ"):
            _assert_continues_exactly(prefilled, bad, name)
    # A joint permutation of whole tokens may leave the logits as they were; the KV check catches it.
    perm = torch.randperm(PROMPT_TOKENS, generator=torch.Generator().manual_seed(2))
    with pytest.raises(AssertionError, match="differs at token positions"):
        _assert_kv_equal([(k[perm], v[perm]) for k, v in kv], kv, "permuted")


# ---- one engine, all layers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "page_size, strided",
    [(1, False), (16, False), (16, True)],
    ids=["page1", "page16", "page16-strided"],
)
def test_model_kv_round_trip(daemon, prefilled: Prefilled, page_size: int, strided: bool) -> None:
    from transformers import DynamicCache

    dtype = prefilled.dtype
    cache = DynamicCache()

    def rebuild(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # The engine resumes layer ``layer`` as soon as it has landed, before later layers arrive.
        assert len(cache.layers if hasattr(cache, "layers") else cache.key_cache) == layer
        cache.update(_to_cache_layout(k), _to_cache_layout(v), layer)

    loaded = _offload_and_reload(
        daemon.address, prefilled.kv, dtype=dtype, start_layer=0, page_size=page_size,
        token_padding=3 * dtype.itemsize if strided else 0, seed=page_size + strided, on_layer=rebuild,
    )
    _assert_kv_equal(loaded, prefilled.kv, "KV after the daemon round trip")
    got = _decode(prefilled.model, cache, prefilled.first_token)
    for step, (g, r) in enumerate(zip(got, prefilled.ref_logits, strict=True)):
        assert torch.equal(g, r), (
            f"decode step {step} after reload: logits differ from the uninterrupted run "
            f"(max abs diff {(g.float() - r.float()).abs().max().item():.3g})"
        )


# ---- two pipeline stages, each its own engine process ----------------------------------------

STAGES = [(0, 2), (2, 4)]


def _pack(t: torch.Tensor) -> np.ndarray:
    """A tensor as raw bytes (numpy has no bfloat16), so it pickles without torch's shm sharing."""
    return t.contiguous().view(torch.uint8).numpy().copy()


def _unpack(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a).view(dtype)


def _stage_process(
    address: str, stage: int, kv_bytes: list[tuple[np.ndarray, np.ndarray]], dtype_name: str,
    page_size: int, barrier, results,
) -> None:
    """Runs in a spawned process: one pipeline stage's engine."""
    try:
        dtype = getattr(torch, dtype_name)
        kv = [(_unpack(k, dtype), _unpack(v, dtype)) for k, v in kv_bytes]

        def sync() -> None:
            barrier.wait(TIMEOUT)  # both stages registered and offloaded
            barrier.wait(TIMEOUT)  # the test has looked at the daemon

        loaded = _offload_and_reload(
            address, kv, dtype=dtype, start_layer=STAGES[stage][0], page_size=page_size,
            seed=10 + stage, pp_rank=stage, pp_size=len(STAGES), sync=sync,
        )
        results.put(("ok", stage, [(_pack(k), _pack(v)) for k, v in loaded]))
    except BaseException:
        barrier.abort()
        results.put(("error", stage, traceback.format_exc()))


@pytest.mark.parametrize(
    "prefilled, page_size",
    [(torch.float32, 1), (torch.bfloat16, 16)],
    ids=["fp32-page1", "bf16-page16"],
    indirect=["prefilled"],
)
def test_pipeline_stages_in_separate_processes(daemon, prefilled: Prefilled, page_size: int) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(STAGES) + 1)
    results = ctx.Queue()
    dtype_name = str(prefilled.dtype).removeprefix("torch.")
    procs = [
        ctx.Process(
            target=_stage_process,
            args=(
                daemon.address, stage, [(_pack(k), _pack(v)) for k, v in prefilled.kv[start:end]],
                dtype_name, page_size, barrier, results,
            ),
            name=f"stage{stage}",
            daemon=True,
        )
        for stage, (start, end) in enumerate(STAGES)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, list[KV]] = {}
    errors: list[str] = []

    def collect() -> None:
        for _ in procs:
            try:
                status, stage, payload = results.get(timeout=TIMEOUT)
            except queue.Empty:
                errors.append("a stage process sent nothing back")
                return
            if status == "ok":
                dtype = prefilled.dtype
                outcome[stage] = [(_unpack(k, dtype), _unpack(v, dtype)) for k, v in payload]
            else:
                errors.append(f"stage {stage} failed:\n{payload}")

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        barrier.wait(TIMEOUT)
        # Read on the daemon's loop: Stats lists other engines' clients only to the admin.
        seen = daemon.run(lambda: [(c.spec.layers.start, c.spec.layers.end, c.used_tokens)
                                   for c in daemon.core.clients.values()])
        ranges = sorted((start, end) for start, end, _ in seen)
        used = sorted(u for _, _, u in seen)
        barrier.wait(TIMEOUT)
    except threading.BrokenBarrierError:
        ranges = used = None  # a stage failed; its traceback is in ``errors``
    collector.join(TIMEOUT * 2)
    for p in procs:
        p.join(TIMEOUT)
        if p.is_alive():
            p.kill()
    assert not errors, "\n".join(errors)
    assert ranges == STAGES, f"expected both stages registered at once with ranges {STAGES}, saw {ranges}"
    assert used == [PROMPT_TOKENS] * len(STAGES), f"host tokens in use per stage: {used}"
    assert [p.exitcode for p in procs] == [0] * len(STAGES)
    assert sorted(outcome) == list(range(len(STAGES)))

    loaded = [layer for stage in range(len(STAGES)) for layer in outcome[stage]]
    _assert_kv_equal(loaded, prefilled.kv, "KV after both stages' round trips")
    _assert_continues_exactly(prefilled, loaded, "cache rebuilt from both stages")
