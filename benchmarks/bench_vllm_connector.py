"""The vLLM connector's worker side (``kvclient.vllm._worker.WorkerSide``, what KVServerConnector runs
in each vLLM worker) against a bare in-process copy of the same blocks, measured in the same run.

Two workers register vLLM 0.33's per-layer views (vLLM's own ``create_kv_cache_views`` over shared
memory, in --layout) with one daemon subprocess. Each round worker A stores --blocks fresh blocks
(``wait_for_save``: one Put, then ``get_finished`` until it is done) and worker B loads them into
other blocks (``start_load_kv``, ``wait_for_layer_load`` for every layer in order, then
``get_block_ids_with_load_errors``, which must be empty). The baseline, in this process: the same
blocks copied from A's views into B's, layer by layer (one copy, as an engine-local host tier would
do each way). Also timed: how long after ``start_load_kv`` layer 0 is usable, against the whole load.
The cache is filled first, so that timed Puts evict and reuse memory the daemon has touched. Rounds
are interleaved; figures are medians.

Run: python benchmarks/bench_vllm_connector.py [--blocks 64] [--layers 32] [--layout LBNHC]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import vllm_env  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402

from kvserver.config import parse_size  # noqa: E402

BLOCK, HEADS, HEAD = 16, 8, 128


def views(layout: str, blocks: int, layers: int):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvclient.views_pool import SharedKVMemory

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    strides = compute_layout_strides(spec, blocks, layers, KVCacheLayout[layout])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(size=spec.page_size_bytes * blocks * layers, layers=names,
                           layer_stride=strides[0], block_stride=strides[1])
    mem = SharedKVMemory(tensor.size)
    vs = create_kv_cache_views(mem.tensor.view(torch.int8), spec, blocks, KVCacheLayout[layout], tensor)
    return mem, dict(zip(names, vs, strict=True)), spec.page_size_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=64, help="blocks stored and loaded per round")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layout", default="LBNHC", help="vLLM 0.33 KV cache layout (LBNHC is vLLM's default)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--host-memory", default="1GiB")
    args = ap.parse_args()
    vllm_env.setup()
    import torch

    from kvclient.vllm._meta import KVServerConnectorMetadata, LoadJob, SaveJob
    from kvclient.vllm._space import Space
    from kvclient.vllm._worker import WorkerSide
    from kvserver.protocol.layout import KVLayout

    tmp = tempfile.mkdtemp(prefix="kvbench-")
    daemon = DaemonProcess(os.path.join(tmp, "kv.sock"), host_memory=args.host_memory)
    space = Space(model="bench-vllm", layout=KVLayout.mha(HEADS, HEAD), dtype=torch.bfloat16, page_size=BLOCK,
                  num_layers=args.layers, tp_size=1, pp_size=1, hash_stride=1)
    pool_blocks = 2 * args.blocks + 1
    mem_a, caches_a, page = views(args.layout, pool_blocks, args.layers)
    mem_b, caches_b, _ = views(args.layout, pool_blocks, args.layers)
    a = WorkerSide(space, {"address": daemon.address, "timeout_s": 60.0, "layerwise": True}, True)
    b = WorkerSide(space, {"address": daemon.address, "timeout_s": 60.0, "layerwise": True}, True)
    a.register_kv_caches(caches_a)
    b.register_kv_caches(caches_b)
    names = list(caches_a)
    src = list(range(1, args.blocks + 1))
    dst = list(range(args.blocks + 1, 2 * args.blocks + 1))
    total = args.blocks * page * args.layers
    round_no = [0]
    first_layer: list[float] = []
    try:
        for v in caches_a.values():
            v.view(torch.int16).random_(-30000, 30000)

        def keys() -> bytes:
            h, out = b"", b""
            for i in range(args.blocks):
                h = hashlib.sha256(h + f"{round_no[0]}:{i}".encode()).digest()
                out += h
            return out

        def save() -> None:
            round_no[0] += 1
            a.wait_for_save(KVServerConnectorMetadata(saves=[SaveJob("r", keys(), src)]))
            while a.get_finished({"r"})[0] != {"r"}:
                time.sleep(0.0002)

        def load() -> None:
            t0 = time.perf_counter()
            b.start_load_kv(KVServerConnectorMetadata(loads=[LoadJob("q", keys(), dst)]))
            for i, name in enumerate(names):
                b.wait_for_layer_load(name)
                if i == 0:
                    first_layer.append(time.perf_counter() - t0)
            assert b.load_errors() == set()

        idx_src, idx_dst = torch.tensor(src), torch.tensor(dst)

        pairs = [(caches_b[name][d], caches_a[name][s_])
                 for name in names for s_, d in zip(src, dst, strict=True)]

        def in_process() -> None:  # block by block: torch's fastest here (index_copy_ is ~10x slower)
            for out, inp in pairs:
                out.copy_(inp)

        fns = {"save (Put)": save, "load (Get, per layer)": load, "in-process copy": in_process}
        for _ in range(parse_size(args.host_memory) // total + 1):  # fill the cache first
            save()
        load()
        times: dict[str, list[float]] = {name: [] for name in fns}
        first_layer.clear()
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        for v in caches_b.values():
            v.zero_()
        load()
        for name in names:
            same = torch.equal(caches_a[name][idx_src].view(torch.int16),
                               caches_b[name][idx_dst].view(torch.int16))
            assert same, f"{name}: the loaded blocks differ from the stored ones"
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"layout {args.layout}: {args.blocks} blocks x {args.layers} layers of {page / 2**10:.0f} KiB "
              f"= {total / 2**20:.0f} MiB per round, medians of {args.repeats}")
        for name, t in med.items():
            print(f"  {name:22s} {t * 1e3:8.1f} ms  {total / t / 1e9:6.2f} GB/s")
        base = med["in-process copy"]
        print(f"  save / in-process copy: {med['save (Put)'] / base:.2f}x the time; "
              f"load / in-process copy: {med['load (Get, per layer)'] / base:.2f}x the time")
        whole, first = med["load (Get, per layer)"], statistics.median(first_layer)
        print(f"  layer 0 usable after {first * 1e3:.1f} ms of a {whole * 1e3:.1f} ms load "
              f"({first / whole * args.layers:.2f}/{args.layers} of it)")
    finally:
        a.shutdown()
        b.shutdown()
        daemon.stop()
        mem_a.close()
        mem_b.close()
        shutil.rmtree(tmp, ignore_errors=True)
        vllm_env.restore()


if __name__ == "__main__":
    main()
