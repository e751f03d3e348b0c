"""Control-path costs of tiny pages: Register, Alloc and Free, and how long they hold other engines.

The daemon runs as a subprocess. One engine registers a pool of tiny pages (MLA of --rank values,
fp8, --layers layers, --page-size tokens per page: --rank x --page-size x --layers bytes a page)
taking what the --host-memory budget holds, then allocates and frees --tokens host tokens in one call each.
Meanwhile a probe process, registered as a second engine, calls Stats back to back; the report
gives each step's wall time, the daemon's resident memory, and the probe's longest call while the
step ran. With --copies, a Write and a Load of every allocated token (device tokens shuffled) run
between the Alloc and the Free.
Run: python benchmarks/bench_control.py [--host-memory 64MiB] [--rank 1] [--page-size 1] [--layers 1]
[--copies]
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

from daemon_proc import DaemonProcess  # noqa: E402

from kvclient import KVLayout, ShmKVPool  # noqa: E402
from kvclient._messages import register_request  # noqa: E402
from kvclient._transport.fd_socket import ticketed
from kvserver.v1 import kvserver_pb2 as pb  # noqa: E402
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc  # noqa: E402

MESSAGE_LIMIT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _request(pool: ShmKVPool, host_tokens: int, page_size: int, layers: int = 1) -> pb.RegisterRequest:
    req = register_request(model="tiny", pool=pool, start_layer=0, end_layer=layers, num_layers=layers,
                           host_tokens=host_tokens, page_size=page_size, tp_rank=0, tp_size=1,
                           pp_rank=0, pp_size=1)
    req.min_host_tokens = page_size  # take whatever the budget and the limits allow
    return req


def probe(address: str, stop, out) -> None:
    """A second engine calling Stats back to back; sends (start, seconds) of every call."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.KVServerStub(ch)
        pool = ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=1, num_tokens=64)
        try:
            cid = stub.Register(ticketed(address, pool, _request(pool, 16, 16)), timeout=60).client_id
            out.send("ready")
            calls = []
            while not stop.is_set():
                t0 = time.monotonic()
                stub.Stats(pb.StatsRequest(client_id=cid), timeout=120)
                calls.append((t0, time.monotonic() - t0))
            stub.Unregister(pb.UnregisterRequest(client_id=cid), timeout=60)
            out.send(calls)
        finally:
            pool.close()


def end_probe(stop, mine, prober) -> list[tuple[float, float]]:
    """Stops a ``probe`` process (None: never started) and returns its calls."""
    stop.set()
    if prober is None:
        return []
    calls = mine.recv()
    prober.join()
    return calls


def longest_call(calls: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest a probe call waited within [start, end) (a call may span its edges)."""
    return max((min(t + s, end) - max(t, start) for t, s in calls if t < end and t + s > start), default=0.0)


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host-memory", default="64MiB")
    ap.add_argument("--rank", type=int, default=1, help="MLA kv_lora_rank (fp8: bytes per token)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--layers", type=int, default=1, help="the engine's pool's layers (a Register's size)")
    ap.add_argument("--tokens", type=int, default=1 << 22,
                    help="host tokens in one Alloc and Free (the daemon is started taking that many indices "
                         "a request, above its default of 1 Mi)")
    ap.add_argument("--daemon-args", default="", help="extra daemon flags, space separated")
    ap.add_argument("--copies", action="store_true",
                    help="also a Write and a Load of every allocated token, device tokens shuffled (the pool "
                         "then holds --tokens tokens)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    most = max(-(-args.tokens // args.page_size) * args.page_size, 1 << 20)  # an Alloc takes whole pages
    with tempfile.TemporaryDirectory(prefix="kvctl-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--log-level", "ERROR",
                          "--max-request-indices", str(most), *args.daemon_args.split(),
                          host_memory=args.host_memory)
        stop, (mine, theirs) = ctx.Event(), ctx.Pipe()
        prober = ctx.Process(target=probe, args=(d.address, stop, theirs))
        prober.start()
        assert mine.recv() == "ready"
        pool = ShmKVPool(KVLayout.mla(args.rank, 0), torch.float8_e4m3fn, num_layers=args.layers,
                         num_tokens=args.tokens if args.copies else 1024)
        steps: list[tuple[str, float, float, str]] = []
        try:
            with grpc.insecure_channel(d.address, options=MESSAGE_LIMIT) as ch:
                stub = pb_grpc.KVServerStub(ch)
                rss0 = d.rss()
                t0 = time.monotonic()
                try:
                    req = _request(pool, 1 << 40, args.page_size, args.layers)
                    reg = stub.Register(ticketed(d.address, pool, req), timeout=600)
                except grpc.RpcError as exc:
                    steps.append(("Register", t0, time.monotonic(), f"{exc.code().name}: {exc.details()}"))
                    reg = None
                else:
                    grown = (d.rss() - rss0) >> 20
                    steps.append(("Register", t0, time.monotonic(),
                                  f"{reg.host_tokens} tokens granted, daemon RSS +{grown} MiB"))
                if reg is not None:
                    n = min(args.tokens, reg.host_tokens)
                    t0 = time.monotonic()
                    host = stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=n), timeout=600)
                    steps.append(("Alloc", t0, time.monotonic(), f"{len(host.host_indices)} tokens"))
                    if args.copies:
                        dev = np.random.default_rng(0).permutation(len(host.host_indices))
                        write = pb.WriteRequest(client_id=reg.client_id, host_indices=host.host_indices,
                                                device_indices=dev)
                        t0 = time.monotonic()
                        wrote = stub.Write(write, timeout=600)
                        steps.append(("Write", t0, time.monotonic(), f"{wrote.bytes} bytes"))
                        load = pb.LoadRequest(client_id=reg.client_id, host_indices=host.host_indices,
                                              device_indices=dev)
                        t0 = time.monotonic()
                        last = list(stub.Load(load, timeout=600))[-1]
                        steps.append(("Load", t0, time.monotonic(), f"{last.bytes} bytes"))
                    req = pb.FreeRequest(client_id=reg.client_id, host_indices=host.host_indices)
                    t0 = time.monotonic()
                    freed = stub.Free(req, timeout=600)
                    steps.append(("Free", t0, time.monotonic(), f"{freed.freed_tokens} tokens"))
                    stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=600)
            hwm = _hwm(d.pid)
        finally:
            calls = end_probe(stop, mine, prober)
            pool.close()
            d.stop()
    print(f"budget {args.host_memory}, pages of {args.rank * args.page_size * args.layers} B "
          f"(MLA rank {args.rank}, fp8, {args.layers} layer{'s' if args.layers > 1 else ''}, "
          f"page {args.page_size}); "
          f"daemon peak RSS {hwm >> 20} MiB")
    for name, start, end, what in steps:
        held = longest_call(calls, start, end)
        print(f"  {name:8s} {end - start:8.3f} s   probe's longest Stats meanwhile {held * 1e3:8.1f} ms"
              f"   {what}")


if __name__ == "__main__":
    main()
