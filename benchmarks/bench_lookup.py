"""A Lookup's cost inside the daemon: from the request's bytes to the response's bytes on the
daemon's event loop (parse, the servicer's Lookup with its checks, the index walk, the answer),
without the transport, against a bare dict lookup of the same keys in the same run.

The daemon runs in this process on a temp Unix socket (its event loop on a thread of its own); an
engine registers over the socket and stores 64k keys of tiny pages (512 B); a scheduler opens the
space. Then, on the daemon's loop, ``--rounds`` Lookups of 1k and of 64k stored keys are timed one
by one, as the engine asks (its own part) and as the scheduler asks (the whole space), with the
index's compiled walk and key digests (``kvserver.store._kvindex``) and with their numpy and
hashlib versions (the build without a compiler), in alternating order; for keys of 16 bytes (kept
whole) and of 32 bytes (SGLang's and vLLM's keys, also kept whole: ``store/keys.py``), and of
48 bytes where asked (``--key-bytes 16,32,48``: kept as a 16-byte BLAKE2b digest).
Prints the median of each and the target: 1k keys ≤ 50 µs.

Run: python benchmarks/bench_lookup.py [--rounds 200] [--keys 1024,65536] [--key-bytes 16,32]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import threading
import time
from itertools import repeat

import numpy as np
import torch
import uvloop

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool
from kvserver.config import ServerConfig
from kvserver.server import Daemon
from kvserver.store import index
from kvserver.store import keys as store_keys
from kvserver.v1 import kvserver_pb2 as pb

PAGE = 16
LAYOUT = KVLayout.mha(1, 8)  # fp16, 1 layer: 512 B a page
TARGET_US = 50.0  # a Lookup of 1k keys in the daemon


def keys(n: int, key_bytes: int = 16) -> list[bytes]:
    return [hashlib.blake2b(f"lookup/{i}".encode(), digest_size=key_bytes).digest() for i in range(n)]


async def timed(daemon: Daemon, raw: bytes, n: int, rounds: int, compiled: bool) -> list[float]:
    """Seconds per Lookup of ``raw`` (a serialized LookupRequest of ``n`` stored keys), parse to
    serialized answer; each must find all ``n``. Not ``compiled``: the daemon's page table and
    index take their numpy paths, and keys are digested with hashlib (a build without a compiler)."""
    pages = daemon.servicer.cache.cache.pages
    words = store_keys._compiled_words
    store_keys._compiled_words = words if compiled else None
    pages_c, index_c = pages._c, pages.index._c
    pages._c, pages.index._c = (pages_c, index_c) if compiled else (None, None)
    try:
        out = []
        for _ in range(rounds):
            t = time.perf_counter()
            req = pb.LookupRequest.FromString(raw)
            resp = await daemon.servicer.Lookup(req, None)  # the context is used only on an error
            resp.SerializeToString()
            out.append(time.perf_counter() - t)
            assert resp.pages == n, f"a Lookup found {resp.pages} of {n} stored keys"
        return out
    finally:
        store_keys._compiled_words = words
        pages._c, pages.index._c = pages_c, index_c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--keys", default="1024,65536", help="Lookup sizes, comma separated (1024 among them)")
    ap.add_argument("--key-bytes", default="16,32", help="key lengths, comma separated (16 among them)")
    args = ap.parse_args()
    counts = [int(x) for x in args.keys.split(",")]
    widths = [int(x) for x in args.key_bytes.split(",")]
    if 16 not in widths:
        ap.error("--key-bytes must include 16")
    if 1024 not in counts:
        ap.error("--keys must include 1024: the target is a Lookup of 1k keys")
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=600)

    async def start(config: ServerConfig) -> Daemon:
        d = Daemon(config)
        await d.start()
        return d

    most = max(counts)
    with tempfile.TemporaryDirectory(prefix="kv-bench-lookup-") as tmp:
        sock = os.path.join(tmp, "kv.sock")
        daemon = on_loop(start(ServerConfig(socket=sock,
                                            host_memory=2 * len(widths) * most * 512 + (64 << 20))))
        try:
            address = f"unix://{sock}"
            with ShmKVPool(LAYOUT, torch.float16, 1, most * PAGE) as pool, KVClient(address) as engine, \
                    CacheView(address, model="bench-lookup", layout=LAYOUT, dtype=torch.float16,
                              page_size=PAGE, num_layers=1) as view:
                engine.register(model="bench-lookup", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                                host_tokens=PAGE, page_size=PAGE)
                stored_of = {}
                for width in widths:
                    stored_of[width] = keys(most, width)
                    r = engine.put(stored_of[width], np.arange(most), key_bytes=width)
                    assert r.stored == most, f"only {r.stored} of {most} keys were stored: {r}"
                view.open()
                print(f"{'Lookup in the daemon':<34}{'bytes':>6}{'keys':>7}{'compiled':>11}{'numpy':>11}"
                      f"{'dict':>11}{'compiled/dict':>15}")
                results = {}
                for width, n in ((w, n) for w in widths for n in counts):
                    stored = stored_of[width]
                    packed = b"".join(stored[:n])
                    d = dict(zip(stored, range(most), strict=True))
                    listed = stored[:n]
                    base = []
                    for _ in range(max(5, args.rounds // 10)):
                        t = time.perf_counter()
                        np.fromiter(map(d.get, listed, repeat(-1)), np.int64, n)
                        base.append(time.perf_counter() - t)
                    for who, req in (("engine (its part)", pb.LookupRequest(
                                         client_id=engine.client_id, keys=packed, key_bytes=width)),
                                     ("scheduler (the space)", pb.LookupRequest(
                                         space_id=view.space_id, keys=packed, key_bytes=width))):
                        raw = req.SerializeToString()
                        assert on_loop(daemon.servicer.Lookup(req, None)).pages == n
                        rounds = args.rounds if n <= 1024 else max(6, args.rounds * 1024 // n)
                        got = {True: [], False: []}
                        for i in range(4):  # alternating, in blocks
                            compiled = i % 2 == 0
                            got[compiled] += on_loop(timed(daemon, raw, n, rounds // 2 or 1, compiled))
                        c, p, b = (statistics.median(x) for x in (got[True], got[False], base))
                        results[(who, width, n)] = c
                        print(f"{who:<34}{width:>6}{n:>7}{c * 1e6:>9.1f}µs{p * 1e6:>9.1f}µs{b * 1e6:>9.1f}µs"
                              f"{c / b:>14.1f}×")
                engine.unregister()
            print()
            for width in widths:
                c = results[("engine (its part)", width, 1024)]
                print(f"target: a Lookup of 1k keys of {width} bytes in the daemon ≤ {TARGET_US:.0f} µs: "
                      f"{c * 1e6:.1f} µs ({'met' if c * 1e6 <= TARGET_US else 'not met'}; compiled walk "
                      f"and digests: {'yes' if index._kvindex is not None else 'not built'})")
        finally:
            on_loop(daemon.stop())
            loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
