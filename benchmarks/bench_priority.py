"""Prefetch before offload: a small load's latency while another engine offloads 1 GiB at a time.

The daemon runs as a subprocess. An "offloader" engine process writes --offload-mib of scattered
16-token pages (MHA 8 KV heads x 128, bf16, 32 layers) in one call, again and again. This process
is a second engine: it times --trips small loads (one page, over --small-layers layers) with the
daemon idle, then while the offloader runs, in turn (idle, busy, idle, busy, ...) so that drift in
the machine's speed hits both alike. It prints p50/p99 of each and the ratio busy / idle; the
target is a p99 ratio of at most 2.

Run: python benchmarks/bench_priority.py [--offload-mib 1024] [--copy-threads 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from daemon_proc import DaemonProcess  # noqa: E402

from kvclient import KVClient, KVLayout, ShmKVPool  # noqa: E402

LAYOUT = KVLayout.mha(8, 128)
LAYERS = 32
PAGE = 16
PAGE_BYTES = PAGE * LAYOUT.token_bytes(torch.bfloat16) * LAYOUT.num_parts * LAYERS  # 2 MiB


def offloader(address: str, mib: int, go, quiet, stop, counts) -> None:
    """Offloads while ``go`` is set; ``quiet`` is set while it is not writing."""
    pages = max(1, (mib << 20) // PAGE_BYTES)
    tokens = pages * PAGE
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, 2 * tokens) as pool, KVClient(address, timeout=60) as c:
        c.register(model="offload", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                   host_tokens=tokens, page_size=PAGE)
        host = c.alloc(tokens)
        rng = np.random.default_rng(0)
        dev_pages = torch.from_numpy(rng.permutation(2 * pages)[:pages])
        dev = (dev_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        c.write(host_indices=host, device_indices=dev)  # first touch of every page
        while not stop.is_set():
            quiet.set()
            if not go.wait(0.1):
                continue
            quiet.clear()
            if go.is_set():
                c.write(host_indices=host, device_indices=dev)
                counts.value += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offload-mib", type=int, default=1024)
    ap.add_argument("--copy-threads", type=int, default=2)
    ap.add_argument("--small-layers", type=int, default=LAYERS, help="layers of the small load (1 page)")
    ap.add_argument("--trips", type=int, default=400, help="small loads per phase")
    ap.add_argument("--rounds", type=int, default=4, help="idle/busy phases each")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    host_mib = args.offload_mib + 256
    with tempfile.TemporaryDirectory(prefix="kvs-prio-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--copy-threads", str(args.copy_threads),
                          host_memory=f"{host_mib}MiB")
        try:
            go, quiet, stop = ctx.Event(), ctx.Event(), ctx.Event()
            counts = ctx.Value("i", 0)
            with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, 4 * PAGE) as pool, KVClient(d.address) as c:
                c.register(model="small", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=2 * PAGE, page_size=PAGE)
                host = c.alloc(PAGE)
                c.write(host_indices=host, device_indices=torch.arange(PAGE))
                layers = list(range(args.small_layers))
                dev = torch.arange(PAGE, 2 * PAGE)

                def trip() -> float:
                    t = time.perf_counter()
                    assert c.load(host_indices=host, device_indices=dev, layers=layers).wait() > 0
                    return time.perf_counter() - t

                for _ in range(50):
                    trip()  # warm-up
                idle: list[float] = []
                busy: list[float] = []
                proc = ctx.Process(target=offloader,
                                   args=(d.address, args.offload_mib, go, quiet, stop, counts))
                proc.start()
                try:
                    if not quiet.wait(300):
                        raise RuntimeError("the offloader did not start")
                    for r in range(args.rounds):
                        go.clear()
                        quiet.wait(300)  # its offload in flight has ended
                        idle += [trip() for _ in range(args.trips)]
                        go.set()
                        while quiet.is_set():  # its next offload has begun
                            time.sleep(0.001)
                        busy += [trip() for _ in range(args.trips)]
                        print(f"round {r + 1}/{args.rounds}: {counts.value} offloads so far", file=sys.stderr)
                finally:
                    stop.set()
                    go.set()
                    proc.join(120)
        finally:
            d.stop()
    small_kib = PAGE * LAYOUT.token_bytes(torch.bfloat16) * LAYOUT.num_parts * args.small_layers >> 10
    print(f"small load: 1 page x {args.small_layers} layers ({small_kib} KiB); offloads of "
          f"{args.offload_mib} MiB ({counts.value} done meanwhile); --copy-threads {args.copy_threads}")
    print(f"{'':>8} {'p50':>10} {'p99':>10}")
    i50, i99 = statistics.median(idle), percentile(idle, 0.99)
    b50, b99 = statistics.median(busy), percentile(busy, 0.99)
    print(f"{'idle':>8} {i50 * 1e3:>8.2f}ms {i99 * 1e3:>8.2f}ms")
    print(f"{'busy':>8} {b50 * 1e3:>8.2f}ms {b99 * 1e3:>8.2f}ms")
    print(f"{'ratio':>8} {b50 / i50:>9.2f}x {b99 / i99:>9.2f}x   (target: p99 ratio <= 2)")


if __name__ == "__main__":
    main()
