"""The compute model of the multi-turn benchmark: prefill time of a small Llama timed on this machine.

A Llama is built from a config under a fixed seed (nothing is downloaded, as in
tests/test_e2e_hf_model.py), and the prefill of ``n`` new tokens after a cached prefix of ``p`` tokens
is timed at a few (n, p) points (the fastest of a few runs each). A least-squares fit of

    t(n, p) = a + b * n + c * n * (p + n / 2)

(a fixed cost, the per-token matmuls, and attention over the cached and new tokens) then prices
every prefill of the simulation. The benchmark times it in a forked child (``start``), so that
transformers is imported there only; run as a script it prints the points and the fit as JSON.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 512
    vocab: int = 1024
    dtype: str = "float32"

    def kv_token_bytes(self) -> int:
        """Bytes of one token's KV over every layer, K and V."""
        return self.layers * 2 * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)


FULL_POINTS = [(n, p) for p in (0, 512, 1024) for n in (64, 256, 512)]
QUICK_POINTS = [(32, 0), (128, 0), (32, 128), (128, 128)]


def fit(points: list[dict]) -> dict:
    """Least-squares a, b, c (each clipped at zero and the others refitted) and the fit's R^2."""
    n = np.array([pt["n"] for pt in points], dtype=float)
    p = np.array([pt["p"] for pt in points], dtype=float)
    t = np.array([pt["seconds"] for pt in points], dtype=float)
    cols = [np.ones_like(n), n, n * (p + n / 2)]
    keep = [0, 1, 2]
    while True:
        x = np.stack([cols[i] for i in keep], 1)
        coef, *_ = np.linalg.lstsq(x, t, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = [0.0, 0.0, 0.0]
    for i, c in zip(keep, coef, strict=True):
        full[i] = max(float(c), 0.0)
    pred = full[0] + full[1] * n + full[2] * n * (p + n / 2)
    ss = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - float(((t - pred) ** 2).sum()) / ss if ss > 0 else 1.0
    return {"a_s": full[0], "b_s_per_token": full[1], "c_s_per_token_pair": full[2], "r2": r2,
            "formula": "t = a + b*n + c*n*(p + n/2)"}


def prefill_seconds(model_fit: dict, n: int, p: int) -> float:
    if n <= 0:
        return 0.0
    f = model_fit
    return f["a_s"] + f["b_s_per_token"] * n + f["c_s_per_token_pair"] * n * (p + n / 2)


def time_points(cfg: ModelConfig, points: list[tuple[int, int]], repeats: int) -> list[dict]:
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab,
                         max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(getattr(torch, cfg.dtype)).eval()
    params = set(inspect.signature(model.forward).parameters)
    cache_kw = "cache" if "cache" in params else "past_key_values"
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    gen = torch.Generator().manual_seed(1)
    out = []
    with torch.no_grad():
        model(input_ids=torch.randint(0, cfg.vocab, (1, 16), generator=gen), use_cache=True)  # warm-up
        for n, p in points:
            prefix_cache = None
            if p:
                r = model(input_ids=torch.randint(0, cfg.vocab, (1, p), generator=gen), use_cache=True)
                prefix_cache = getattr(r, "cache", None) or r.past_key_values
            ids = torch.randint(0, cfg.vocab, (1, n), generator=gen)
            times = []
            for _ in range(repeats):
                kw = {cache_kw: copy.deepcopy(prefix_cache) if p else DynamicCache()}
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True, **kw, **extra)
                times.append(time.perf_counter() - t0)
            # The fastest run: the machine may be shared, and others' load is not the model's cost.
            out.append({"n": n, "p": p, "seconds": min(times), "median_s": statistics.median(times),
                        "repeats": repeats})
    return out


def measure(cfg: ModelConfig, quick: bool) -> dict:
    import torch
    import transformers

    points = time_points(cfg, QUICK_POINTS if quick else FULL_POINTS, 1 if quick else 5)
    return {"config": asdict(cfg), "points": points, "fit": fit(points), "torch_threads": 1,
            "torch": torch.__version__, "transformers": transformers.__version__}


def child_context(spawn: bool = False):
    """Fork (fast: the child has torch already) while this process runs no thread but its own
    and torch's helper, and has no gRPC channel open (gRPC and its threads do not survive a fork);
    else, or when asked, spawn."""
    import os
    import threading

    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 99
    if spawn or threading.active_count() > 1 or tasks > 2:
        return mp.get_context("spawn")
    return mp.get_context("fork")


def _child(conn, cfg: ModelConfig, quick: bool) -> None:
    try:
        conn.send(("ok", measure(cfg, quick)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Timing:
    """``measure`` in a child process (``child_context``)."""

    def __init__(self, cfg: ModelConfig, quick: bool, spawn: bool = False) -> None:
        ctx = child_context(spawn)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, cfg, quick), daemon=True)
        self.proc.start()
        self.value: dict | None = None

    def result(self, timeout: float = 300) -> dict:
        if self.value is None:
            if not self.conn.poll(timeout):
                self.proc.kill()
                raise RuntimeError(f"timing the model took over {timeout} s")
            kind, value = self.conn.recv()
            self.proc.join(30)
            if kind == "error":
                raise RuntimeError(f"timing the model failed:\n{value}")
            self.value = value
        return self.value

    def close(self) -> None:
        """Ends the child if it is still timing (the run failed before asking for the result)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default="{}", help="ModelConfig fields as JSON")
    args = ap.parse_args()
    cfg = ModelConfig(**json.loads(args.config))
    json.dump(measure(cfg, args.quick), sys.stdout)


if __name__ == "__main__":
    main()
