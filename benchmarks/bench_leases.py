"""Many leases ending at once: how long other engines wait meanwhile.

The daemon runs as a subprocess. An engine stores --pins keys (pages of 64 bytes: MLA of 64 fp8
values, one layer, one token a page); a second engine of the same model then takes --leases leases
of them all (Lookups pinning every key, --leases x --pins pins), and they end in one of three ways,
one after the other, each by another holder:

- release: one Release of every lease;
- unregister: the holder unregisters, its leases with it;
- expiry: the leases were taken to end --expiry-ms after the first one's Lookup, all at once, and
  run out in the same sweep of the daemon's.

Meanwhile a probe process, a third engine, calls Stats back to back (bench_control.py's probe).
Each way prints the probe's longest Stats while the leases ended (for expiry: from their end to
1.5 s past it, the sweep within) and, as the baseline of the same run, over an idle window as long
once the ways are done; the ratio is the second over the third. Run:
python benchmarks/bench_leases.py [--leases 128] [--pins 131072] [--expiry-ms 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from bench_control import end_probe, longest_call, probe  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402

from kvclient import KVLayout, ShmKVPool  # noqa: E402
from kvclient._messages import register_request  # noqa: E402
from kvclient._transport.fd_socket import ticketed  # noqa: E402
from kvserver.v1 import kvserver_pb2 as pb  # noqa: E402
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc  # noqa: E402

MESSAGE_LIMIT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
KEY_BYTES = 16
LAYOUT = KVLayout.mla(64, 0)  # fp8: 64 bytes a token, a page
WAYS = ("release", "unregister", "expiry")
SWEEP_S = 1.0  # the daemon ends expired leases once a second


def _register(stub, address: str, pool: ShmKVPool) -> str:
    req = register_request(model="leases", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                           host_tokens=0, page_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    return stub.Register(ticketed(address, pool, req), timeout=600).client_id


def _end(way: str, stub, holder: str, keys: bytes, leases: int, pins: int,
         expiry_ms: int) -> tuple[float, float]:
    """Takes the leases through ``holder`` and ends them ``way``: the window in which they ended."""
    # The expiry run's leases are taken to end at the same moment, in one sweep of the daemon's.
    target = time.monotonic() + expiry_ms / 1000
    ids = []
    for _ in range(leases):
        pin_ms = 60_000 if way != "expiry" else round((target - time.monotonic()) * 1000)
        if pin_ms < 500:
            raise SystemExit(f"the leases took over {expiry_ms - 500} ms to take: give --expiry-ms more")
        got = stub.Lookup(pb.LookupRequest(client_id=holder, keys=keys, key_bytes=KEY_BYTES, pin_ms=pin_ms),
                          timeout=600)
        if got.pages != pins:
            raise SystemExit(f"a Lookup found {got.pages} of {pins} keys")
        ids.append(got.lease_id)
    if way == "release":
        t0 = time.monotonic()
        ended = stub.Release(pb.ReleaseRequest(client_id=holder, lease_ids=ids), timeout=600)
        t1 = time.monotonic()
        if ended.released != leases:
            raise SystemExit(f"released {ended.released} of {leases} leases")
    elif way == "unregister":
        t0 = time.monotonic()
        stub.Unregister(pb.UnregisterRequest(client_id=holder), timeout=600)
        t1 = time.monotonic()
    else:
        t0, t1 = target, target + SWEEP_S + 0.5
        time.sleep(max(0.0, t1 - time.monotonic()))
        left = stub.Release(pb.ReleaseRequest(client_id=holder, lease_ids=ids), timeout=600)
        if left.released:
            raise SystemExit(f"{left.released} leases were held past their end and the next sweep")
    return t0, t1


def run(ways: list[str], host_memory: str, leases: int, pins: int, expiry_ms: int) -> list[tuple]:
    """(way, seconds the leases took to end, the probe's longest Stats meanwhile, idle before)."""
    ctx = mp.get_context("spawn")
    keys = np.arange(pins, dtype=np.uint64).view(np.uint8).reshape(pins, 8)
    keys = np.concatenate([keys, np.full((pins, KEY_BYTES - 8), 7, np.uint8)], axis=1).tobytes()
    windows = []
    with tempfile.TemporaryDirectory(prefix="kvleases-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--log-level", "ERROR", host_memory=host_memory)
        stop, (mine, theirs) = ctx.Event(), ctx.Pipe()
        prober = None
        try:
            with grpc.insecure_channel(d.address, options=MESSAGE_LIMIT) as ch, \
                    ShmKVPool(LAYOUT, torch.float8_e4m3fn, num_layers=1, num_tokens=pins) as pool, \
                    ShmKVPool(LAYOUT, torch.float8_e4m3fn, num_layers=1, num_tokens=64) as small:
                stub = pb_grpc.KVServerStub(ch)
                owner = _register(stub, d.address, pool)
                put = stub.Put(pb.PutRequest(client_id=owner, keys=keys, key_bytes=KEY_BYTES,
                                             device_pages=np.arange(pins)), timeout=600)
                if put.stored != pins:
                    raise SystemExit(f"stored {put.stored} of {pins} keys: give --host-memory more")
                prober = ctx.Process(target=probe, args=(d.address, stop, theirs))
                prober.start()
                assert mine.recv() == "ready"
                for way in ways:
                    holder = _register(stub, d.address, small)  # a second engine of the same model
                    windows.append((way, *_end(way, stub, holder, keys, leases, pins, expiry_ms)))
                    if way != "unregister":
                        stub.Unregister(pb.UnregisterRequest(client_id=holder), timeout=600)
                # The idle baseline: a window as long as each way's, nothing else asked meanwhile.
                idle_from = time.monotonic()
                time.sleep(max(t1 - t0 for _, t0, t1 in windows) + 0.1)
        finally:
            calls = end_probe(stop, mine, prober)
            d.stop()
    return [(way, t1 - t0, longest_call(calls, t0, t1), longest_call(calls, idle_from, idle_from + t1 - t0))
            for way, t0, t1 in windows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leases", type=int, default=128)
    ap.add_argument("--pins", type=int, default=1 << 17,
                    help="keys each lease pins (the most a Lookup may name)")
    ap.add_argument("--expiry-ms", type=int, default=20_000,
                    help="when the expiry run's leases end, from the first Lookup (more than taking "
                         "them all takes)")
    ap.add_argument("--host-memory", default="1GiB")
    ap.add_argument("--ways", default=",".join(WAYS), help="which of release, unregister, expiry")
    args = ap.parse_args()
    print(f"{args.leases} leases of {args.pins} pins each ({args.leases * args.pins} pins), "
          f"budget {args.host_memory}")
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        raise SystemExit(f"--ways: each of {', '.join(WAYS)}")
    for way, took, held, idle in run(ways, args.host_memory, args.leases, args.pins, args.expiry_ms):
        print(f"  {way:10s} ended within {took * 1e3:8.1f} ms; probe's longest Stats meanwhile "
              f"{held * 1e3:6.1f} ms, idle {idle * 1e3:6.1f} ms: {held / idle:.1f}x")


if __name__ == "__main__":
    main()
