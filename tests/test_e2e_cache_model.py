"""A real model across the cache: two replicas of a tiny, randomly initialised Hugging Face Llama,
each its own process. Replica A prefills a prompt and Puts its KV pages; replica B Gets the prefix
pages into its own pool, continues the prompt and decodes from them, and its logits are
bit-identical to A's uninterrupted run (same model, same ops: nothing but the KV bytes could make
them differ; test_e2e_hf_model.py shows this oracle catches damaged KV). B's KV is also compared bit
for bit with what B computes itself, since a permutation of whole tokens could leave the logits
unchanged."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_e2e_hf_model import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    NUM_LAYERS,
    VOCAB,
    _build_model,
    _cache_from,
    _cache_kwarg,
    _layer_kv,
    _output_cache,
    _to_pool_layout,
)

from kvclient import KVClient, KVLayout, ShmKVPool  # noqa: E402
from kvclient.keys import page_keys  # noqa: E402

PAGE = 16
PREFIX_PAGES = 3
PROMPT = PREFIX_PAGES * PAGE + 9  # a partial page after the whole ones
POOL_PAGES = 32
STEPS = 5


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _continue(model, cache, tokens: torch.Tensor) -> list[np.ndarray]:
    """Runs ``tokens`` over ``cache`` then decodes greedily; each step's logits as float32 bytes."""
    kw = _cache_kwarg(model)
    out = model(input_ids=tokens, use_cache=True, **{kw: cache})
    logits = [out.logits[0, -1].float().numpy().copy()]
    cache = _output_cache(out)
    for _ in range(STEPS):
        token = int(out.logits[0, -1].argmax())
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{kw: cache})
        cache = _output_cache(out)
        logits.append(out.logits[0, -1].float().numpy().copy())
    return logits


@torch.no_grad()
def _prefix_kv(model, prompt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prefix pages' KV per layer, [tokens, heads, dim] each."""
    cache = _output_cache(model(input_ids=prompt[:, :PREFIX_PAGES * PAGE], use_cache=True))
    return [tuple(_to_pool_layout(t) for t in _layer_kv(cache, layer)) for layer in range(NUM_LAYERS)]


def _replica(address: str, role: str, dtype_name: str, out) -> None:
    try:
        torch.set_num_threads(1)
        dtype = getattr(torch, dtype_name)
        model = _build_model(dtype)
        prompt = _prompt()
        keys = page_keys(prompt[0], PAGE)
        assert len(keys) == PREFIX_PAGES * 16  # 16-byte keys of the whole pages only
        own = _prefix_kv(model, prompt)
        rng = np.random.default_rng(0 if role == "A" else 1)
        pages = rng.permutation(POOL_PAGES)[:PREFIX_PAGES]
        slots = torch.from_numpy((pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1))
        with ShmKVPool(KVLayout.mha(KV_HEADS, HEAD_DIM), dtype, NUM_LAYERS, POOL_PAGES * PAGE) as pool, \
                KVClient(address, resilient=False) as client:
            client.register(model="tiny-random-llama", pool=pool, start_layer=0, end_layer=NUM_LAYERS,
                            num_layers=NUM_LAYERS, host_tokens=PAGE, page_size=PAGE)
            if role == "A":
                for layer, (k, v) in enumerate(own):
                    pool.k_buffer(layer)[slots] = k
                    pool.v_buffer(layer)[slots] = v
                r = client.put(keys, pages)
                # The uninterrupted run: A's own cache, continued with the rest of the prompt.
                logits = _continue(model, _cache_from(own), prompt[:, PREFIX_PAGES * PAGE:])
                out.put(("ok", {"stored": r.stored, "logits": logits}))
            else:
                assert client.lookup(keys).pages == PREFIX_PAGES
                handle = client.get(keys, pages)
                got = handle.pages(timeout=30)
                handle.wait(timeout=30)
                kv = [(pool.k_buffer(layer)[slots].clone(), pool.v_buffer(layer)[slots].clone())
                      for layer in range(NUM_LAYERS)]
                exact = [torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv, own, strict=True)
                         for a, b in ((ka, kb), (va, vb))]
                logits = _continue(model, _cache_from(kv), prompt[:, PREFIX_PAGES * PAGE:])
                out.put(("ok", {"pages": got, "exact": exact, "logits": logits}))
            client.unregister()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _run(ctx, address: str, role: str, dtype_name: str) -> dict:
    out = ctx.Queue()
    p = ctx.Process(target=_replica, args=(address, role, dtype_name, out), daemon=True)
    p.start()
    try:
        kind, payload = out.get(timeout=120)
    except queue.Empty:
        pytest.fail(f"replica {role} sent nothing back")
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert kind == "ok", f"replica {role} failed:\n{payload}"
    assert p.exitcode == 0
    return payload


@pytest.mark.parametrize("dtype_name", ["bfloat16"])
def test_replica_continues_from_cached_pages_exactly(daemon, dtype_name: str) -> None:
    ctx = mp.get_context("spawn")
    a = _run(ctx, daemon.address, "A", dtype_name)
    assert a["stored"] == PREFIX_PAGES
    b = _run(ctx, daemon.address, "B", dtype_name)
    assert b["pages"] == PREFIX_PAGES
    assert all(b["exact"]), f"B's KV differs from its own prefill (per layer K, V): {b['exact']}"
    for step, (got, want) in enumerate(zip(b["logits"], a["logits"], strict=True)):
        assert np.array_equal(got, want), (
            f"step {step}: logits differ from the uninterrupted run by up to {np.abs(got - want).max():.3g}")
    assert len(a["logits"]) == STEPS + 1
