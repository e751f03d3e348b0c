"""Seconds from a daemon's launch to its first answered call, and its memory once it answers.

Each run launches ``python -m kvserver`` on a private socket and times it to the first answered
Stats (the interpreter, the imports, host memory mapped, the sockets); the daemon's resident memory
(VmRSS) is read then, before any engine registers. The baseline, interleaved in the same run: the
same daemon launched after ``import torch`` in its process, which is what every start cost while
the daemon's own modules loaded torch. The restart of a daemon (a kill, an upgrade) waits for this
start before an engine can register again.

Run: python benchmarks/bench_start.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

WITH_TORCH = ("import runpy, sys, torch; sys.argv[0] = 'kvserver'; "
              "runpy.run_module('kvserver', run_name='__main__', alter_sys=True)")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_once(sock_dir: str, torch_first: bool) -> tuple[float, float, bool]:
    """(seconds to the first answered Stats, MiB resident then, whether torch is mapped)."""
    sock = os.path.join(sock_dir, "kv.sock")
    for p in (sock, sock + ".fd"):
        if os.path.exists(p):
            os.unlink(p)
    head = [sys.executable, "-c", WITH_TORCH] if torch_first else [sys.executable, "-m", "kvserver"]
    args = [*head, "--socket", sock, "--host-memory", "256MiB", "--log-level", "ERROR"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args)
    try:
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}")
            time.sleep(0.002)
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stub = pb_grpc.KVServerStub(ch)
            while True:
                try:
                    stub.Stats(pb.StatsRequest(), timeout=5)
                    break
                except grpc.RpcError:
                    if proc.poll() is not None:
                        raise RuntimeError(f"daemon exited {proc.returncode}") from None
                    time.sleep(0.002)
        took = time.perf_counter() - t0
        with open(f"/proc/{proc.pid}/maps") as f:
            torch_mapped = any("libtorch" in line for line in f)
        return took, rss_mib(proc.pid), torch_mapped
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args(argv)
    rows: dict[bool, list[tuple[float, float, bool]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="kv-start-") as sock_dir:
        start_once(sock_dir, False)  # the modules read once from disk, as in every later start
        for _ in range(args.runs):
            for torch_first in (False, True):
                rows[torch_first].append(start_once(sock_dir, torch_first))
    print(f"launch to the first answered Stats, {args.runs} runs each, interleaved (medians, min-max)\n")
    print("| daemon | seconds | min | max | resident MiB | torch mapped |")
    print("|---|---|---|---|---|---|")
    names = {False: "as shipped", True: "torch imported first (baseline)"}
    med = {}
    for torch_first in (False, True):
        secs = [r[0] for r in rows[torch_first]]
        med[torch_first] = statistics.median(secs)
        mib = statistics.median(r[1] for r in rows[torch_first])
        mapped = {r[2] for r in rows[torch_first]}
        print(f"| {names[torch_first]} | {med[torch_first]:.3f} | {min(secs):.3f} | {max(secs):.3f} "
              f"| {mib:.0f} | {'yes' if mapped == {True} else 'no' if mapped == {False} else 'some'} |")
    print(f"\nstart as shipped / baseline: {med[False] / med[True]:.2f}")


if __name__ == "__main__":
    main()
