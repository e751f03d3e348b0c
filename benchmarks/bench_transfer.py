"""Write/load bandwidth through the daemon against the same copy done inside one process.

The daemon runs as a subprocess on a temp Unix socket; this process is the engine, with its KV
pool in shared memory. Every figure is measured in the same run:

- memcpy:      one contiguous copy of the same number of bytes (the machine's copy speed);
- naive:       the scattered page copy done in this process with plain torch indexing
               (``dst[dev] = src[host]`` per layer and part) on the same page-first host layout;
- in-process:  the same copy done in this process with the daemon's own copy plan and one-call
               kernel into a buffer laid out as the daemon's region (the transfer suite's
               ``InProcess``), i.e. what an engine would get by copying itself;
- daemon:      Write (device -> host) and Load (host -> device, until the last layer landed).

Ratios are daemon / in-process: what going through the daemon costs over copying in the engine.
Run: python benchmarks/bench_transfer.py (the matrix of sizes, page sizes and layouts with the
same copies: python benchmarks/run.py transfer)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suites import common  # noqa: E402
from suites.transfer import InProcess  # noqa: E402

from kvclient import KVClient, KVLayout, ShmKVPool  # noqa: E402


def start_daemon(socket: str, host_memory: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserver", "--socket", socket, "--host-memory", host_memory,
         "--log-level", "WARNING"],
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(socket):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("daemon did not start")
        time.sleep(0.05)
    return proc


def interleaved(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn so that drift in machine speed hits all alike
    (the timing of benchmarks/run.py's suites)."""
    return {name: statistics.median(ts) for name, ts in common.interleaved(fns, repeats).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--mib", type=int, default=64, help="bytes per transfer, all layers (>= 32)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # One thread for every torch op here, like the daemon's kernel: idle OpenMP threads spinning
    # after a parallel copy would otherwise steal the cores from whichever side runs next.
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    layout = KVLayout.mha(args.heads, args.head_dim)
    token_bytes = layout.token_bytes(dtype) * layout.num_parts * args.layers
    tokens = args.mib * (1 << 20) // token_bytes // args.page_size * args.page_size
    pages = tokens // args.page_size
    pool_tokens = tokens * 4
    nbytes = tokens * token_bytes
    g = torch.Generator().manual_seed(args.seed)

    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp, \
            ShmKVPool(layout, dtype, args.layers, pool_tokens) as pool:
        for layer in pool.buffers:
            for buf in layer:
                buf.view(torch.int16).random_(generator=g)
        # Scattered, whole pages on both sides; the in-process copy is the transfer suite's (the
        # daemon's plan and one-call kernel, into a buffer laid out as the daemon's region).
        base = InProcess(pool, args.page_size, pages, g)
        dev_pages, dev = base.dev_pages, base.dev

        # ---- in-process baselines on the same layouts -------------------------------------
        host_pages_total = pages * 2
        chunk = args.page_size * layout.token_bytes(dtype) // 8  # int64 words per page chunk
        parts = layout.num_parts
        host = torch.zeros(host_pages_total, args.layers, parts, chunk, dtype=torch.int64)
        hp = torch.randperm(host_pages_total, generator=g)[:pages]
        dev_views = [[b.view(torch.int64).view(-1, chunk) for b in layer] for layer in pool.buffers]

        def naive(to_device: bool) -> None:
            for layer in range(args.layers):
                for part in range(parts):
                    if to_device:
                        dev_views[layer][part][dev_pages] = host[hp, layer, part]
                    else:
                        host[hp, layer, part] = dev_views[layer][part][dev_pages]

        def planned(to_device: bool) -> None:
            base.copy(to_device)

        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)

        # ---- through the daemon, measured in turn with the baselines ----------------------
        socket = os.path.join(tmp, "kv.sock")
        daemon = start_daemon(socket, f"{4 * nbytes // (1 << 20) + 64}MiB")
        try:
            with KVClient(socket) as client:
                client.register(model="bench", pool=pool, start_layer=0, end_layer=args.layers,
                                num_layers=args.layers, host_tokens=2 * tokens,
                                page_size=args.page_size)
                all_host = client.alloc(2 * tokens).view(-1, args.page_size)
                host_idx = all_host[base.hp].reshape(-1)
                t = interleaved({
                    "memcpy": lambda: dst.copy_(src),
                    "naive write": lambda: naive(False),
                    "naive load": lambda: naive(True),
                    "in-process write": lambda: planned(False),
                    "in-process load": lambda: planned(True),
                    "daemon write": lambda: client.write(host_indices=host_idx, device_indices=dev),
                    "daemon load": lambda: client.load(host_indices=host_idx, device_indices=dev).wait(),
                }, args.repeats)
                client.unregister()
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
        assert np.array_equal(host[hp].numpy(), np.stack(
            [np.stack([dev_views[la][pa][dev_pages].numpy() for pa in range(parts)], 1)
             for la in range(args.layers)], 1)), "naive copy is wrong"
        assert base.holds_the_pool_pages(), "in-process copy is wrong"

    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    print(f"transfer: {nbytes / (1 << 20):.1f} MiB = {tokens} tokens in {pages} scattered pages of "
          f"{args.page_size} tokens; {args.layers} layers x {layout.num_parts} parts, "
          f"{args.page_size * layout.token_bytes(dtype)} B per page chunk; median of {args.repeats}")
    for name, secs in t.items():
        ratio = ""
        if name.startswith("daemon"):
            ref = t[name.replace("daemon", "in-process")]
            ratio = f"   {ref / secs:5.2f}x in-process"
        print(f"{name:<20} {gbs(secs):7.2f} GB/s{ratio}")


if __name__ == "__main__":
    main()
