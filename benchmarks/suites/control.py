"""Control-path latency: a 1-page, 1-layer Write + Load round trip through KVClient against bare
gRPC unary calls on the same Unix socket.

Rows, measured in turn (one of each per trip, so the machine's drift hits all alike):

- ``write`` / ``load`` / ``round trip``: ``KVClient.write`` then ``KVClient.load(...).wait()`` of one
  page of 16 tokens, one layer (MHA 8 KV heads x 128, bf16: 64 KiB), per lane of the client;
- ``grpc.aio unary``: a bare ``grpc.aio`` Health ``Check`` (awaited on an asyncio loop);
- ``grpc sync unary``: a bare synchronous Health ``Check``.

A client with a ``lane`` argument (``KVClient(address, lane="grpc")`` against the default
``"auto"``, which may use a shared-memory ring) is measured on both lanes; one without it on gRPC
only. Each row names its lane.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import pathlib
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvclient import KVClient, KVLayout, ShmKVPool

from . import common

NAME = "control"
PAGE = 16
LAYOUT = KVLayout.mha(8, 128)
DTYPE = torch.bfloat16


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("control")
    g.add_argument("--control-trips", type=int, help="round trips (default 3000; --quick: 100)")


def lanes() -> list[str | None]:
    """The client's lanes to measure: None where KVClient has no ``lane`` argument (gRPC only)."""
    if "lane" in inspect.signature(KVClient).parameters:
        return ["grpc", "auto"]
    return [None]


def run(args: argparse.Namespace, progress) -> dict:
    trips = args.control_trips or (100 if args.quick else 3000)
    d = common.daemon()
    clients, pools = {}, []
    loop = asyncio.new_event_loop()
    aio_channel = None
    try:
        for lane in lanes():
            pool = ShmKVPool(LAYOUT, DTYPE, num_layers=1, num_tokens=4 * PAGE)
            pools.append(pool)
            kw = {} if lane is None else {"lane": lane}
            c = KVClient(d.address, timeout=30, **kw)
            c.register(model=f"control-{lane or 'grpc'}", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                       host_tokens=PAGE, page_size=PAGE)
            host = c.alloc(PAGE)
            clients[lane or "grpc"] = (c, host, torch.arange(PAGE, 2 * PAGE))
        sync_channel = grpc.insecure_channel(d.address)
        sync_health = health_pb2_grpc.HealthStub(sync_channel)
        check = health_pb2.HealthCheckRequest()

        async def aio_open():
            ch = grpc.aio.insecure_channel(d.address)
            return ch, health_pb2_grpc.HealthStub(ch)

        aio_channel, aio_health = loop.run_until_complete(aio_open())

        async def aio_call() -> float:
            t = time.perf_counter()
            await aio_health.Check(check, timeout=30)
            return time.perf_counter() - t

        times: dict[str, list[float]] = {}

        def record(name: str, secs: float) -> None:
            times.setdefault(name, []).append(secs)

        def trip(keep: bool) -> None:
            for lane, (c, host, dev) in clients.items():
                t0 = time.perf_counter()
                c.write(host_indices=host, device_indices=dev)
                t1 = time.perf_counter()
                c.load(host_indices=host, device_indices=dev).wait()
                t2 = time.perf_counter()
                if keep:
                    record(f"write [{lane}]", t1 - t0)
                    record(f"load [{lane}]", t2 - t1)
                    record(f"round trip [{lane}]", t2 - t0)
            secs = loop.run_until_complete(aio_call())
            t = time.perf_counter()
            sync_health.Check(check, timeout=30)
            secs_sync = time.perf_counter() - t
            if keep:
                record("grpc.aio unary", secs)
                record("grpc sync unary", secs_sync)

        for _ in range(max(10, trips // 20)):  # warm-up: channels, threads, first touch
            trip(False)
        with progress(total=trips, desc="control") as bar:
            for _ in range(trips):
                trip(True)
                bar.update(1)
        sync_channel.close()
    finally:
        if aio_channel is not None:
            loop.run_until_complete(aio_channel.close())
        loop.close()
        for c, _, _ in clients.values():
            c.unregister()
            c.close()
        for pool in pools:
            pool.close()
    rows = []
    for name, ts in times.items():
        lane = name[name.index("[") + 1:-1] if "[" in name else "none (bare gRPC)"
        rows.append({"name": name, "lane": lane, **common.stats_of(ts), "times_s": ts})
    return {"params": {"trips": trips, "page_size": PAGE, "layers": 1, "layout": "mha 8x128",
                       "dtype": str(DTYPE), "bytes_per_op": PAGE * LAYOUT.token_bytes(DTYPE) * 2,
                       "lanes": [lane or "grpc" for lane in lanes()],
                       "lane_argument": lanes() != [None]},
            "daemon_flags": common.daemon_flags(d), "rows": rows}


def plot(result: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for r in result["rows"]:
        ts = sorted(t * 1e6 for t in r["times_s"])
        ax.plot(ts, [(i + 1) / len(ts) for i in range(len(ts))], label=r["name"])
    ax.set_xscale("log")
    ax.set_xlabel("latency (µs)")
    ax.set_ylabel("share of calls at or below")
    ax.set_title(f"1-page, 1-layer round trip vs bare gRPC unary ({result['params']['trips']} trips)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    path = out_dir / "control_latency.png"
    common.save_figure(fig, path)
    return [path]


def summary(result: dict) -> str:
    lines = ["| call | lane | p50 | p99 | min | calls |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['lane']} | {r['p50_s'] * 1e6:.0f} µs | {r['p99_s'] * 1e6:.0f} µs "
                     f"| {r['min_s'] * 1e6:.0f} µs | {r['n']} |")
    return "\n".join(lines)
