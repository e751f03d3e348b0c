"""A cross-node Get through the daemons against Mooncake Store's own ``batch_get_into`` of the same
pages between the same two processes, in one run.

A Mooncake master and two daemons with --cluster-master on loopback TCP: daemon A a subprocess,
daemon B in this process (on its own event loop thread). An engine on A stores ``--rounds`` x 2
sets of pages of ``--page-mib`` (real bytes, ``--mib`` a set), which A writes through to its
segment. For each round, in alternating order:

- through the daemons: an engine on B Gets a set it never stored: B asks the cluster which pages
  it holds, pulls them from A's segment into its host memory, and loads them into the engine's
  device pool (shared memory), timed from the call to the last layer's arrival;
- the baseline: B's own Mooncake Store client (the one the daemon uses, in the same process)
  ``batch_get_into`` of the other set, from the same segment of A, into a registered buffer of
  this process, one call for the set.

Both read pages the reader never held, into memory faulted beforehand (a warm-up set each). The
ratio is daemon GB/s / Mooncake GB/s; every page is checked against the bytes stored. The same
Get once more (a local hit then) times the load into the device pool alone: what the daemon path
does beyond the pull.

Two more paths, in the same rounds, say what an engine running its own Mooncake client would pay
to have the same pages in its pool: ``batch_get_into`` and then the copy into the pool (numpy, in
this process); and the same in ``--pieces`` calls, each piece's copy in a thread while the next
piece is pulled (a pull and a load overlapped).

Run: python benchmarks/bench_cluster.py [--mib 256] [--page-mib 1] [--rounds 3] [--pieces 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import uvloop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from daemon_proc import DaemonProcess  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402

from kvclient import KVClient, KVLayout, ShmKVPool  # noqa: E402
from kvserver.cluster.names import names, part_prefix  # noqa: E402
from kvserver.config import ServerConfig  # noqa: E402
from kvserver.core.cache_ops import space_key  # noqa: E402
from kvserver.server import Daemon  # noqa: E402
from kvserver.store import Keys  # noqa: E402

MiB = 1 << 20
LAYOUT = KVLayout.mha(8, 128)  # bf16: 4 KiB per token and layer, K and V
PAGE = 16  # tokens: 64 KiB per layer; --page-mib sets the layers


class Node:
    """Daemon B on an event loop thread of this process."""

    def __init__(self, config: ServerConfig) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.daemon: Daemon = self.call(self._start(config))

    async def _start(self, config: ServerConfig) -> Daemon:
        d = Daemon(config)
        await d.start()
        return d

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def stop(self) -> None:
        self.call(self.daemon.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def fill(pool: ShmKVPool, seed: int) -> list[list[np.ndarray]]:
    """Random bytes in every layer part of the pool; returns them (per layer, per part)."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in pool.buffers:
        parts = []
        for buf in layer:
            raw = buf.view(torch.uint8).numpy()
            raw[:] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
            parts.append(raw.copy())
        out.append(parts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of pages in one set (default 256)")
    ap.add_argument("--page-mib", type=int, default=1, help="page size in MiB (default 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pieces", type=int, default=8, help="calls of the overlapped path (default 8)")
    args = ap.parse_args()
    layers = args.page_mib * MiB // (PAGE * LAYOUT.token_bytes(torch.bfloat16) * 2)
    page_bytes = PAGE * LAYOUT.token_bytes(torch.bfloat16) * 2 * layers
    n = args.mib * MiB // page_bytes
    sets = 4 * args.rounds + 2  # a warm-up set for each path, then four a round
    set_bytes = n * page_bytes
    segment = sets * set_bytes * 5 // 4 + 64 * MiB  # the master evicts past 90% full
    master = MooncakeMaster()
    tmp = tempfile.mkdtemp(prefix="kv-bench-cluster-")
    a = node_b = None
    try:
        a = DaemonProcess(os.path.join(tmp, "a.sock"), "--cluster-master", master.address,
                          "--cluster-segment", f"{segment // MiB}MiB", "--cluster-timeout-ms", "30000",
                          host_memory=f"{(2 * set_bytes) // MiB + 64}MiB")
        node_b = Node(ServerConfig(socket=os.path.join(tmp, "b.sock"), host_memory=4 * set_bytes + 64 * MiB,
                                   cluster_master=master.address, cluster_segment=64 * MiB,
                                   cluster_timeout=30.0))
        tier = node_b.daemon.core.cluster
        deadline = time.monotonic() + 30
        while not (tier.joined and any(t.name == "cluster" and t.joined for t in a.stats().tiers)):
            assert time.monotonic() < deadline, "the daemons did not join the cluster"
            time.sleep(0.05)
        keysets = [[f"s{s}-{i:06d}".encode() for i in range(n)] for s in range(sets)]
        pages = np.arange(n)
        with ShmKVPool(LAYOUT, torch.bfloat16, layers, n * PAGE) as pool_a, \
                KVClient(a.address, timeout=120) as ea:
            ea.register(model="bench-cluster", pool=pool_a, start_layer=0, end_layer=layers,
                        num_layers=layers, host_tokens=PAGE, page_size=PAGE)
            truth = fill(pool_a, 1)
            step = max(1, 16 * MiB // page_bytes)
            for s, ks in enumerate(keysets):
                for i in range(0, n, step):  # a Put at a time, each once written through
                    r = ea.put(ks[i : i + step], pages[i : i + step])
                    assert r.stored == len(ks[i : i + step]), r
                    want = s * n + min(n, i + step)
                    deadline = time.monotonic() + 60
                    while True:
                        t = next(t for t in a.stats().tiers if t.name == "cluster")
                        if t.written_pages >= want:
                            break
                        assert time.monotonic() < deadline and not (t.write_errors or t.skipped_pages), t
                        time.sleep(0.005)
            ea.unregister()
        print(f"{sets} sets of {n} pages of {page_bytes / MiB:.2f} MiB stored through daemon A")

        with ShmKVPool(LAYOUT, torch.bfloat16, layers, n * PAGE) as pool_b, \
                KVClient(f"unix://{os.path.join(tmp, 'b.sock')}", timeout=120) as eb:
            eb.register(model="bench-cluster", pool=pool_b, start_layer=0, end_layer=layers,
                        num_layers=layers, host_tokens=PAGE, page_size=PAGE)
            views = [[buf.view(torch.uint8).numpy() for buf in layer] for layer in pool_b.buffers]
            scratch = np.zeros(set_bytes, np.uint8)  # faulted: written once
            base = scratch.ctypes.data
            tier.client.register(base, set_bytes)
            addrs = [base + i * page_bytes for i in range(n)]

            def via_daemon(ks: list[bytes]) -> float:
                for layer in views:
                    for raw in layer:
                        raw[:] = 0
                t0 = time.perf_counter()
                h = eb.get(ks, pages)
                got = h.pages(timeout=120)
                h.wait(timeout=120)
                took = time.perf_counter() - t0
                assert got == n, f"the daemon loaded {got} of {n} pages ({tier.counters})"
                for la, layer in enumerate(views):
                    for q, raw in enumerate(layer):
                        assert np.array_equal(raw, truth[la][q]), "a page came back with other bytes"
                return took

            chunk = PAGE * LAYOUT.token_bytes(torch.bfloat16)
            by_page = scratch.reshape(n, layers, 2, chunk)
            pool_rows = [[raw.reshape(n, chunk) for raw in layer] for layer in views]
            copier = ThreadPoolExecutor(1)

            def to_pool(lo: int, hi: int) -> None:  # host pages lo..hi into device pages lo..hi
                for la, layer in enumerate(pool_rows):
                    for q, rows in enumerate(layer):
                        rows[lo:hi] = by_page[lo:hi, la, q]

            def via_mooncake(ks: list[bytes], load: bool = False, pieces: int = 1) -> float:
                """batch_get_into the set in ``pieces`` calls; ``load``: and copy each piece into
                the pool, in a thread while the next piece is pulled."""
                scratch[:] = 0
                if load:
                    for layer in views:
                        for raw in layer:
                            raw[:] = 0
                ns = names(prefix, Keys.of(ks))  # what the daemon asks for: the same objects
                bounds = np.linspace(0, n, pieces + 1).astype(int)
                t0 = time.perf_counter()
                copies = []
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                    got = tier.client.get(ns[lo:hi], addrs[lo:hi], page_bytes)
                    assert all(g == page_bytes for g in got), sorted(set(got))
                    if load:
                        copies.append(copier.submit(to_pool, lo, hi))
                for c in copies:
                    c.result()
                took = time.perf_counter() - t0
                # Page i of the set holds device page i's bytes, laid out as a host page.
                for i in (0, n - 1):
                    got = by_page[i]
                    for la in (0, layers - 1):
                        for q in range(2):
                            want = truth[la][q].reshape(-1)[i * chunk : (i + 1) * chunk]
                            assert np.array_equal(got[la, q], want), "a page came back with other bytes"
                            if load:
                                assert np.array_equal(pool_rows[la][q][i], want), "a page was not loaded"
                return took

            via_daemon(keysets[0])  # warm-up: B's arena pages and the buffer faulted, the paths warm
            core = node_b.daemon.core
            client = next(iter(core.clients.values()))
            space = core.cache.find_space(space_key(client.tenant, client.spec))
            prefix = part_prefix(next(iter(space.parts.values())))
            via_mooncake(keysets[1], True)
            ours, theirs, loads, own, overlapped = [], [], [], [], []
            for r in range(args.rounds):
                sets_r = keysets[2 + 4 * r : 6 + 4 * r]
                steps = [(ours, via_daemon), (theirs, via_mooncake),
                         (own, lambda ks: via_mooncake(ks, True)),
                         (overlapped, lambda ks: via_mooncake(ks, True, args.pieces))]
                for (out, fn), ks in zip(steps if r % 2 == 0 else steps[::-1], sets_r, strict=True):
                    out.append(set_bytes / fn(ks) / 1e9)
                # The same Get again: a local hit now, the load into the device pool alone.
                d_set = sets_r[0 if r % 2 == 0 else 3]
                loads.append(set_bytes / via_daemon(d_set) / 1e9)
                print(f"round {r}: daemon {ours[-1]:.2f} GB/s, mooncake {theirs[-1]:.2f} GB/s, "
                      f"ratio {ours[-1] / theirs[-1]:.2f}; the load alone {loads[-1]:.2f} GB/s; "
                      f"mooncake + copy {own[-1]:.2f}, in {args.pieces} overlapped {overlapped[-1]:.2f} GB/s")
            c = tier.counters
            print(f"\n| path | GB/s (median of {args.rounds}) |\n|---|---|")
            print(f"| Get through daemon B (cluster pull + load to the device pool) | "
                  f"{statistics.median(ours):.2f} |")
            print(f"| Mooncake batch_get_into in the same process | {statistics.median(theirs):.2f} |")
            print(f"| the same Get again, a local hit (the load alone) | {statistics.median(loads):.2f} |")
            print(f"| batch_get_into, then the copy into the pool, in-process | "
                  f"{statistics.median(own):.2f} |")
            print(f"| the same in {args.pieces} calls, each copy overlapping the next pull | "
                  f"{statistics.median(overlapped):.2f} |")

            def ratio(name: str, a: list[float], b: list[float]) -> None:
                rs = [x / y for x, y in zip(a, b, strict=True)]
                each = ", ".join(f"{x:.2f}" for x in rs)
                print(f"ratio {name}: median {statistics.median(rs):.2f} (rounds {each})")

            print()
            ratio("daemon / mooncake", ours, theirs)
            ratio("daemon / (mooncake + copy)", ours, own)
            ratio("overlapped / (mooncake + copy)", overlapped, own)
            print(f"B pulled {c.pulled_pages} pages, {c.get_errors} errors")
            eb.unregister()
    finally:
        if node_b is not None:
            node_b.stop()
        if a is not None:
            a.kill()
        master.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
