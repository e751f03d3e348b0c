"""Layer pipelining: how soon the first layer of a 32-layer Load is usable, against the whole load.

For each size, a 32-layer Load of scattered 16-token pages (MHA 8 KV heads x 128, bf16) is started
and ``LoadHandle.wait_layer(i)`` is called for i = 0 .. 31 in turn; the time from ``load()`` to the
return of each wait is recorded (median over the repeats). The target is layer 0 usable within
1.5/32 of the whole load; the ideal is layer i at (i + 1)/32 of it. Measured with the daemon's
default flags and, in a full run, with ``--progress-interval-ms 0`` (a message per layer).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

from kvclient import KVClient, KVLayout, ShmKVPool

from . import common

NAME = "pipeline"
LAYOUT = KVLayout.mha(8, 128)
DTYPE = torch.bfloat16
PAGE = 16
TARGET = 1.5 / 32


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline")
    g.add_argument("--pipeline-mib", type=int, nargs="+", help="load sizes (default 16 64 256; --quick: 4)")
    g.add_argument("--pipeline-layers", type=int, default=32)
    g.add_argument("--pipeline-repeats", type=int, help="loads per size (default 1 GiB / size, 5 to 30; "
                   "--quick: 5)")
    g.add_argument("--pipeline-intervals", nargs="+",
                   help="daemon --progress-interval-ms values; 'default' for the daemon's own "
                   "(default: default 0; --quick: default)")


def run(args: argparse.Namespace, progress) -> dict:
    sizes = args.pipeline_mib or ([4] if args.quick else [16, 64, 256])
    intervals = args.pipeline_intervals or (["default"] if args.quick else ["default", "0"])
    layers = args.pipeline_layers
    token_bytes = LAYOUT.token_bytes(DTYPE) * LAYOUT.num_parts * layers
    rows = []
    cases = [(iv, s) for iv in intervals for s in sizes]
    host_memory = str((max(sizes) << 20) + (64 << 20))
    with progress(total=len(cases), desc="pipeline") as bar:
        for interval, size in cases:
            flags = () if interval == "default" else ("--progress-interval-ms", interval)
            d = common.daemon(*flags, host_memory=host_memory)
            pages = max(1, (size << 20) // token_bytes // PAGE)
            tokens = pages * PAGE
            repeats = args.pipeline_repeats or (5 if args.quick else
                                                max(5, min(30, (1 << 30) // (size << 20))))
            g = torch.Generator().manual_seed(0)
            with ShmKVPool(LAYOUT, DTYPE, layers, 2 * tokens) as pool, KVClient(d.address, timeout=120) as c:
                for layer in pool.buffers:
                    for buf in layer:
                        buf.view(torch.int16).fill_(1)
                c.register(model="pipeline", pool=pool, start_layer=0, end_layer=layers, num_layers=layers,
                           host_tokens=tokens, page_size=PAGE)
                try:
                    dev_pages = torch.randperm(2 * pages, generator=g)[:pages]
                    dev = (dev_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
                    host = c.alloc(tokens).view(-1, PAGE)[torch.randperm(pages, generator=g)].reshape(-1)
                    c.write(host_indices=host, device_indices=dev)
                    per_layer: list[list[float]] = []
                    for rep in range(repeats + 1):  # the first is a warm-up
                        t0 = time.perf_counter()
                        h = c.load(host_indices=host, device_indices=dev)
                        at = []
                        for i in range(layers):
                            h.wait_layer(i)
                            at.append(time.perf_counter() - t0)
                        h.wait()
                        if rep:
                            per_layer.append(at)
                finally:
                    c.unregister()
            med = [statistics.median(run_[i] for run_ in per_layer) for i in range(layers)]
            firsts = [r[0] / r[-1] for r in per_layer]
            rows.append({
                "progress_interval_ms": interval, "size_mib": size, "bytes": tokens * token_bytes,
                "tokens": tokens, "pages": pages, "repeats": repeats,
                "first_layer": {**common.stats_of(first := [r[0] for r in per_layer]), "times_s": first},
                "whole": {**common.stats_of(whole := [r[-1] for r in per_layer]), "times_s": whole},
                "first_over_whole_median": statistics.median(firsts),
                "first_over_whole_each": firsts,
                "meets_target": statistics.median(firsts) <= TARGET,
                "median_time_to_layer_s": med,
                "time_to_layer_s": per_layer,
                "daemon_flags": common.daemon_flags(d),
            })
            bar.update(1)
    return {"params": {"sizes_mib": sizes, "layers": layers, "page_size": PAGE, "layout": "mha 8x128",
                       "dtype": str(DTYPE), "intervals": intervals, "target_first_over_whole": TARGET},
            "rows": rows}


def plot(result: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    intervals = result["params"]["intervals"]
    fig, axes = plt.subplots(1, len(intervals), figsize=(5.5 * len(intervals), 4), squeeze=False)
    for ax, interval in zip(axes[0], intervals, strict=True):
        for r in (r for r in result["rows"] if r["progress_interval_ms"] == interval):
            med = r["median_time_to_layer_s"]
            n = len(med)
            (line,) = ax.plot(range(n), [t * 1e3 for t in med], "o-", ms=3, label=f"{r['size_mib']} MiB")
            ax.plot(range(n), [(i + 1) / n * med[-1] * 1e3 for i in range(n)], ":",
                    color=line.get_color(), lw=1)
        ax.set_xlabel("layer i")
        ax.set_ylabel("ms from load() to wait_layer(i)")
        ax.set_yscale("log")
        label = "daemon default" if interval == "default" else f"--progress-interval-ms {interval}"
        ax.set_title(f"time to layer i ({label}); dotted: ideal")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    path = out_dir / "pipeline_layers.png"
    common.save_figure(fig, path)
    return [path]


def summary(result: dict) -> str:
    lines = ["| daemon progress interval | load | layer 0 usable (p50) | whole load (p50) | layer 0 / whole "
             f"| target ≤ {TARGET:.3f} |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        iv = "default" if r["progress_interval_ms"] == "default" else f"{r['progress_interval_ms']} ms"
        lines.append(f"| {iv} | {r['size_mib']} MiB | {r['first_layer']['p50_s'] * 1e3:.2f} ms "
                     f"| {r['whole']['p50_s'] * 1e3:.2f} ms | {r['first_over_whole_median']:.3f} "
                     f"| {'met' if r['meets_target'] else 'not met'} |")
    return "\n".join(lines)
