"""The data-plane fast lane (docs/lane.md) against the gRPC lane, on one daemon subprocess.

- round trip: a 1-page (``--page-size`` tokens), 1-layer Write then a Load of it, waited to its
  end, ``--trips`` times on each lane, p50 and p99, and the CPU time the daemon and this process
  spent per round trip (from /proc: what a loaded machine's scheduler does not hide); beside it a
  bare grpc.aio unary call (Stats) on the same socket; then, on the ring lane, a 1-page, 1-layer
  Get of a stored key, a Put of a key already stored and a Lookup of it (the cache's calls, which
  the data plane serves whole: docs/design.md, "A Get on the data plane"; with ``--disk-cache``,
  in a daemon with a disk tier, where it serves those host memory holds all of), and the same
  Lookup on gRPC, then a scheduler's Lookup of it (``CacheView``) on its space's lane and on
  gRPC, and of a prompt's 128 pages in a space of two PP stages (every part walked), each timed
  alone. Each lane's trips run by themselves, one lane after the other: between
  blocks of another lane's calls (gRPC keeps threads busy for a while after a call) the CPUs would
  not go idle, and an idle CPU's wake-up is part of what a lone engine pays (tens of microseconds
  on a virtual machine); and the ring lane's round trip once every 2 ms, as between an engine's
  forward passes, the data plane asleep when each call comes (docs/lane.md, "Ringing ahead"), and
  once right after a 32 MiB memcpy each (an engine's own work emptying the caches: docs/lane.md,
  "One compiled call");
- bulk: a ``--mib``-sized (every layer) Write and Load on each lane, median of ``--repeats``,
  against the same copy done in this process with the daemon's copy plan and one-call kernel (the
  transfer suite's ``InProcess``), with the ratio (in-process time / lane time: 1.00x is as fast
  as in-process); each round runs the calls in another order, so none always follows the gRPC
  lane's (whose threads stay busy for a while after a call).

Targets (docs/performance.md, "The compiled data plane"): ring round trip p50 <= 100 us and
p99 <= 300 us; per round trip daemon CPU <= 50 us and engine CPU <= 30 us; 16 MiB >= 0.95x and
64 MiB >= 0.98x of in-process.

Run: python benchmarks/bench_lane.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import torch
from suites.transfer import InProcess

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool
from kvclient._transport import lane
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

PROMPT_PAGES = 128  # the pages of the prompt a scheduler looks up in a space of two PP stages

def start_daemon(socket: str, host_memory: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvserver", "--socket", socket, "--host-memory",
                             host_memory, "--log-level", "WARNING", *extra])
    deadline = time.monotonic() + 30
    while not os.path.exists(socket):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("daemon did not start")
        time.sleep(0.05)
    return proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc: coarse ticks, summed over many calls)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def bare_unary(address: str, n: int) -> list[float]:
    async def run() -> list[float]:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.KVServerStub(ch)
            for _ in range(50):
                await stub.Stats(pb.StatsRequest())
            out = []
            for _ in range(n):
                t = time.perf_counter()
                await stub.Stats(pb.StatsRequest())
                out.append(time.perf_counter() - t)
            return out

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trips", type=int, default=2000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--mib", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--disk-cache", action="store_true",
                    help="the daemon with a disk tier (in the run's temporary directory): its data plane "
                         "serves only the cache calls whose every key host memory holds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype, layout, p = torch.bfloat16, KVLayout.mha(8, 128), args.page_size
    token_bytes = layout.token_bytes(dtype) * layout.num_parts * args.layers
    most = max(max(args.mib, default=0) * (1 << 20) // token_bytes // p * p, 4 * p)
    pool_tokens = 2 * most
    rows: list[tuple[str, str]] = []
    # (target, measured, "<=" or ">=", bound, unit) for the data plane's targets, printed last
    checks: list[tuple[str, float, str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvlane-") as tmp:
        socket = os.path.join(tmp, "kv.sock")
        tier = ["--disk-cache", os.path.join(tmp, "disk"), "--disk-size", "256MiB"] if args.disk_cache else []
        daemon = start_daemon(socket, f"{6 * most * token_bytes // (1 << 20) + 64}MiB", *tier)
        try:
            with ShmKVPool(layout, dtype, args.layers, pool_tokens) as ring_pool, \
                    ShmKVPool(layout, dtype, args.layers, pool_tokens) as grpc_pool, \
                    KVClient(socket) as ring, KVClient(socket, lane="grpc") as plain:
                if args.disk_cache:  # (a daemon that cannot make its disk tier serves without one)
                    assert any(t.name == "disk" for t in ring.stats(True).tiers), "no disk tier"
                clients = {"ring": (ring, ring_pool), "grpc": (plain, grpc_pool)}
                host = {}
                for name, (c, pool) in clients.items():
                    c.register(model="bench", pool=pool, start_layer=0, end_layer=args.layers,
                               num_layers=args.layers, host_tokens=2 * most, page_size=p)
                    host[name] = c.alloc(2 * most)
                assert ring.lane is not None, "the ring lane did not open"
                # ---- round trips, a lane at a time, in blocks of 100 -----------------------
                dev = torch.arange(p)
                for name, (c, _) in clients.items():  # warm-up
                    for _ in range(50):
                        c.write(host_indices=host[name][:p], device_indices=dev, layers=[0])
                        c.load(host_indices=host[name][:p], device_indices=dev, layers=[0]).wait()
                # Each lane by itself (see the docstring), then the ring's blocks between blocks
                # of gRPC calls (a neighbour's traffic keeping the CPUs awake).
                order = [("ring lane", ["ring"]), ("grpc lane", ["grpc"]),
                         ("ring lane between gRPC calls", ["grpc", "ring"])]
                trips: dict[str, list[float]] = {label: [] for label, _ in order}
                cpu = {label: [0.0, 0.0] for label, _ in order}  # CPU seconds: daemon, this process
                for label, names in order:
                    time.sleep(0.2)  # what the last calls left running settles first
                    for _ in range(max(1, args.trips // 100)):
                        for name in names:
                            c, timed = clients[name][0], name == names[-1]
                            h = host[name][:p]
                            before = cpu_seconds(daemon.pid), cpu_seconds(os.getpid())
                            for _ in range(100):
                                t = time.perf_counter()
                                c.write(host_indices=h, device_indices=dev, layers=[0])
                                c.load(host_indices=h, device_indices=dev, layers=[0]).wait()
                                if timed:
                                    trips[label].append(time.perf_counter() - t)
                            if timed:
                                cpu[label][0] += cpu_seconds(daemon.pid) - before[0]
                                cpu[label][1] += cpu_seconds(os.getpid()) - before[1]
                # One round trip every 2 ms, as between an engine's forward passes: the data
                # plane's spin (50 us) has run out before each, and it sleeps when the call comes.
                spaced: list[float] = []
                time.sleep(0.2)
                before = cpu_seconds(daemon.pid), cpu_seconds(os.getpid())
                for _ in range(max(1, args.trips // 4)):
                    time.sleep(0.002)
                    t = time.perf_counter()
                    ring.write(host_indices=host["ring"][:p], device_indices=dev, layers=[0])
                    ring.load(host_indices=host["ring"][:p], device_indices=dev, layers=[0]).wait()
                    spaced.append(time.perf_counter() - t)
                spaced_cpu = cpu_seconds(daemon.pid) - before[0], cpu_seconds(os.getpid()) - before[1]
                # One round trip right after a 32 MiB memcpy, as after an engine's own work: its
                # caches (and the kernel's) emptied, the data plane asleep. The engine's CPU is this
                # thread's, around the calls only (the memcpy is not the call's).
                flush = torch.ones(32 << 20, dtype=torch.uint8), torch.empty(32 << 20, dtype=torch.uint8)
                cold: list[float] = []
                cold_engine, before_daemon = 0.0, cpu_seconds(daemon.pid)
                for _ in range(max(1, args.trips // 4)):
                    flush[1].copy_(flush[0])
                    c0, t = time.thread_time(), time.perf_counter()
                    ring.write(host_indices=host["ring"][:p], device_indices=dev, layers=[0])
                    ring.load(host_indices=host["ring"][:p], device_indices=dev, layers=[0]).wait()
                    cold.append(time.perf_counter() - t)
                    cold_engine += time.thread_time() - c0
                cold_daemon = cpu_seconds(daemon.pid) - before_daemon
                del flush
                bare = bare_unary(f"unix://{socket}", args.trips)
                # ---- the cache's calls on the ring lane ------------------------------------
                key, page = os.urandom(16), torch.tensor([0])
                cache_rows: list[tuple[str, str]] = []
                assert ring.put([key], page).stored == 1

                def get() -> None:
                    handle = ring.get([key], page, layers=[0])
                    handle.wait()
                    assert handle.pages() == 1, "the stored key was not found"

                def put() -> None:
                    assert ring.put([key], page).present == 1

                def lookup(c: KVClient | CacheView) -> None:
                    assert c.lookup(key).pages == 1

                views = [CacheView(socket, model="bench", layout=layout, dtype=dtype, page_size=p,
                                   num_layers=args.layers, lane=mode) for mode in ("auto", "grpc")]
                # A space of two PP stages (two engines, a layer each) holding a prompt's 128 pages:
                # a scheduler's Lookup of all of them, every part walked.
                prompt = [os.urandom(16) for _ in range(PROMPT_PAGES)]
                stage_pools = [ShmKVPool(layout, dtype, 1, PROMPT_PAGES * p) for _ in range(2)]
                stages = [KVClient(socket) for _ in range(2)]
                for rank, (c, pool) in enumerate(zip(stages, stage_pools, strict=True)):
                    c.register(model="bench-pp", pool=pool, start_layer=rank, end_layer=rank + 1,
                               num_layers=2, host_tokens=0, page_size=p, pp_rank=rank, pp_size=2)
                    assert c.put(prompt, torch.arange(PROMPT_PAGES)).stored == PROMPT_PAGES
                staged = [CacheView(socket, model="bench-pp", layout=layout, dtype=dtype, page_size=p,
                                    num_layers=2, pp_size=2, lane=mode) for mode in ("auto", "grpc")]

                def lookup_prompt(v: CacheView) -> None:
                    assert v.lookup(prompt).pages == PROMPT_PAGES

                for label, fn in [("ring lane Get, 1 page, 1 layer", get),
                                  ("ring lane Put of a stored key", put),
                                  ("ring lane Lookup of a stored key", lambda: lookup(ring)),
                                  ("grpc lane Lookup of a stored key", lambda: lookup(plain)),
                                  ("space lane Lookup (CacheView) of a stored key", lambda: lookup(views[0])),
                                  ("grpc Lookup (CacheView) of a stored key", lambda: lookup(views[1])),
                                  (f"space lane Lookup (CacheView) of {PROMPT_PAGES} keys, 2 PP stages",
                                   lambda: lookup_prompt(staged[0])),
                                  (f"grpc Lookup (CacheView) of {PROMPT_PAGES} keys, 2 PP stages",
                                   lambda: lookup_prompt(staged[1]))]:
                    for _ in range(50):
                        fn()
                    time.sleep(0.2)
                    ts = []
                    before = cpu_seconds(daemon.pid), cpu_seconds(os.getpid())
                    for _ in range(args.trips):
                        t = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t)
                    used = cpu_seconds(daemon.pid) - before[0], cpu_seconds(os.getpid()) - before[1]
                    n = len(ts)
                    cache_rows.append((label, f"p50 {pct(ts, 0.5) * 1e6:8.1f} us   "
                                              f"p99 {pct(ts, 0.99) * 1e6:8.1f} us"
                                              f"   n={n}   CPU per call: daemon {used[0] / n * 1e6:5.0f} us"
                                              f"   engine {used[1] / n * 1e6:5.0f} us"))
                assert views[0].lane is not None and views[0].lane.calls > args.trips, "no space lane"
                # (each Get's answer says which served it: docs/lane.md; -1, a client that counts none)
                on_plane = getattr(ring.lane, "gets_on_plane", -1)
                on_loop = getattr(ring.lane, "gets_on_loop", 0)
                cache_rows.append(("ring lane Gets served whole on the data plane",
                                   f"{on_plane} of {on_plane + on_loop}"))
                for v in views + staged:
                    v.close()
                for c, pool in zip(stages, stage_pools, strict=True):
                    c.close()
                    pool.close()
                for name, ts in [*((f"{label} write+load", trips[label]) for label, _ in order),
                                 ("ring lane write+load, one every 2 ms,", spaced),
                                 ("ring lane write+load, each after a 32 MiB memcpy,", cold),
                                 ("bare grpc.aio Stats", bare)]:
                    rows.append((f"{name} (1 page, 1 layer)",
                                 f"p50 {pct(ts, 0.5) * 1e6:8.1f} us   p99 {pct(ts, 0.99) * 1e6:8.1f} us"
                                 f"   n={len(ts)}"))
                alone, n_alone = trips["ring lane"], len(trips["ring lane"])
                checks += [("ring round trip p50, alone", pct(alone, 0.5) * 1e6, "<=", 100, "us"),
                           ("ring round trip p99, alone", pct(alone, 0.99) * 1e6, "<=", 300, "us"),
                           ("daemon CPU per round trip, alone", cpu["ring lane"][0] / n_alone * 1e6, "<=", 50,
                            "us"),
                           ("engine CPU per round trip, alone", cpu["ring lane"][1] / n_alone * 1e6, "<=", 30,
                            "us")]
                for label, _ in order:
                    n = len(trips[label])
                    rows.append((f"{label} CPU per round trip",
                                 f"daemon {cpu[label][0] / n * 1e6:6.0f} us   "
                                 f"engine {cpu[label][1] / n * 1e6:6.0f} us"))
                rows.append(("ring lane, one every 2 ms, CPU per round trip",
                             f"daemon {spaced_cpu[0] / len(spaced) * 1e6:6.0f} us   "
                             f"engine {spaced_cpu[1] / len(spaced) * 1e6:6.0f} us"))
                rows.append(("ring lane, each after a 32 MiB memcpy, CPU per round trip",
                             f"daemon {cold_daemon / len(cold) * 1e6:6.0f} us   "
                             f"engine thread {cold_engine / len(cold) * 1e6:6.1f} us"))
                rows += cache_rows
                served = ring.lane.calls if ring.lane is not None else 0
                # ---- bulk --------------------------------------------------------------------
                for mib in args.mib:
                    tokens = mib * (1 << 20) // token_bytes // p * p
                    nbytes = tokens * token_bytes
                    # The transfer suite's baseline: the same pages copied in this process with the
                    # daemon's plan and one-call kernel (copy_job) into a buffer laid out as its region.
                    base = InProcess(ring_pool, p, tokens // p, torch.Generator().manual_seed(mib))
                    dev_idx = base.dev
                    fns = {"in-process write": lambda base=base: base.copy(False),
                           "in-process load": lambda base=base: base.copy(True)}
                    for name, (c, _) in clients.items():
                        hi = host[name].view(-1, p)[: tokens // p].reshape(-1)
                        fns[f"{name} lane write"] = lambda c=c, hi=hi, di=dev_idx: c.write(
                            host_indices=hi, device_indices=di)
                        fns[f"{name} lane load"] = lambda c=c, hi=hi, di=dev_idx: c.load(
                            host_indices=hi, device_indices=di).wait()
                    for fn in fns.values():
                        fn()
                    times: dict[str, list[float]] = {k: [] for k in fns}
                    order = list(fns.items())
                    for r in range(args.repeats):
                        # Each round in another order: a call right after the gRPC lane's pays for the
                        # threads it left busy (0.2-0.45 ms at 16 MiB), whichever call it is.
                        for k, fn in order[r % len(order):] + order[: r % len(order)]:
                            t = time.perf_counter()
                            fn()
                            times[k].append(time.perf_counter() - t)
                    base = {"write": statistics.median(times["in-process write"]),
                            "load": statistics.median(times["in-process load"])}
                    for k, ts in times.items():
                        m = statistics.median(ts)
                        ratio = ""
                        if not k.startswith("in-process"):
                            ratio = f"   {base[k.split()[-1]] / m:5.2f}x in-process"
                        if k.startswith("ring lane") and mib >= 16:
                            kind = k.split()[-1]
                            checks.append((f"{mib} MiB {kind} vs in-process", base[kind] / m, ">=",
                                           0.95 if mib < 64 else 0.98, "x"))
                        speed = f"{m * 1e3:8.2f} ms   {nbytes / m / 1e9:6.2f} GB/s{ratio}"
                        rows.append((f"{mib} MiB {k}", speed))
                served = (ring.lane.calls if ring.lane is not None else 0) - served
                for c, _ in clients.values():
                    c.unregister()
        finally:
            daemon.terminate()
            daemon.wait(30)
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}   result")
    for name, value in rows:
        print(f"{name:<{width}}   {value}")
    plane_spin = os.environ.get("KVSERVER_PLANE_SPIN_US", "50")
    window, _, shared = lane.crowded()
    print(f"(ring lane: {served} bulk calls answered on the ring; spins: the plane's {plane_spin} us, "
          f"the client's {lane.SPIN_SECONDS * 1e6:.0f} us ({lane.LOAD_SPIN_SECONDS * 1e6:.0f} us for a "
          f"load's layer), of which {shared} found the CPU shared (three in a row: the waits sleep for "
          f"{window:g} s); CPU between gRPC calls includes what each gRPC block left running)")
    print("\ntargets of the data plane (docs/performance.md; the bulk ratios against the transfer "
          "suite's baseline, the one-call copy_job in this process, in rotating order):")
    for name, value, op, bound, unit in checks:
        value = round(value, 6)  # CPU comes in clock ticks: 6 ticks over 2000 trips is 30 us, not 30.000...04
        met = value <= bound if op == "<=" else value >= bound
        shown = f"{value:.1f} {unit}" if unit == "us" else f"{value:.2f}{unit}"
        print(f"  {name:<36} {shown:>10}   target {op} {bound:g}{' ' if unit == 'us' else ''}{unit}: "
              f"{'met' if met else 'not met'}")


if __name__ == "__main__":
    main()
