"""Where a CUDA pool's one-page round trip spends its time, hop by hop (for a lent GPU machine).

    python3 scripts/gpu_hops.py [--seconds 6]

It starts the daemon with timers around each hop of a copy (``daemon`` mode: the daemon itself,
its methods wrapped by ``install_timers``), registers one engine whose pool is a 4-layer MHA bf16
CUDA pool, makes one-page (16-token) write + load round trips on the lane for ``--seconds``, stops
the daemon, and prints the p50 and p90 of each hop of a write and of a load, in microseconds, as
one JSON document (also written to ``$OUT/hops.json`` where ``OUT`` is set). The hops:

- the engine's request until the loop serves it;
- the request's checks and plan, on the loop;
- until the copy worker takes the job, then the copy worker's enqueue (the CuPy calls);
- until the copy is waited for (a waiter thread), then the wait (polling the copy's events: a
  not-done query is followed by a sleep of at least 50 us);
- until the loop has answered, then until the engine has the answer.

Timers are monotonic clock readings of one machine, in both processes. Requests are one at a time,
so the n-th copy of the daemon is the n-th call of the engine. docs/performance.md ("On a GPU")
has its figures of 2026-12-04.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

MARKS = ("serve", "submit", "enq0", "enq1", "wait0", "wait1", "done", "recorded")
HOPS = (
    ("the engine's request until the loop serves it", "call", "serve"),
    ("the request's checks and plan (the loop)", "serve", "submit"),
    ("until the copy worker takes it", "submit", "enq0"),
    ("the copy worker's enqueue (CuPy calls)", "enq0", "enq1"),
    ("until the copy is waited for", "enq1", "wait0"),
    ("the wait: polling the copy's events", "wait0", "wait1"),
    ("until the loop has answered", "wait1", "done"),
    ("until the engine has the answer", "done", "return"),
    ("the whole call", "call", "return"),
)
COPIES = ("Write", "Load", "WriteB", "LoadB")


def install_timers(marks: dict, patch: Callable = setattr) -> list[str]:
    """Wraps the daemon's methods at each hop so that each appends a monotonic reading to
    ``marks[name]``; returns what it wrapped. ``patch`` is ``setattr`` (or a test's)."""
    from kvserver.copies import progress
    from kvserver.core import copier
    from kvserver.lane import server
    from kvserver.media.cuda import pool
    from kvserver.protocol import ring

    for name in MARKS:
        marks.setdefault(name, [])

    def now(name: str) -> None:
        marks[name].append(time.monotonic())

    serve = server.Lane._serve

    async def timed_serve(self, i, rpc, seq, n, data):
        marks["serve"].append((time.monotonic(), ring.RPC_NAMES.get(rpc)))
        return await serve(self, i, rpc, seq, n, data)

    def before(fn: Callable, name: str) -> Callable:
        def wrapped(*args, **kwargs):
            now(name)
            return fn(*args, **kwargs)
        return wrapped

    def around(fn: Callable, start: str, end: str) -> Callable:
        def wrapped(*args, **kwargs):
            now(start)
            try:
                return fn(*args, **kwargs)
            finally:
                now(end)
        return wrapped

    wraps = {
        (server.Lane, "_serve"): timed_serve,
        (server.Lane, "_done_with"): before(server.Lane._done_with, "done"),
        (copier.Copier, "_submit"): before(copier.Copier._submit, "submit"),
        (progress.LayerSignal, "mark_recorded"): before(progress.LayerSignal.mark_recorded, "recorded"),
        (pool.CudaDevicePool, "enqueue"): around(pool.CudaDevicePool.enqueue, "enq0", "enq1"),
        (pool.CudaDevicePool, "wait"): around(pool.CudaDevicePool.wait, "wait0", "wait1"),
    }
    for (owner, name), fn in wraps.items():
        patch(owner, name, fn)
    return [f"{owner.__name__}.{name}" for owner, name in wraps]


def analyze(marks: dict, calls: list[tuple[float, float]]) -> dict:
    """The p50 and p90 of each hop (microseconds), for writes and loads. ``calls``: the engine's
    (sent, returned) of each call, a write then a load per round trip, as many as the daemon's
    copies or fewer (the daemon's last ones are matched)."""
    serves = [t for t, name in marks["serve"] if name in COPIES]
    m = min(len(calls), len(serves), len(marks["submit"]), len(marks["enq0"]), len(marks["wait1"]))
    m -= m % 2
    if m == 0:
        raise ValueError("no copy was timed")

    def last(seq: list) -> list:
        return seq[len(seq) - m:]

    done = marks["done"]  # the answer after each copy: the first "done" past its submit
    points = {"call": [c[0] for c in last(calls)], "return": [c[1] for c in last(calls)],
              "serve": last(serves), "submit": last(marks["submit"]), "enq0": last(marks["enq0"]),
              "enq1": last(marks["enq1"]), "wait0": last(marks["wait0"]), "wait1": last(marks["wait1"])}
    points["done"] = [done[bisect.bisect_left(done, s)] for s in points["submit"]]
    report = {}
    for kind, parity in (("write", 0), ("load", 1)):
        rows = {}
        for label, a, b in HOPS:
            d = sorted((points[b][j] - points[a][j]) * 1e6 for j in range(parity, m, 2))
            rows[label] = {"p50": round(d[len(d) // 2], 1), "p90": round(d[int(len(d) * 0.9)], 1)}
        report[kind] = rows
    report["calls"] = m
    return report


def engine(address: str, seconds: float) -> tuple[list[tuple[float, float]], dict]:
    """One engine's round trips; returns each call's (sent, returned) and its own figures."""
    import torch

    from kvclient import CudaKVPool, KVClient, KVLayout

    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    dev = torch.device("cuda", 0)
    layout, dtype = KVLayout.mha(8, 128), torch.bfloat16
    buffers = [[torch.zeros(4096, 8, 128, dtype=dtype, device=dev) for _ in range(2)] for _ in range(4)]
    client = KVClient(address, timeout=60, resilient=False)
    client.register(model="hops", pool=CudaKVPool(layout, dtype, buffers), start_layer=0, end_layer=4,
                    num_layers=4, host_tokens=1024, page_size=16)
    host, dev_idx = client.alloc(16), torch.arange(16)
    calls: list[tuple[float, float]] = []
    cpu0, end = time.process_time(), time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        client.write(host_indices=host, device_indices=dev_idx)
        t1 = time.monotonic()
        client.load(host_indices=host, device_indices=dev_idx, event_slot=1).wait()
        t2 = time.monotonic()
        calls += [(t0, t1), (t1, t2)]
    trips = len(calls) // 2
    mine = {"trips": trips, "lane": client.lane is not None,
            "engine_cpu_us_a_trip": round((time.process_time() - cpu0) / trips * 1e6, 1)}
    client.unregister()
    client.close()
    return calls, mine


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "daemon"])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--marks", help="daemon mode: where the timers go when it stops")
    args, rest = ap.parse_known_args()
    if args.mode == "daemon":  # the daemon, timed; its own arguments follow
        import atexit
        import runpy

        marks: dict = {}
        install_timers(marks)
        atexit.register(lambda: json.dump(marks, open(args.marks, "w")))
        sys.argv = ["kvserver", *rest]
        runpy.run_module("kvserver", run_name="__main__", alter_sys=True)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_check  # noqa: F401  (kvserver and kvclient from this tree)

    tmp = tempfile.mkdtemp(prefix="kvhops-")
    socket, marks_file = os.path.join(tmp, "kv.sock"), os.path.join(tmp, "marks.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([gpu_check.ROOT, os.environ.get("PYTHONPATH", "")])}
    daemon = subprocess.Popen([sys.executable, os.path.abspath(__file__), "daemon", "--marks", marks_file,
                               "--socket", socket, "--host-memory", "2GiB", "--progress-interval-ms", "0"],
                              env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the daemon did not start")
            time.sleep(0.05)
        calls, mine = engine(f"unix://{socket}", args.seconds)
    finally:
        daemon.terminate()
        daemon.wait(30)
    report = {**mine, **analyze(json.load(open(marks_file)), calls)}
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hops.json"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
