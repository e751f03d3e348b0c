"""A Register that needs the cache's memory: how long it takes, and how long other engines wait meanwhile.

The daemon runs as a subprocess. Engine A fills the cache with pages of --page-bytes (MLA, bf16, one
layer), Put after Put, until it holds --fill of the budget; engine B then registers a region of
--frac of what the cache holds (pages of one 512-byte token), which the cache must give way to
(docs/cache.md, "Budget and eviction"). Meanwhile a probe process, a third engine, calls Stats back
to back (bench_control.py's probe). Each run prints the Register's wall time, the probe's longest
Stats while it ran, and, as the baseline of the same run, the probe's longest Stats over an idle
window as long as the Register took just before it; the ratio is the second over the third. Every
run has a fresh daemon. Run:
python benchmarks/bench_register_room.py [--host-memory 1GiB] [--page-bytes 128 262144] [--runs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from bench_control import end_probe, longest_call, probe  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402

from kvclient import KVLayout, ShmKVPool  # noqa: E402
from kvclient._messages import register_request  # noqa: E402
from kvclient._transport.fd_socket import ticketed  # noqa: E402
from kvserver.config import parse_size  # noqa: E402
from kvserver.v1 import kvserver_pb2 as pb  # noqa: E402
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc  # noqa: E402

MESSAGE_LIMIT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
TOKEN_BYTES = 512  # MLA of rank 256, bf16: a token's bytes (engine B's pages: one token each)


def _layout(page_bytes: int) -> tuple[KVLayout, int]:
    """A one-layer MLA bf16 layout and page size whose pages are ``page_bytes``."""
    if page_bytes >= TOKEN_BYTES:
        return KVLayout.mla(TOKEN_BYTES // 2, 0), page_bytes // TOKEN_BYTES
    return KVLayout.mla(page_bytes // 2, 0), 1


def _register(address: str, stub, pool: ShmKVPool, host_tokens: int, page_size: int) -> pb.RegisterResponse:
    req = register_request(model="room", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                           host_tokens=host_tokens, page_size=page_size, tp_rank=0, tp_size=1,
                           pp_rank=0, pp_size=1)
    return stub.Register(ticketed(address, pool, req), timeout=600)


def one_run(host_memory: int, page_bytes: int, fill: float, frac: float) -> dict:
    ctx = mp.get_context("spawn")
    layout, page_size = _layout(page_bytes)
    per_put = max(1, min(1 << 17, (64 << 20) // page_bytes))  # device pages a Put stores
    with tempfile.TemporaryDirectory(prefix="kvroom-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--log-level", "ERROR", host_memory=str(host_memory))
        stop, (mine, theirs) = ctx.Event(), ctx.Pipe()
        prober = None
        try:
            with grpc.insecure_channel(d.address, options=MESSAGE_LIMIT) as ch, \
                    ShmKVPool(layout, torch.bfloat16, num_layers=1, num_tokens=per_put * page_size) as pa, \
                    ShmKVPool(KVLayout.mla(TOKEN_BYTES // 2, 0), torch.bfloat16, num_layers=1,
                              num_tokens=64) as pb_:
                stub = pb_grpc.KVServerStub(ch)
                # The probe registers first: its small region at the bottom of the arena, not in the
                # middle of the cache's slabs, where it would split the room B's region needs.
                prober = ctx.Process(target=probe, args=(d.address, stop, theirs))
                prober.start()
                assert mine.recv() == "ready"
                a = _register(d.address, stub, pa, 0, page_size).client_id
                pa.buffers[0][0].view(torch.uint8).fill_(0xAB)
                t0, stored, cached = time.monotonic(), 0, -1
                while cached < d.stats().cache_bytes < fill * host_memory:  # (tiny pages: until it
                    cached = d.stats().cache_bytes  # grows no more, their bookkeeping charged)
                    keys = np.arange(stored, stored + per_put, dtype=np.uint64).repeat(2).tobytes()
                    put = pb.PutRequest(client_id=a, keys=keys, key_bytes=16, device_pages=range(per_put))
                    if stub.Put(put, timeout=600).stored < per_put:
                        break
                    stored += per_put
                filled, cached = time.monotonic() - t0, d.stats().cache_bytes
                time.sleep(1.0)
                idle0 = time.monotonic()
                time.sleep(1.0)
                r0 = time.monotonic()
                reg = _register(d.address, stub, pb_, int(frac * cached) // TOKEN_BYTES, 1)
                r1 = time.monotonic()
                time.sleep(0.2)
                left = d.stats().cache_bytes
        finally:
            calls = end_probe(stop, mine, prober)
            d.stop()
    took = r1 - r0
    return {"cached": cached, "left": left, "filled": filled, "granted": reg.host_tokens * TOKEN_BYTES,
            "took": took, "held": longest_call(calls, r0, r1),
            "idle": longest_call(calls, idle0, idle0 + min(took, 1.0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host-memory", default="1GiB")
    ap.add_argument("--page-bytes", type=int, nargs="+", default=[128, 256 << 10])
    ap.add_argument("--fill", type=float, default=0.85, help="share of the budget the cache fills first")
    ap.add_argument("--frac", type=float, default=0.8, help="B's region, as a share of what the cache holds")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    budget = parse_size(args.host_memory)
    print(f"budget {args.host_memory}; cache filled to {args.fill:.0%} of it, then a Register of "
          f"{args.frac:.0%} of what it holds")
    for page_bytes in args.page_bytes:
        ratios = []
        for run in range(args.runs):
            r = one_run(budget, page_bytes, args.fill, args.frac)
            ratio = r["held"] / max(r["idle"], 1e-6)
            ratios.append(ratio)
            print(f"  pages of {page_bytes} B, run {run + 1}: cache {r['cached'] >> 20} MiB (filled in "
                  f"{r['filled']:.1f} s), Register of {r['granted'] >> 20} MiB took "
                  f"{r['took'] * 1e3:.1f} ms, left {r['left'] >> 20} MiB cached; probe's longest Stats "
                  f"meanwhile {r['held'] * 1e3:.1f} ms, idle {r['idle'] * 1e3:.1f} ms: {ratio:.1f}x")
        print(f"  pages of {page_bytes} B: probe's longest Stats during the Register over idle, median "
              f"{statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
