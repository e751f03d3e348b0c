"""Multi-turn serving (after SGLang's bench_multiturn): C clients x R rounds, each round a client's
history grows by an answer (A tokens) and a new question (Q tokens); requests arrive as a Poisson
process; the device KV pool holds about a quarter of all histories, so a returning client's prefix
is still on the device, found in a host tier, or recomputed. Thirteen configurations see the same trace:

- recompute:          one engine, device pool with LRU prefix reuse, nothing below it;
- host-inprocess:     one engine with a host pool in its own process (kvserver.copies.transfer's kernel);
- kvserver-index:     one engine whose host tier is the daemon's index API (Alloc/Write/Load/Free);
- dp2-recompute:      two DP replicas, each request to a random replica, no host tier (baseline);
- dp2-kvserver-cache: the same two replicas (two processes) sharing the daemon's node-wide cache
                      (Get by content keys, Put of what they computed);
- dp2-cache-restart:  the same on a daemon of its own, SIGKILLed and started again halfway through
                      (the replicas ride through it: resilient clients, device pools kept);
- dp2-cache-restart-kept: the same with --host-memory-dir: the restarted daemon adopts the cache.
- dp2-small-host:     dp2-kvserver-cache on a daemon whose host memory holds a third of the
                      histories (--multiturn-small-fraction), no disk: evicted histories are gone;
- dp2-small-host-disk: the same with the disk tier (--disk-cache): evicted pages are read back;
- dp2-small-host-disk-restart: the same, SIGKILLed and started again halfway (host memory not
                      kept): the restarted daemon finds the histories on disk.
- nodes2-own-cache:   two nodes (two daemons), one replica each, requests placed at random: each
                      replica finds only what its own node's cache holds;
- nodes2-router:      the same two nodes, each request placed by a router that follows the nodes'
                      KV events (the daemons' Events call) on the node holding the longest prefix;
- nodes2-cluster:     the same two nodes sharing a Mooncake Store cluster (--cluster-master): a
                      history computed on either node is a hit on both (the node rows are left
                      out where the 'cluster' extra is not installed).

Compute is modelled, data movement is real: prefill time comes from a small Llama (built from a
config, nothing downloaded) timed on this machine at start-up and fitted (_multiturn_model); the
KV moved is real bytes of that model's geometry, moved by the real kernel or the real daemon, and
timed. One engine serves one request at a time (FIFO); TTFT = queue wait + load + prefill of the
missing tokens; the write-through of the new pages after the prefill keeps the engine busy.
Decode is not modelled (it costs the same in every configuration). The KV geometry is the timed
model's own (8 layers x 4 KV heads x 32, float32: 8 KiB a token, 128 KiB a page of 16), so
compute and bytes are of one model; --multiturn-layers scales both.

Reading it: hit rates depend only on the trace and the tiers' sizes (the three host tiers of one
size and policy reuse the same tokens); TTFT and capacity (requests over the busiest engine's busy
time: what it could serve if never idle; throughput proper is bounded by the arrival rate) add the
fitted prefill cost and the measured transfer times. Host tiers win over recompute because
prefilling the tokens costs far more than moving their KV. The daemon tiers lose to the
in-process pool on every call: a daemon call costs a round trip (gRPC over a Unix socket, the
daemon's event loop) of a few ms whatever its size at these sizes, the in-process copy a fraction
of a ms; ``transfer_sweep`` measures that per call and size. The index configuration also pays
an Alloc per write-through. In DP, dp2-recompute is what two separate device pools give; the
node-wide cache is what lets a replica find a history the other one computed.

Run alone: python benchmarks/suites/multiturn.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import secrets
import shlex
import shutil
import sys
import tempfile
import time

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent
for _p in (_HERE, _ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from _multiturn_dp import CacheReplica, RemoteReplica, serve_dp  # noqa: E402
from _multiturn_kv import DevicePool, Geometry  # noqa: E402
from _multiturn_model import ModelConfig, Timing, prefill_seconds  # noqa: E402
from _multiturn_nodes import cluster_available, serve_nodes  # noqa: E402
from _multiturn_sim import Workload, figures, timeline, trace  # noqa: E402
from _multiturn_sweep import sizes_for, sweep  # noqa: E402
from _multiturn_tiers import IndexHost, InProcessHost, geometry_note, serve_single  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402

from kvclient.keys import page_keys, split_keys  # noqa: E402

NAME = "multiturn"
CONFIGS = ["recompute", "host-inprocess", "kvserver-index", "dp2-recompute", "dp2-kvserver-cache",
           "dp2-cache-restart", "dp2-cache-restart-kept", "dp2-small-host", "dp2-small-host-disk",
           "dp2-small-host-disk-restart"]
NODE_CONFIGS = ["nodes2-own-cache", "nodes2-router", "nodes2-cluster"]  # with Mooncake Store installed
RESTARTED = ("dp2-cache-restart", "dp2-cache-restart-kept", "dp2-small-host-disk-restart")
# The daemon is SIGKILLed and started again before this share of the trace (the two restart rows).
RESTART_AT = 0.5
QUICK = {"clients": 4, "rounds": 3, "question": 32, "answer": 16}
SLAB = 8 << 20


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multiturn")
    g.add_argument("--multiturn-clients", type=int, default=16)
    g.add_argument("--multiturn-rounds", type=int, default=6)
    g.add_argument("--multiturn-question", type=int, default=128, help="tokens a round's question adds")
    g.add_argument("--multiturn-answer", type=int, default=64, help="tokens a round's answer adds")
    g.add_argument("--multiturn-page", type=int, default=16, help="tokens per KV page")
    g.add_argument("--multiturn-device-fraction", type=float, default=0.25,
                   help="device pool, as a share of all clients' final histories")
    g.add_argument("--multiturn-host-fraction", type=float, default=1.0,
                   help="host tier (in-process pool, index API region, node cache), same share")
    g.add_argument("--multiturn-small-fraction", type=float, default=0.33,
                   help="the small-host rows' host memory for the cache, as a share of the host tier")
    g.add_argument("--multiturn-disk-dir", default=None,
                   help="where the disk rows keep their disk tier (default: a temporary directory)")
    g.add_argument("--multiturn-rate", type=float, default=0.0,
                   help="arrivals per second; 0: --multiturn-load times what the recompute-only "
                        "engine can serve (from the fitted prefill model)")
    g.add_argument("--multiturn-load", type=float, default=0.8)
    g.add_argument("--multiturn-layers", type=int, default=ModelConfig.layers,
                   help="layers of the timed model (its KV geometry is the bytes moved)")
    g.add_argument("--multiturn-seed", type=int, default=0)
    g.add_argument("--multiturn-spawn", action="store_true",
                   help="spawn the child processes (model timing, second replica) instead of forking "
                        "them; forking is used only while this process has no other thread")


def _workload(args: argparse.Namespace) -> Workload:
    q = QUICK if args.quick else {}
    w = Workload(clients=q.get("clients", args.multiturn_clients),
                 rounds=q.get("rounds", args.multiturn_rounds),
                 question=q.get("question", args.multiturn_question),
                 answer=q.get("answer", args.multiturn_answer),
                 page=args.multiturn_page, seed=args.multiturn_seed)
    if w.question % w.page or w.answer % w.page or w.question <= 0:
        raise SystemExit("--multiturn-question and --multiturn-answer must be whole pages (and Q > 0)")
    return w


def _client_keys(w: Workload, vocab: int) -> list[list[bytes]]:
    import numpy as np

    n = w.total_pages(w.rounds - 1) * w.page
    return [split_keys(page_keys(np.random.default_rng([w.seed, 7, c]).integers(0, vocab, n), w.page))
            for c in range(w.clients)]


def run(args: argparse.Namespace, progress) -> dict:
    torch.set_num_threads(1)
    w = _workload(args)
    cfg = ModelConfig(layers=args.multiturn_layers)
    geom = Geometry.of(cfg, w.page)
    reqs = trace(w)
    most = w.total_pages(w.rounds - 1)
    dev_pages = max(most, round(args.multiturn_device_fraction * w.all_pages()))
    host_pages = max(most, round(args.multiturn_host_fraction * w.all_pages()))
    host_bytes = host_pages * geom.page_bytes
    cache_share = math.ceil(host_bytes / SLAB) * SLAB
    budget_mib = math.ceil((host_bytes + cache_share + 2 * geom.page_bytes) / (1 << 20)) + 8
    keys = _client_keys(w, cfg.vocab)

    configs = CONFIGS + (NODE_CONFIGS if cluster_available() else [])
    records: dict[str, list] = {}
    checks: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kv-multiturn-") as tmp:
        socket = os.path.join(tmp, "kv.sock")
        # Both children start before any gRPC channel or thread of this run exists.
        timing = Timing(cfg, args.quick, args.multiturn_spawn)
        remote = RemoteReplica(f"unix://{socket}", geom, dev_pages, w.seed, args.multiturn_spawn)
        daemon = None
        try:
            model = None if args.quick else timing.result()  # timed alone in a full run
            daemon = DaemonProcess(socket, host_memory=f"{budget_mib}MiB")
            remote.start()
            bar = progress(total=len(reqs) * len(configs), desc=NAME)
            dev = DevicePool(geom, dev_pages, w.seed)
            try:
                records["recompute"] = serve_single(w, reqs, dev, None, bar)
                host = InProcessHost(dev, host_pages)
                records["host-inprocess"] = serve_single(w, reqs, dev, host, bar)
                checks["host-inprocess"] = {"pages_checked": dev.checked, "pages_wrong": dev.wrong}
                dev.checked = dev.wrong = 0
                index = IndexHost(dev, host_pages, daemon.address)
                try:
                    records["kvserver-index"] = serve_single(w, reqs, dev, index, bar)
                    checks["kvserver-index"] = {"pages_checked": dev.checked, "pages_wrong": dev.wrong}
                    records["dp2-recompute"] = serve_dp(w, reqs, None, dev_pages, None, bar)
                    # The index API's region stays registered: the cache gets the rest of the budget.
                    local = CacheReplica(daemon.address, geom, dev_pages, w.seed)
                    try:
                        remote.wait_ready()
                        records["dp2-kvserver-cache"] = serve_dp(w, reqs, [local, remote], dev_pages,
                                                                 keys, bar)
                        stats = daemon.stats()
                        ch = [local.checks(), remote.checks()]
                        checks["dp2-kvserver-cache"] = {
                            "pages_checked": sum(c[0] for c in ch), "pages_wrong": sum(c[1] for c in ch),
                            "pages_dropped": sum(c[2] for c in ch), "cache_bytes": stats.cache_bytes}
                        index.clear()
                        transfers = sweep(host, index, local, sizes_for(dev_pages, args.quick),
                                          3 if args.quick else 9)
                    finally:
                        local.close()
                finally:
                    index.close()
            finally:
                dev.close()
            for name, kept in (("dp2-cache-restart", False), ("dp2-cache-restart-kept", True)):
                records[name], checks[name] = serve_own(w, reqs, geom, dev_pages, keys, budget_mib, bar,
                                                        kept=kept, restart=True)
            small_cache = math.ceil(args.multiturn_small_fraction * host_bytes / SLAB) * SLAB
            small_mib = math.ceil((small_cache + 2 * geom.page_bytes) / (1 << 20)) + 8
            for name, disk, again in (("dp2-small-host", False, False), ("dp2-small-host-disk", True, False),
                                      ("dp2-small-host-disk-restart", True, True)):
                records[name], checks[name] = serve_own(w, reqs, geom, dev_pages, keys, small_mib, bar,
                                                        disk=disk, disk_dir=args.multiturn_disk_dir,
                                                        restart=again)
            if "nodes2-cluster" in configs:
                rows = (("nodes2-own-cache", False, False), ("nodes2-router", False, True),
                        ("nodes2-cluster", True, False))
                for name, cluster, router in rows:
                    records[name], checks[name] = serve_nodes(w, reqs, geom, dev_pages, keys, budget_mib,
                                                              bar, cluster=cluster, router=router)
            bar.close()
            if model is None:
                model = timing.result()
        finally:
            timing.close()
            remote.close()
            if daemon is not None:
                daemon.stop()

    fit = model["fit"]
    prefill = lambda n, p: prefill_seconds(fit, n, p)  # noqa: E731
    rate = args.multiturn_rate
    if rate <= 0:
        service = sum(prefill(r.computed, r.hit) for r in records["recompute"])
        rate = args.multiturn_load * len(reqs) / service
    results = {}
    half = int(len(reqs) * RESTART_AT)
    for name in configs:
        tl = timeline(reqs, records[name], rate, prefill, 2 if name.startswith(("dp2", "nodes2")) else 1)
        results[name] = figures(reqs, records[name], tl)
        after = records[name][half:]  # the requests after the restart, in the restart rows
        prompt = sum(r.prompt_tokens for r in after)
        results[name]["hit_rate_second_half"] = sum(r.hit for r in after) / prompt
        results[name]["ttft_p50_second_half_s"] = sorted(tl.ttft[half:])[len(after) // 2]
    return {
        "workload": {"clients": w.clients, "rounds": w.rounds, "question_tokens": w.question,
                     "answer_tokens": w.answer, "page_tokens": w.page, "seed": w.seed,
                     "requests": len(reqs), "all_history_pages": w.all_pages()},
        "rate_rps": rate,
        "load": args.multiturn_load if args.multiturn_rate <= 0 else None,
        "device_pages": dev_pages,
        "host_pages": host_pages,
        "daemon_host_memory_mib": budget_mib,
        "small_host_memory_mib": small_mib,
        "geometry": geometry_note(geom),
        "model": model,
        "configs": results,
        "checks": checks,
        "transfer_sweep": transfers,
    }


def serve_own(w, reqs, geom, dev_pages: int, keys, budget_mib: int, bar, *, kept: bool = False,
              disk: bool = False, disk_dir: str | None = None, restart: bool = False) -> tuple[list, dict]:
    """The dp2-kvserver-cache trace on a daemon of its own of ``budget_mib``; ``kept``: with
    --host-memory-dir (its host cache survives a restart); ``disk``: with --disk-cache (in
    ``disk_dir`` or a temporary directory); ``restart``: SIGKILLed and started again before
    RESTART_AT of the trace, the replicas riding through it (resilient clients, device pools kept)."""
    kept_dir = f"/dev/shm/kvbench-multiturn-{os.getpid()}-{secrets.token_hex(3)}" if kept else None
    with tempfile.TemporaryDirectory(prefix="kv-multiturn-own-", dir=disk_dir) as tmp:
        d = remote = local = None
        took: list[float] = []
        try:
            flags = ["--host-memory-dir", kept_dir] if kept else []
            if disk:
                flags += ["--disk-cache", os.path.join(tmp, "disk"), "--disk-size", "4GiB"]
            d = DaemonProcess(os.path.join(tmp, "kv.sock"), *flags, host_memory=f"{budget_mib}MiB")
            # Spawned: this process has gRPC channels and threads by now, which a fork does not survive.
            remote = RemoteReplica(d.address, geom, dev_pages, w.seed, spawn=True, resilient=True)
            local = CacheReplica(d.address, geom, dev_pages, w.seed, resilient=True)
            remote.wait_ready()

            def again() -> None:
                d.kill()
                t0 = time.monotonic()
                d.start()
                local.registered_again()
                remote.registered_again()
                took.append(time.monotonic() - t0)

            records = serve_dp(w, reqs, [local, remote], dev_pages, keys, bar,
                               restart=(int(len(reqs) * RESTART_AT), again) if restart else None)
            stats = d.stats()
            if kept and not stats.kept.adopted_pages:  # it ran with a cache of its own memory
                raise RuntimeError(f"the restarted daemon adopted nothing from {kept_dir}: {stats.kept}")
            ch = [local.checks(), remote.checks()]
            checks = {"pages_checked": sum(c[0] for c in ch), "pages_wrong": sum(c[1] for c in ch),
                      "pages_dropped": sum(c[2] for c in ch), "cache_bytes": stats.cache_bytes,
                      "adopted_pages": stats.kept.adopted_pages,
                      "restart_to_registered_s": took[0] if took else 0.0}
            tiers = {t.name: t for t in stats.tiers}
            if disk:
                t = tiers["disk"]
                if not t.written_pages:
                    raise RuntimeError(f"the disk tier wrote nothing: {t}")
                checks.update(disk_written_pages=t.written_pages, disk_promoted_pages=t.promoted_pages,
                              disk_adopted_pages=t.kept.adopted_pages, disk_bad_checks=t.bad_checks)
            checks["host_evicted_pages"] = tiers["host"].evicted_pages
        finally:
            if local is not None:
                local.close()
            if remote is not None:
                remote.close()
            if d is not None:
                d.stop()
            if kept_dir:
                shutil.rmtree(kept_dir, ignore_errors=True)
    return records, checks


def plot(result: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfgs = result["configs"]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in cfgs.items():
        xs = [t * 1e3 for t in r["ttft_s"]]
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    w = result["workload"]
    ax.set_title(f"TTFT CDF: {w['clients']} clients x {w['rounds']} rounds, {result['rate_rps']:.1f} req/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "multiturn_ttft_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(cfgs)
    dev = [cfgs[n]["device_hit_rate"] for n in names]
    host = [cfgs[n]["host_hit_rate"] for n in names]
    ax.bar(names, dev, label="device")
    ax.bar(names, host, bottom=dev, label="host tier")
    ax.set_ylabel("prefix hit rate (tokens reused / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.tick_params(axis="x", labelsize=8)
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    ax.legend(fontsize=8)
    ax.set_title("prefix hit rate")
    fig.tight_layout()
    paths.append(out_dir / "multiturn_hit_rate.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def summary(result: dict) -> str:
    w, g, fit = result["workload"], result["geometry"], result["model"]["fit"]
    lines = [
        f"Multi-turn: {w['clients']} clients x {w['rounds']} rounds, Q={w['question_tokens']} "
        f"A={w['answer_tokens']} tokens, pages of {w['page_tokens']}; "
        f"device {result['device_pages']} pages, host tier "
        f"{result['host_pages']} of {w['all_history_pages']}; {result['rate_rps']:.2f} req/s Poisson; "
        f"KV {g['layers']} layers x {g['kv_heads']} heads x {g['head_dim']} {g['dtype']} = "
        f"{g['page_bytes'] >> 10} KiB a page; prefill fit a={fit['a_s'] * 1e3:.2f} ms, "
        f"b={fit['b_s_per_token'] * 1e6:.1f} us/token, c={fit['c_s_per_token_pair'] * 1e9:.2f} ns/token^2 "
        f"(R^2 {fit['r2']:.2f})",
        "",
        "| config | hit rate (device + host) | TTFT p50 ms | p90 ms | p99 ms | mean ms | req/s | "
        "prompt tok/s | capacity req/s | capacity prompt tok/s | load ms per host hit | "
        "write-through s total |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["configs"].items():
        lines.append(
            f"| {name} | {r['hit_rate']:.3f} ({r['device_hit_rate']:.3f} + {r['host_hit_rate']:.3f}) | "
            f"{r['ttft_p50_s'] * 1e3:.1f} | {r['ttft_p90_s'] * 1e3:.1f} | {r['ttft_p99_s'] * 1e3:.1f} | "
            f"{r['ttft_mean_s'] * 1e3:.1f} | {r['throughput_rps']:.2f} | {r['throughput_prompt_tps']:.0f} | "
            f"{r['capacity_rps']:.2f} | {r['capacity_prompt_tps']:.0f} | "
            f"{r['load_ms_mean_per_hit']:.2f} | {r['write_s_total']:.3f} |")
    wrong = {k: v["pages_wrong"] for k, v in result["checks"].items()}
    lines.append("")
    lines.append(f"Loaded pages checked against what was stored: wrong pages {wrong}.")
    cfgs, ck = result["configs"], result["checks"]
    lines.append("")
    lines.append("After a kill -9 of the daemon before half of the trace (the second half only): "
                 + "; ".join(f"{n} hit rate {cfgs[n]['hit_rate_second_half']:.3f}, TTFT p50 "
                             f"{cfgs[n]['ttft_p50_second_half_s'] * 1e3:.1f} ms"
                             for n in ("dp2-kvserver-cache", "dp2-cache-restart", "dp2-cache-restart-kept"))
                 + f"; the kept cache adopted {ck['dp2-cache-restart-kept']['adopted_pages']} pages, and "
                 "the replicas were registered again "
                 f"{ck['dp2-cache-restart-kept']['restart_to_registered_s']:.2f} s after the restart began.")
    lines.append("")
    sd, sr = ck["dp2-small-host-disk"], ck["dp2-small-host-disk-restart"]
    lines.append(f"Histories past host memory ({result['small_host_memory_mib']} MiB): hit rate "
                 + ", ".join(f"{n} {cfgs[n]['hit_rate']:.3f} (TTFT p50 {cfgs[n]['ttft_p50_s'] * 1e3:.1f} ms, "
                             f"p99 {cfgs[n]['ttft_p99_s'] * 1e3:.1f} ms)"
                             for n in ("dp2-small-host", "dp2-small-host-disk"))
                 + f"; the disk tier wrote {sd['disk_written_pages']} pages and read back "
                 f"{sd['disk_promoted_pages']}. After a kill -9 halfway, the second half's hit rate: "
                 f"{cfgs['dp2-small-host-disk-restart']['hit_rate_second_half']:.3f} with the disk "
                 f"(it found {sr['disk_adopted_pages']} pages on disk at the restart) against "
                 f"{cfgs['dp2-small-host-disk']['hit_rate_second_half']:.3f} with no restart and "
                 f"{cfgs['dp2-cache-restart']['hit_rate_second_half']:.3f} for a daemon with neither.")
    if "nodes2-cluster" in cfgs:
        cc = ck["nodes2-cluster"]
        lines.append("")
        lines.append("Two nodes (requests placed at random but by nodes2-router): "
                     + ", ".join(f"{n} hit rate {cfgs[n]['hit_rate']:.3f} (TTFT p50 "
                                 f"{cfgs[n]['ttft_p50_s'] * 1e3:.1f} ms, "
                                 f"p99 {cfgs[n]['ttft_p99_s'] * 1e3:.1f} ms)"
                                 for n in ("nodes2-own-cache", "nodes2-router", "nodes2-cluster",
                                           "dp2-kvserver-cache"))
                     + f"; the cluster tier stored {cc['cluster_published_pages']} pages and pulled "
                     f"{cc['cluster_pulled_pages']} across the nodes ({cc['cluster_get_errors']} failed); "
                     f"the router placed {ck['nodes2-router']['placed_off_the_trace']} requests off the "
                     f"random pick, from {ck['nodes2-router']['router_events']} events.")
    lines += ["", "Per-call transfer time (median ms) by size, same device pages:", "",
              "| pages | KiB | in-process write | in-process load | index Write | index Load | cache Put | "
              "cache Get |", "|---|---|---|---|---|---|---|---|"]
    for row in result["transfer_sweep"]:
        lines.append(f"| {row['pages']} | {row['bytes'] >> 10} | {row['inprocess_write_ms']:.3f} | "
                     f"{row['inprocess_load_ms']:.3f} | {row['index_write_ms']:.3f} | "
                     f"{row['index_load_ms']:.3f} | {row['cache_put_ms']:.3f} | {row['cache_get_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    ap.add_argument("--out", type=pathlib.Path, default=_ROOT / "benchmarks" / "results")
    add_args(ap)
    args = ap.parse_args()
    try:
        from tqdm import tqdm as progress
    except ImportError:  # pragma: no cover
        progress = _NoProgress
    t0 = time.monotonic()
    result = run(args, progress)
    command = shlex.join([sys.executable, os.path.relpath(__file__, _ROOT), *sys.argv[1:]])
    doc = {"suite": NAME, "command": command, "quick": bool(args.quick), "wall_s": time.monotonic() - t0,
           **result}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    paths = plot(result, args.out)
    print(summary(result))
    print(f"\nwrote {path} and {', '.join(str(p) for p in paths)}")


class _NoProgress:
    def __init__(self, total: int | None = None, desc: str | None = None) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()
