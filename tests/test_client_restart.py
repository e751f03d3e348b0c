"""Engines keep serving through a daemon crash and restart: misses, then re-registration, then hits."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from checks import wait_until
from daemon_proc import DaemonProcess
from engine_procs import resilient_engine

ENGINES = 2


def test_engines_ride_through_a_daemon_restart(socket_dir):
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    counters = ctx.Array("q", 3 * ENGINES)  # per engine: hits, misses, reconnects
    out = ctx.Queue()
    procs = [ctx.Process(target=resilient_engine, args=(d.address, i, stop, counters, out))
             for i in range(ENGINES)]
    for p in procs:
        p.start()
    try:
        hits = lambda i: counters[3 * i]  # noqa: E731
        wait_until(lambda: all(hits(i) >= 5 for i in range(ENGINES)), 120, "first hits")
        d.kill()
        before = [hits(i) for i in range(ENGINES)]
        time.sleep(1.0)  # the engines run on without a daemon
        assert all(counters[3 * i + 1] > 0 for i in range(ENGINES)), "no misses while the daemon was down"
        d.start()
        wait_until(lambda: all(counters[3 * i + 2] >= 1 for i in range(ENGINES)), 30, "re-registration")
        wait_until(lambda: all(hits(i) >= before[i] + 5 for i in range(ENGINES)), 30, "hits after restart")
        assert d.stats().num_clients == ENGINES
    finally:
        stop.set()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        d.stop()
    for r in results:
        assert "traceback" not in r, r["traceback"]
        assert r["mismatches"] == 0, r
        assert r["stale_hits"] == 0, f"host indices from before the restart were served: {r}"
        assert r["misses"] > 0, r
        # Every call was bounded: the client timeout is 2 s, and a dead daemon fails at once.
        assert r["max_call_s"] < 3.0, r
