"""A lane Put of new keys into a full cache: stored on the data plane against the event loop's path.

Two daemon subprocesses side by side, the same size: one as it runs by default, where the data
plane stores a Put into free pages the loop set aside (docs/design.md, "A Put on the data plane"),
and one with ``KVSERVER_PLANE_PUTS=0``, where the loop stores every Put of new keys (its copy on
the plane, as before that). Each gets one engine on the ring lane and first Puts ``--fill`` times
its host memory of new pages, so that every timed Put evicts the least recently used pages, as a
serving cache does. Then, in turns of ``--block`` calls on each daemon, ``--trips`` Puts of
``--pages`` new keys: p50 and p99, the CPU time each side spent per Put (from /proc), and, as a
floor, a binary Write of as many pages (the plane's own copy of the same bytes, no cache at all).
Twice: a 1-layer registration (a page of 64 KiB, where the fixed cost of a call is most of it)
and a ``--layers``-layer one (a model's page, every layer's KV of 16 tokens).

Run: python benchmarks/bench_put.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from kvclient import KVClient, KVLayout, ShmKVPool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lane import cpu_seconds, pct, start_daemon  # noqa: E402


def daemon(tmp: str, name: str, host_memory: str, plane_puts: bool):
    socket = os.path.join(tmp, f"{name}.sock")
    env = os.environ.get("KVSERVER_PLANE_PUTS")
    os.environ["KVSERVER_PLANE_PUTS"] = "1" if plane_puts else "0"
    try:
        return socket, start_daemon(socket, host_memory)
    finally:
        if env is None:
            os.environ.pop("KVSERVER_PLANE_PUTS", None)
        else:
            os.environ["KVSERVER_PLANE_PUTS"] = env


def put_new(c: KVClient, pages: int) -> None:
    assert c.put([os.urandom(16) for _ in range(pages)], torch.arange(pages)).stored == pages


def write(c: KVClient, host, pages: int, page_size: int) -> None:
    c.write(host_indices=host, device_indices=torch.arange(pages * page_size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trips", type=int, default=2000)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--pages", type=int, default=1, help="new keys a Put")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--host-memory-mib", type=int, default=512)
    ap.add_argument("--fill", type=float, default=1.5, help="host memory's worth of Puts before the timing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype, layout, p = torch.bfloat16, KVLayout.mha(8, 128), 16
    host_bytes, host_memory = args.host_memory_mib << 20, f"{args.host_memory_mib}MiB"
    with tempfile.TemporaryDirectory(prefix="kvput-") as tmp:
        sides = {"plane": daemon(tmp, "plane", host_memory, True),
                 "loop": daemon(tmp, "loop", host_memory, False)}
        try:
            for layers in (1, args.layers):
                page_bytes = layout.token_bytes(dtype) * layout.num_parts * layers * p
                rows: dict[str, dict[str, list]] = {}
                with ShmKVPool(layout, dtype, layers, args.pages * p) as pool:
                    clients = {}
                    for name, (socket, proc) in sides.items():
                        c = KVClient(socket)
                        c.register(model="bench-put", pool=pool, start_layer=0, end_layer=layers,
                                   num_layers=layers, host_tokens=args.pages * p, page_size=p)
                        clients[name] = (c, proc, c.alloc(args.pages * p))
                        assert c.lane is not None, "the ring lane did not open"
                    fill = int(args.fill * host_bytes / page_bytes / args.pages) + 1
                    for c, _, _ in clients.values():
                        for _ in range(fill):
                            put_new(c, args.pages)
                    for label in ("Put of new keys", "binary Write, the same pages"):
                        for name in clients:
                            rows.setdefault(f"{label} [{name}]", {"t": [], "cpu": [0.0, 0.0]})
                        time.sleep(0.2)
                        for _ in range(max(1, args.trips // args.block)):
                            for name, (c, proc, h) in clients.items():
                                row = rows[f"{label} [{name}]"]
                                before = cpu_seconds(proc.pid), cpu_seconds(os.getpid())
                                for _ in range(args.block):
                                    t = time.perf_counter()
                                    if label.startswith("Put"):
                                        put_new(c, args.pages)
                                    else:
                                        write(c, h, args.pages, p)
                                    row["t"].append(time.perf_counter() - t)
                                row["cpu"][0] += cpu_seconds(proc.pid) - before[0]
                                row["cpu"][1] += cpu_seconds(os.getpid()) - before[1]
                    for c, _, _ in clients.values():
                        c.close()
                print(f"\n{layers} layer(s), {args.pages} page(s) of {page_bytes >> 10} KiB a Put, "
                      f"{host_memory} of host memory, full:")
                for label, row in rows.items():
                    ts, n = row["t"], len(row["t"])
                    print(f"  {label:38s} p50 {pct(ts, 0.5) * 1e6:8.1f} us"
                          f"   p99 {pct(ts, 0.99) * 1e6:8.1f} us"
                          f"   CPU per call: daemon {row['cpu'][0] / n * 1e6:5.0f} us"
                          f"   engine {row['cpu'][1] / n * 1e6:5.0f} us")
                plane, loop = (pct(rows[f"Put of new keys [{s}]"]["t"], 0.5) for s in ("plane", "loop"))
                print(f"  Put's p50, the plane's / the loop's: {plane / loop:.2f}x")
        finally:
            for _, proc in sides.values():
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
