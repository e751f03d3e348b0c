"""Costs of the node-wide cache, each against a baseline measured in the same run on the same socket.

- Lookup of 1k and 64k keys, all stored (tiny pages so that 64k of them fit), from an engine
  (``KVClient.lookup``: its own part) and from a scheduler (``CacheView.lookup``: the whole space),
  against a bare ``Stats`` call (no client id, no admin token: the daemon-wide totals only) on a
  channel to the same socket: what answering for the keys costs over a round trip.
- Put and Get of --sizes MiB through the cache against Write and Load of the same device pages
  through the index API (Alloc'd host pages), MHA 8 x 128 bf16, 32 layers, pages of 16 tokens (2 MiB
  a page, scattered in a pool twice the transfer). Every Put stores fresh keys, so once the cache is
  full (it is filled before the timed rounds) it evicts as it goes; every Get loads the same stored
  pages. Ratios are cache / index API.
- The same Put and Get through a daemon keeping its cache in files on tmpfs (--host-memory-dir)
  against a daemon keeping it in its own memory, both running, their calls interleaved: what
  keeping the cache across restarts costs a transfer. Ratios are kept / plain.

The daemon runs as a subprocess; this process is the engine. Each row's figures are medians of
--repeats rounds measured in turn. Run: python benchmarks/bench_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from daemon_proc import DaemonProcess  # noqa: E402

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool  # noqa: E402
from kvserver.v1 import kvserver_pb2 as pb  # noqa: E402
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc  # noqa: E402

PAGE = 16
LOOKUP_LAYOUT = KVLayout.mha(1, 8)  # fp16, 1 layer: 512 B a page
BIG = KVLayout.mha(8, 128)  # bf16, 32 layers: 2 MiB a page
LAYERS = 32
CACHE_TRANSFERS = 3  # the cache's room, in transfers: the Get pages and two more


def d_stats(address: str) -> pb.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.KVServerStub(channel).Stats(pb.StatsRequest(), timeout=30)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn so that drift in machine speed hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def keys(n: int, tag: str) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def bench_lookup(address: str, counts: list[int], repeats: int) -> list[tuple[int, dict[str, float]]]:
    most = max(counts)
    rows = []
    with ShmKVPool(LOOKUP_LAYOUT, torch.float16, 1, most * PAGE) as pool, KVClient(address) as client, \
            CacheView(address, model="bench-lookup", layout=LOOKUP_LAYOUT, dtype=torch.float16,
                      page_size=PAGE, num_layers=1) as view, grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVServerStub(channel)
        client.register(model="bench-lookup", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                        host_tokens=PAGE, page_size=PAGE)
        stored = keys(most, "lookup")
        r = client.put(stored, np.arange(most))
        assert r.stored == most, f"only {r.stored} of {most} lookup keys were stored: {r}"
        for n in counts:
            packed = b"".join(stored[:n])
            assert client.lookup(packed).pages == n and view.lookup(packed).pages == n
            t = interleaved({
                "Stats": lambda: stub.Stats(pb.StatsRequest(), timeout=30),
                "engine": lambda packed=packed: client.lookup(packed),
                "scheduler": lambda packed=packed: view.lookup(packed),
            }, repeats)
            rows.append((n, t))
        client.unregister()
    return rows


def bench_transfer(address: str, mib: int, repeats: int) -> dict[str, float]:
    page_bytes = PAGE * BIG.token_bytes(torch.bfloat16) * BIG.num_parts * LAYERS
    pages = mib * (1 << 20) // page_bytes
    pool_pages = 2 * pages
    g = torch.Generator().manual_seed(mib)
    with ShmKVPool(BIG, torch.bfloat16, LAYERS, pool_pages * PAGE) as pool, KVClient(address) as client:
        for layer in pool.buffers:
            for buf in layer:
                buf.view(torch.int16).random_(generator=g)
        client.register(model="bench-big", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                        host_tokens=pages * PAGE, page_size=PAGE)
        dev_pages = torch.randperm(pool_pages, generator=g)[:pages]
        dev = (dev_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        host = client.alloc(pages * PAGE)
        fresh = iter(range(1 << 30))

        def put() -> None:
            r = client.put(keys(pages, f"put-{mib}-{next(fresh)}"), dev_pages)
            assert r.stored == pages, r

        # Fill the cache first: every timed Put then evicts, as in a cache that has been running.
        while d_stats(address).cache_bytes < CACHE_TRANSFERS * pages * page_bytes:
            put()
        put()
        stored = keys(pages, f"get-{mib}")  # the most recent pages: each Get touches them again
        assert client.put(stored, dev_pages).stored == pages

        def get() -> None:
            handle = client.get(stored, dev_pages)
            assert handle.pages(timeout=60) == pages, "the pages to Get were evicted"
            handle.wait(timeout=60)

        t = interleaved({
            "Write": lambda: client.write(host_indices=host, device_indices=dev),
            "Put": put,
            "Load": lambda: client.load(host_indices=host, device_indices=dev).wait(),
            "Get": get,
        }, repeats)
        # What the Get loads is what was Put: wipe the pages, Get them back, compare.
        want = [b.view(torch.uint8)[dev].clone() for layer in pool.buffers for b in layer]
        client.write(host_indices=host, device_indices=dev)  # the same bytes as stored
        for layer in pool.buffers:
            for buf in layer:
                buf[dev] = 0
        handle = client.get(stored, dev_pages)
        assert handle.pages(timeout=60) == pages
        handle.wait(timeout=60)
        got = [b.view(torch.uint8)[dev] for layer in pool.buffers for b in layer]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), "Get loaded other bytes"
        client.unregister()
    t["bytes"] = pages * page_bytes
    return t


def bench_kept(plain: str, kept: str, mib: int, repeats: int) -> dict[str, float]:
    """Put and Get of ``mib`` MiB through two daemons, ``plain`` and ``kept`` (--host-memory-dir),
    from one engine's pool, interleaved; each cache filled first, so every timed Put evicts."""
    page_bytes = PAGE * BIG.token_bytes(torch.bfloat16) * BIG.num_parts * LAYERS
    pages = mib * (1 << 20) // page_bytes
    g = torch.Generator().manual_seed(mib)
    fns: dict[str, Callable[[], object]] = {}
    with ShmKVPool(BIG, torch.bfloat16, LAYERS, 2 * pages * PAGE) as pool, KVClient(plain) as a, \
            KVClient(kept) as b:
        for layer in pool.buffers:
            for buf in layer:
                buf.view(torch.int16).random_(generator=g)
        dev_pages = torch.randperm(2 * pages, generator=g)[:pages]
        fresh = iter(range(1 << 30))
        for name, client, address in (("plain", a, plain), ("kept", b, kept)):
            client.register(model="bench-kept", pool=pool, start_layer=0, end_layer=LAYERS,
                            num_layers=LAYERS, host_tokens=PAGE, page_size=PAGE)

            def put(client=client) -> None:
                r = client.put(keys(pages, f"kept-{mib}-{next(fresh)}"), dev_pages)
                assert r.stored == pages, r

            while d_stats(address).cache_bytes < CACHE_TRANSFERS * pages * page_bytes:
                put()
            stored = keys(pages, f"kept-get-{mib}")
            assert client.put(stored, dev_pages).stored == pages

            def get(client=client, stored=stored) -> None:
                handle = client.get(stored, dev_pages)
                assert handle.pages(timeout=60) == pages, "the pages to Get were evicted"
                handle.wait(timeout=60)

            fns[f"Put {name}"], fns[f"Get {name}"] = put, get
        t = interleaved(fns, repeats)
        a.unregister()
        b.unregister()
    t["bytes"] = pages * page_bytes
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="1024,65536", help="Lookup sizes, comma separated")
    ap.add_argument("--sizes", default="16,64", help="Put/Get sizes in MiB, comma separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small sizes, few rounds (a smoke run)")
    ap.add_argument("--kept-parent", default="/dev/shm",
                    help="where the kept daemon's --host-memory-dir is made (tmpfs; default /dev/shm)")
    args = ap.parse_args()
    if args.quick:
        args.keys, args.sizes, args.repeats = "1024,8192", "8", 3
    counts = [int(x) for x in args.keys.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp:
        # Lookup: room for the tiny pages. Transfers: a daemon per size, with room for the host
        # region of the Write/Load baseline and CACHE_TRANSFERS transfers' worth of cache.
        budget = max(counts) * 512 * 2 + (16 << 20)
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), host_memory=f"{budget >> 20}MiB")
        try:
            lookups = bench_lookup(d.address, counts, max(args.repeats, 10))
        finally:
            d.stop()
        transfers = []
        for mib in sizes:
            d = DaemonProcess(os.path.join(tmp, f"kv{mib}.sock"),
                              host_memory=f"{(CACHE_TRANSFERS + 1) * mib + 16}MiB")
            try:
                transfers.append((mib, bench_transfer(d.address, mib, args.repeats)))
            finally:
                d.stop()
        kept_rows = []
        for mib in sizes:
            budget = f"{(CACHE_TRANSFERS + 1) * mib + 16}MiB"
            kept_dir = tempfile.mkdtemp(prefix="kvcache-bench-kept-", dir=args.kept_parent)
            p = k = None
            try:
                p = DaemonProcess(os.path.join(tmp, f"plain{mib}.sock"), host_memory=budget)
                k = DaemonProcess(os.path.join(tmp, f"kept{mib}.sock"), "--host-memory-dir",
                                  os.path.join(kept_dir, "kv"), host_memory=budget)
                assert k.stats().HasField("kept"), "the kept daemon keeps nothing: is its directory usable?"
                kept_rows.append((mib, bench_kept(p.address, k.address, mib, args.repeats)))
            finally:
                for d in (p, k):
                    if d is not None:
                        d.stop()
                shutil.rmtree(kept_dir, ignore_errors=True)

    print(f"Lookup, all keys stored; median of {max(args.repeats, 10)} rounds")
    print(f"{'keys':>8}  {'Stats':>9}  {'engine':>9}  {'scheduler':>9}  {'engine/Stats':>12}  "
          f"{'scheduler/Stats':>15}")
    for n, t in lookups:
        ms = {k: v * 1e3 for k, v in t.items()}
        print(f"{n:>8}  {ms['Stats']:7.2f}ms  {ms['engine']:7.2f}ms  {ms['scheduler']:7.2f}ms  "
              f"{t['engine'] / t['Stats']:11.2f}x  {t['scheduler'] / t['Stats']:14.2f}x")
    print(f"\nPut/Get vs Write/Load, pages of {PAGE} tokens x {LAYERS} layers (2 MiB); median of "
          f"{args.repeats} rounds; GB/s")
    print(f"{'MiB':>5}  {'Write':>7}  {'Put':>7}  {'Put/Write':>9}  {'Load':>7}  {'Get':>7}  {'Get/Load':>8}")
    for mib, t in transfers:
        gbs = {k: t["bytes"] / t[k] / 1e9 for k in ("Write", "Put", "Load", "Get")}
        print(f"{mib:>5}  {gbs['Write']:7.2f}  {gbs['Put']:7.2f}  {gbs['Put'] / gbs['Write']:8.2f}x  "
              f"{gbs['Load']:7.2f}  {gbs['Get']:7.2f}  {gbs['Get'] / gbs['Load']:7.2f}x")
    print(f"\nPut/Get with the cache kept in files (--host-memory-dir in {args.kept_parent}) vs in the "
          f"daemon's memory, interleaved; median of {args.repeats} rounds; GB/s")
    print(f"{'MiB':>5}  {'Put plain':>9}  {'Put kept':>8}  {'kept/plain':>10}  {'Get plain':>9}  "
          f"{'Get kept':>8}  {'kept/plain':>10}")
    for mib, t in kept_rows:
        gbs = {k: t["bytes"] / t[k] / 1e9 for k in ("Put plain", "Put kept", "Get plain", "Get kept")}
        print(f"{mib:>5}  {gbs['Put plain']:9.2f}  {gbs['Put kept']:8.2f}  "
              f"{gbs['Put kept'] / gbs['Put plain']:9.2f}x  {gbs['Get plain']:9.2f}  {gbs['Get kept']:8.2f}  "
              f"{gbs['Get kept'] / gbs['Get plain']:9.2f}x")


if __name__ == "__main__":
    main()
