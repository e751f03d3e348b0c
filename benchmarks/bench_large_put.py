"""The largest Put a request may be: how long it takes, and how long other engines wait meanwhile.

The daemon runs as a subprocess. An engine registers rank 0 of an MHA model at TP --tp (a space of
--tp parts: each new key is counted across them) with pages of 512 bytes (one head of 64 fp16
values, K and V, one layer, 2 tokens a page), then makes --puts Puts of 128 Ki new keys each (the
most a request may name), its pages stored whole. Meanwhile a probe process, a second engine,
calls Stats back to back (bench_control.py's probe). Each Put prints its wall time and the probe's
longest Stats while it ran, and, as the baseline of the same run, the probe's longest Stats over an
idle window as long as the Put, just before it; the ratio is the second over the third. Run:
python benchmarks/bench_large_put.py [--tp 1 4] [--puts 5] [--host-memory 1GiB]
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
from kvserver.v1 import kvserver_pb2 as pb  # noqa: E402
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc  # noqa: E402

MESSAGE_LIMIT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
KEYS = 1 << 17  # the most keys one Put may name
PAGE_TOKENS = 2  # of 256 bytes a token (MHA 1 x 64 fp16, K and V, one layer): 512-byte pages


def one_run(host_memory: str, tp: int, puts: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvput-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--log-level", "ERROR", host_memory=host_memory)
        stop, (mine, theirs) = ctx.Event(), ctx.Pipe()
        prober = None
        done: list[tuple[float, float, int]] = []
        try:
            with grpc.insecure_channel(d.address, options=MESSAGE_LIMIT) as ch, \
                    ShmKVPool(KVLayout.mha(1, 64), torch.float16, num_layers=1,
                              num_tokens=KEYS * PAGE_TOKENS) as pool:
                stub = pb_grpc.KVServerStub(ch)
                req = register_request(model="put", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                                       host_tokens=0, page_size=PAGE_TOKENS, tp_rank=0, tp_size=tp,
                                       pp_rank=0, pp_size=1)
                cid = stub.Register(ticketed(d.address, pool, req), timeout=600).client_id
                prober = ctx.Process(target=probe, args=(d.address, stop, theirs))
                prober.start()
                assert mine.recv() == "ready"
                time.sleep(1.0)
                for i in range(puts):
                    keys = np.arange(i * KEYS, (i + 1) * KEYS, dtype=np.uint64).repeat(2).tobytes()
                    put = pb.PutRequest(client_id=cid, keys=keys, key_bytes=16, device_pages=range(KEYS))
                    time.sleep(0.5)  # the idle window before it
                    t0 = time.monotonic()
                    stored = stub.Put(put, timeout=600).stored
                    done.append((t0, time.monotonic(), stored))
                time.sleep(0.2)
        finally:
            calls = end_probe(stop, mine, prober)
            d.stop()
    out = []
    for t0, t1, stored in done:
        took = t1 - t0
        out.append({"took": took, "stored": stored, "held": longest_call(calls, t0, t1),
                    "idle": longest_call(calls, t0 - 0.05 - took, t0 - 0.05)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host-memory", default="1GiB")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 4], help="the space's parts (MHA TP sizes)")
    ap.add_argument("--puts", type=int, default=5)
    args = ap.parse_args()
    print(f"budget {args.host_memory}; Puts of {KEYS} new keys, pages of {PAGE_TOKENS * 256} B")
    for tp in args.tp:
        ratios = []
        for i, r in enumerate(one_run(args.host_memory, tp, args.puts)):
            ratio = r["held"] / max(r["idle"], 1e-6)
            ratios.append(ratio)
            print(f"  TP {tp}, Put {i + 1}: {r['stored']} stored in {r['took'] * 1e3:.1f} ms; probe's "
                  f"longest Stats meanwhile {r['held'] * 1e3:.1f} ms, idle {r['idle'] * 1e3:.1f} ms: "
                  f"{ratio:.1f}x")
        print(f"  TP {tp}: probe's longest Stats during a Put over idle, median "
              f"{statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
