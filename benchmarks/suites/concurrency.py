"""Several engine processes on one daemon: aggregate bandwidth and per-operation latency.

Engines are spawned processes (``multiprocessing`` spawn), each with its own ShmKVPool and KVClient
registration (MHA 8 KV heads x 128, bf16, 32 layers, pages of 16 tokens, scattered). All engines
are started and registered first; then for each engine count n the first n of them, started on
the same clock tick, each loop Write + Load (until the last layer) of the same size for the same
time. Aggregate GB/s is every byte the n engines moved over the phase's wall time (start to the
last engine's last operation); p50/p99 are over every operation of the phase. The target is 8
engines at 0.9x or more of one engine's aggregate (one engine saturating the daemon's copy thread).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import time

from . import common

NAME = "concurrency"
PAGE = 16
LAYERS = 32
TARGET = 0.9


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("concurrency")
    g.add_argument("--concurrency-engines", type=int, nargs="+", help="engine counts (default 1 2 4 8; "
                   "--quick: 1 2)")
    g.add_argument("--concurrency-mib", type=int,
                   help="MiB per Write and per Load (default 16; --quick: 4)")
    g.add_argument("--concurrency-seconds", type=float,
                   help="time per engine count (default 6; --quick: 0.5)")


def engine(index: int, address: str, nbytes: int, conn) -> None:
    """One engine process: registers, then runs the phases it is sent until told to stop."""
    import torch

    from kvclient import KVClient, KVLayout, ShmKVPool

    torch.set_num_threads(1)
    layout = KVLayout.mha(8, 128)
    token_bytes = layout.token_bytes(torch.bfloat16) * layout.num_parts * LAYERS
    pages = max(1, nbytes // token_bytes // PAGE)
    tokens = pages * PAGE
    g = torch.Generator().manual_seed(index)
    with ShmKVPool(layout, torch.bfloat16, LAYERS, 2 * tokens) as pool, KVClient(address, timeout=120) as c:
        for layer in pool.buffers:
            for buf in layer:
                buf.view(torch.int16).fill_(index)
        c.register(model=f"engine-{index}", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                   host_tokens=tokens, page_size=PAGE)
        dev_pages = torch.randperm(2 * pages, generator=g)[:pages]
        dev = (dev_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        host = c.alloc(tokens).view(-1, PAGE)[torch.randperm(pages, generator=g)].reshape(-1)
        c.write(host_indices=host, device_indices=dev)  # warm-up: first touch on both sides
        c.load(host_indices=host, device_indices=dev).wait()
        conn.send(("ready", tokens * token_bytes))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, start, seconds = msg
            ops: list[tuple[str, float, float]] = []  # (op, start, seconds)
            while time.monotonic() < start:
                time.sleep(min(0.001, max(0.0, start - time.monotonic())))
            end = start + seconds
            while time.monotonic() < end:
                t = time.monotonic()
                c.write(host_indices=host, device_indices=dev)
                t1 = time.monotonic()
                c.load(host_indices=host, device_indices=dev).wait()
                t2 = time.monotonic()
                ops += [("write", t, t1 - t), ("load", t1, t2 - t1)]
            conn.send(ops)
        c.unregister()
    conn.close()
    # Registration, client and pool are closed: skip the interpreter's teardown of torch (seconds
    # on a loaded machine, times every engine) that the parent would otherwise wait for.
    os._exit(0)


def _recv(conn, proc, timeout: float):
    """The engine's next message; raises if it died or sent nothing within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"engine process {proc.pid} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine process {proc.pid} sent nothing within {timeout} s")
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"engine process {proc.pid} exited with {proc.exitcode}") from None


