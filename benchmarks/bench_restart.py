"""Seconds from a daemon's start to serving hits of a kept cache (--host-memory-dir), by cached GiB.

For each size the cache is filled in-process (the daemon's own KVCore, 256 KiB pages of real
bytes in the tmpfs files), then a daemon subprocess is started on it and timed from its launch to
the first Lookup that hits every key asked. The baseline, in the same run: the same daemon started
on an empty directory, timed to its first answered Lookup (a miss): the interpreter, the imports,
the sockets. What a kept cache adds is the difference; the daemon's own adoption time (Stats
``kept.adopt_seconds``) is printed beside it.

With ``--tier disk`` the cache is the disk tier's instead (--disk-cache in ``--dir``, a real disk,
host memory not kept): the pages are written behind to disk in-process, and the daemon started on
the directory serves them from disk (its index adopted at start); ``--cold`` drops the kernel's
page cache before each start (root), as after a reboot.

Run: python benchmarks/bench_restart.py [--sizes 1 4 16] [--runs 3] [--plot docs/plots/restart.png]
     python benchmarks/bench_restart.py --tier disk --dir /var/tmp [--cold] [--sizes 1 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import torch

from kvclient import CacheView, KVLayout
from kvserver.core.kvcore import KVCore
from kvserver.protocol.layout import dtype_named
from kvserver.store.spaces import PartKey, SpaceKey
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

GiB = 1 << 30
LAYOUT = KVLayout.mha(8, 128)  # fp16: 2 KiB a token and part
PAGE, LAYERS = 16, 4  # 16 tokens x 4 KiB x 4 layers: 256 KiB pages
PAGE_BYTES = PAGE * LAYOUT.token_bytes(torch.float16) * LAYOUT.num_parts * LAYERS
MODEL = "restart-bench"
ADMIN = "bench-admin-token"


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "little") + b"restart!" for i in range(n)]


def fill(path: str, capacity: int, nbytes: int) -> int:
    """Stores ``nbytes`` of pages in a kept cache at ``path``; returns the pages stored."""
    core = KVCore(capacity, host_memory_dir=path)
    c = core.cache
    space = SpaceKey(f"uid:{os.getuid()}", MODEL, LAYOUT, dtype_named("float16"), PAGE, LAYERS, 1, 1)
    part = c.part(c.space(space), PartKey(0, 0, 0, LAYERS, PAGE_BYTES))
    arena = core.arena.view(np.uint8)
    n = nbytes // PAGE_BYTES
    stored, every = 0, keys(n)
    for start in range(0, n, 4096):
        ks = every[start : start + 4096]
        plan = c.prepare_put(part, ks)
        for off in plan.offsets.tolist():
            arena[off : off + PAGE_BYTES] = (off >> 18) & 0xFF
        c.complete_put(plan, True)
        stored += len(plan.offsets)
    del arena
    asyncio.run(core.close())
    return stored


DISK_HOST = 256 << 20  # host memory of the disk tier's daemon


def fill_disk(path: str, disk_size: int, nbytes: int) -> int:
    """Stores ``nbytes`` of pages in the disk tier at ``path`` (written behind from a small host
    memory, as a daemon's Puts are); returns the pages on disk."""

    async def run() -> int:
        core = KVCore(DISK_HOST, disk_cache=path, disk_size=disk_size)
        try:
            c, disk = core.cache, core.disk
            space = SpaceKey(f"uid:{os.getuid()}", MODEL, LAYOUT, dtype_named("float16"), PAGE, LAYERS, 1, 1)
            part = c.part(c.space(space), PartKey(0, 0, 0, LAYERS, PAGE_BYTES))
            arena = core.arena.view(np.uint8)
            n = nbytes // PAGE_BYTES
            every, stored = keys(n), 0
            for start in range(0, n, 128):  # 32 MiB a Put
                while disk.queued_bytes > DISK_HOST // 4:
                    await asyncio.sleep(0.001)
                plan = c.prepare_put(part, every[start : start + 128])
                for off in plan.offsets.tolist():
                    arena[off : off + PAGE_BYTES] = (off >> 18) & 0xFF
                ids = plan.page_ids.copy()
                stored += len(ids)
                c.complete_put(plan, True)
                disk.demote(part, ids)
            while disk.queued_bytes or disk.counters.written_pages + disk.counters.skipped_pages < stored:
                await asyncio.sleep(0.01)
            return disk.counters.written_pages
        finally:
            await core.close()

    return asyncio.run(run())


def drop_page_cache() -> None:
    """As after a reboot: the kernel's page cache emptied (root), so the disk's records are read."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def start_to_answer(path: str, capacity: int, want: int, sock_dir: str,
                    disk_size: int = 0) -> tuple[float, float]:
    """Launches a daemon on ``path`` (its disk tier's, with ``disk_size``); seconds until a Lookup
    of the first keys hits ``want`` of them, and the adoption seconds it reports."""
    sock = os.path.join(sock_dir, "kv.sock")
    for p in (sock, sock + ".fd"):
        if os.path.exists(p):
            os.unlink(p)
    where = (["--disk-cache", path, "--disk-size", str(disk_size)] if disk_size
             else ["--host-memory-dir", path])
    args = [sys.executable, "-m", "kvserver", "--socket", sock, "--host-memory", str(capacity),
            *where, "--log-level", "ERROR"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, env={**os.environ, "KVSERVER_ADMIN_TOKEN": ADMIN})
    try:
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}")
            time.sleep(0.002)
        asked = keys(min(want, 1024) or 1)
        while True:
            try:
                with CacheView(f"unix://{sock}", model=MODEL, layout=LAYOUT, dtype=torch.float16,
                               page_size=PAGE, num_layers=LAYERS, timeout=5) as view:
                    hit = view.lookup(asked).pages
                if hit == min(want, len(asked)):
                    break
            except Exception:
                pass
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stats = pb_grpc.KVServerStub(ch).Stats(pb.StatsRequest(), timeout=10,
                                                   metadata=(("x-kvserver-admin", ADMIN),))
        kept = next((t.kept for t in stats.tiers if t.name == "disk"), None) if disk_size else stats.kept
        return elapsed, kept.adopt_seconds
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16], help="cached GiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None,
                    help="where the kept caches are made (default /dev/shm; for --tier disk /var/tmp)")
    ap.add_argument("--tier", choices=("host", "disk"), default="host")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each start (root)")
    ap.add_argument("--plot", default=None, help="write a plot here")
    args = ap.parse_args()
    disk = args.tier == "disk"
    args.dir = args.dir or ("/var/tmp" if disk else "/dev/shm")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrestart-") as sock_dir:
        for size in args.sizes:
            nbytes = int(size * GiB)
            capacity = DISK_HOST if disk else nbytes + nbytes // 8 + (64 << 20)
            disk_size = nbytes + nbytes // 8 + (64 << 20) if disk else 0
            base = os.path.join(args.dir, f"kvbench-restart-empty-{os.getpid()}")
            path = os.path.join(args.dir, f"kvbench-restart-{os.getpid()}")
            try:
                t = time.perf_counter()
                pages = fill_disk(path, disk_size, nbytes) if disk else fill(path, capacity, nbytes)
                fill_s = time.perf_counter() - t
                base_s, hit_s, adopt_s = [], [], []
                for _ in range(args.runs):  # interleaved: the same machine state for both
                    shutil.rmtree(base, ignore_errors=True)
                    if args.cold:
                        drop_page_cache()
                    base_s.append(start_to_answer(base, capacity, 0, sock_dir, disk_size)[0])
                    if args.cold:
                        drop_page_cache()
                    elapsed, adopt = start_to_answer(path, capacity, pages, sock_dir, disk_size)
                    hit_s.append(elapsed)
                    adopt_s.append(adopt)
            finally:
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(base, ignore_errors=True)
            b, h, a = statistics.median(base_s), statistics.median(hit_s), statistics.median(adopt_s)
            rows.append((size, pages, b, h, a))
            print(f"{size:5.1f} GiB ({pages} pages of {PAGE_BYTES >> 10} KiB, filled in {fill_s:.1f} s): "
                  f"start to hits {h:.2f} s (runs {', '.join(f'{x:.2f}' for x in hit_s)}); "
                  f"empty start to an answer {b:.2f} s; kept cache adds {h - b:+.2f} s "
                  f"({(h - b) / size:+.3f} s/GiB); the daemon's adoption {a:.3f} s ({a / size:.3f} s/GiB)",
                  flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = [r[0] for r in rows]
        ax.plot(sizes, [r[3] for r in rows], "o-", label=f"start to serving hits ({args.tier} tier)")
        ax.plot(sizes, [r[2] for r in rows], "s--", label="start to an answer (empty, same run)")
        ax.plot(sizes, [r[4] for r in rows], "^:", label="adoption inside the daemon")
        ax.axhline(2.0, color="grey", lw=0.8, label="2 s target")
        ax.set_xlabel("cached GiB (256 KiB pages)")
        ax.set_ylabel("seconds")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.set_title("Daemon restart with a kept host cache" if not disk else
                     f"Daemon restart on its disk tier{' (page cache dropped)' if args.cold else ''}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