def run(args: argparse.Namespace, progress) -> dict:
    counts = args.concurrency_engines or ([1, 2] if args.quick else [1, 2, 4, 8])
    size = args.concurrency_mib or (4 if args.quick else 16)
    seconds = args.concurrency_seconds or (0.5 if args.quick else 6.0)
    nbytes = size << 20
    d = common.daemon(host_memory=str(max(counts) * nbytes + (64 << 20)))
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    rows = []
    try:
        with progress(total=max(counts) + len(counts), desc="concurrency") as bar:
            for i in range(max(counts)):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=engine, args=(i, d.address, nbytes, theirs), daemon=True)
                p.start()
                procs.append(p)
                conns.append(mine)
            op_bytes = None
            for conn, proc in zip(conns, procs, strict=True):
                tag, op_bytes = _recv(conn, proc, 300)
                assert tag == "ready"
                bar.update(1)
            for n in counts:
                start = time.monotonic() + 0.2
                for conn in conns[:n]:
                    conn.send(("run", start, seconds))
                per_engine = [_recv(conn, proc, seconds + 120)
                              for conn, proc in zip(conns[:n], procs[:n], strict=True)]
                ops = [o for eng in per_engine for o in eng]
                if not ops:
                    raise RuntimeError(f"{n} engines finished no operation in {seconds} s")
                wall = max(t + s for _, t, s in ops) - start
                moved = len(ops) * op_bytes
                row = {"engines": n, "wall_s": wall, "ops": len(ops), "bytes_moved": moved,
                       "aggregate_gb_per_s": moved / wall / 1e9,
                       "ops_per_engine": [len(e) for e in per_engine]}
                for op in ("write", "load"):
                    ts = [s for name, _, s in ops if name == op]
                    row[op] = {**common.stats_of(ts), "times_s": ts}
                rows.append(row)
                bar.update(1)
            for conn in conns:
                conn.send(("stop",))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    base = rows[0]["aggregate_gb_per_s"] if rows and rows[0]["engines"] == 1 else None
    for r in rows:
        r["ratio_to_one_engine"] = r["aggregate_gb_per_s"] / base if base else None
    last = rows[-1] if rows else None
    return {"params": {"engines": counts, "size_mib": size, "op_bytes": op_bytes, "seconds": seconds,
                       "page_size": PAGE, "layers": LAYERS, "layout": "mha 8x128", "dtype": "torch.bfloat16",
                       "target_ratio": TARGET},
            "daemon_flags": common.daemon_flags(d), "rows": rows,
            "meets_target": (last["ratio_to_one_engine"] >= TARGET
                             if last and last["ratio_to_one_engine"] is not None else None)}


def plot(result: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    n = [r["engines"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.plot(n, [r["aggregate_gb_per_s"] for r in rows], "o-", label="aggregate")
    if rows and rows[0]["engines"] == 1:
        one = rows[0]["aggregate_gb_per_s"]
        a1.axhline(one, color="grey", lw=0.8, label="one engine")
        a1.axhline(TARGET * one, color="grey", lw=0.8, ls="--", label=f"{TARGET}x one engine")
    a1.set_xlabel("engines")
    a1.set_ylabel("GB/s (write + load)")
    a1.set_title(f"aggregate bandwidth, {result['params']['size_mib']} MiB per op")
    a1.set_ylim(bottom=0)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    for op, mark in (("write", "o"), ("load", "s")):
        a2.plot(n, [r[op]["p50_s"] * 1e3 for r in rows], f"{mark}-", label=f"{op} p50")
        a2.plot(n, [r[op]["p99_s"] * 1e3 for r in rows], f"{mark}:", label=f"{op} p99")
    a2.set_xlabel("engines")
    a2.set_ylabel("ms per operation")
    a2.set_title("latency per operation")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.set_xticks(n)
    path = out_dir / "concurrency.png"
    common.save_figure(fig, path)
    return [path]


def summary(result: dict) -> str:
    lines = ["| engines | aggregate | vs 1 engine | write p50 / p99 | load p50 / p99 | ops |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = "" if r["ratio_to_one_engine"] is None else f"{r['ratio_to_one_engine']:.2f}×"
        lines.append(f"| {r['engines']} | {r['aggregate_gb_per_s']:.2f} GB/s | {ratio} "
                     f"| {r['write']['p50_s'] * 1e3:.1f} / {r['write']['p99_s'] * 1e3:.1f} ms "
                     f"| {r['load']['p50_s'] * 1e3:.1f} / {r['load']['p99_s'] * 1e3:.1f} ms | {r['ops']} |")
    return "\n".join(lines)
