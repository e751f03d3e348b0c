"""Bounded soak: 8 engine processes hammer one daemon subprocess with random Alloc / Write / Load /
Free for SOAK_SECONDS, checking every loaded byte; then every count and mapping returns to zero.
One run also SIGKILLs 2 of the 8 in the middle: the daemon reclaims them, the others never notice."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import signal
import time

import pytest
from daemon_proc import DaemonProcess
from soak_engine import soak_worker

from kvserver.protocol.shared_memory import SHM_DIR

SOAK_SECONDS = float(os.environ.get("KVSERVER_SOAK_SECONDS", "8"))
PROCS = 8
KILLED = 2
MIN_OPS = 50


@pytest.fixture(scope="module")
def forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["soak_engine"])
    return ctx


def next_message(out, deadline: float, procs) -> tuple:
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            dead = [p.pid for p in procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
            assert not dead, f"soak processes {dead} died without reporting"
            assert time.monotonic() < deadline, "soak processes did not report in time"


def run_soak(ctx, d: DaemonProcess, tag: str, kill: int) -> dict[str, dict]:
    """Runs the soak; returns each surviving process's report by pool name (its memfd's label)."""
    run = secrets.token_hex(3)
    names = [f"kvsoak-{tag}-{run}-{i}" for i in range(PROCS)]
    out = ctx.Queue()
    procs = [ctx.Process(target=soak_worker, args=(d.address, name, 1000 * i + 7, SOAK_SECONDS, out))
             for i, name in enumerate(names)]
    by_name = dict(zip(names, procs, strict=True))
    reports: dict[str, dict] = {}
    killed: list[str] = []
    try:
        for p in procs:
            p.start()
        started: set[str] = set()
        deadline = time.monotonic() + 60
        while len(started) < PROCS:
            kind, name, payload = next_message(out, deadline, procs)
            assert kind == "started", f"{name} {kind}: {payload}"
            started.add(name)
        t_all = time.monotonic()
        stats = d.stats()
        assert stats.num_clients == PROCS and all(c.sessions == 1 for c in stats.clients), stats

        if kill:
            time.sleep(SOAK_SECONDS / 2)
            killed = names[1:1 + 2 * kill:2]
            for name in killed:
                os.kill(by_name[name].pid, signal.SIGKILL)
            for name in killed:
                by_name[name].join(10)
                assert by_name[name].exitcode == -signal.SIGKILL
            # Reclaimed after the 0.2 s grace while the others keep going.
            d.wait_for(lambda s: s.reclaimed_clients == kill, timeout=5)
            stats = d.stats()
            assert stats.num_clients == PROCS - kill, stats
            # The pools are unmapped on a worker thread once the clients are gone: within 2 s.
            unmapped_by = time.monotonic() + 2
            while True:
                maps = d.shm_maps()
                left = [m for m in maps if any(n in m for n in killed)]
                if not left or time.monotonic() > unmapped_by:
                    break
                time.sleep(0.02)
            assert not left, f"killed pools still mapped 2 s after their reclaim: {maps}"

        deadline = t_all + SOAK_SECONDS + 60
        while len(reports) < PROCS - len(killed):
            kind, name, payload = next_message(out, deadline, procs)
            assert kind == "done", f"{name} {kind}: {payload}"
            reports[name] = payload
        for p in procs:
            p.join(30)
            assert p.exitcode in (0, -signal.SIGKILL), f"exit code {p.exitcode}"
        left = [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
        assert left == [], f"pools left in {SHM_DIR}, the killed engines' included: {left}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert set(reports) == set(names) - set(killed)
    return reports


def check_reports(reports: dict[str, dict]) -> None:
    summary = {name[-1]: (r["ops"], r["mismatches"], r["errors"]) for name, r in reports.items()}
    print(f"soak {SOAK_SECONDS:g} s, ops per process: {sorted(r['ops'] for r in reports.values())}, "
          f"first process by op: {next(iter(reports.values()))['by_op']}")
    for name, r in reports.items():
        assert r["mismatches"] == 0, f"{name}: {r['mismatches']} mismatches: {r['mismatch_details']}"
        assert r["errors"] == 0, f"{name}: {r['errors']} errors: {r['error_details']}"
        assert r["ops"] >= MIN_OPS, f"{name} did only {r['ops']} ops in {r['seconds']:.1f} s: {summary}"
        assert r["used_tokens_at_end"] == r["held_at_end"], r
        # Every kind of operation happened, RESOURCE_EXHAUSTED included.
        for op in ("alloc", "write", "load", "free", "load_layers", "overwrite", "alloc_exhausted",
                   "free_during_load", "write_during_load"):
            assert r["by_op"].get(op, 0) > 0, f"{name} never did {op}: {r['by_op']}"


def check_daemon_clean(d: DaemonProcess, reclaimed: int) -> None:
    s = d.stats()  # every survivor unregistered before it reported; the killed were reclaimed
    assert (s.num_clients, s.reserved_bytes, s.used_bytes, s.reclaimed_clients) == (0, 0, 0, reclaimed), s
    assert list(s.clients) == []
    assert d.shm_maps() == [], f"daemon still maps {d.shm_maps()}"


def test_soak_eight_engines(socket_dir, forkserver):
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        reports = run_soak(forkserver, d, "all", kill=0)
        check_reports(reports)
        check_daemon_clean(d, reclaimed=0)
        # The daemon-wide counters are exactly the sum of what the engines did.
        t = d.stats().transfers
        for field in ("write_ops", "load_ops", "bytes_written", "bytes_loaded"):
            assert getattr(t, field) == sum(r[field] for r in reports.values()), (field, t)
    finally:
        assert d.stop() == 0


def test_soak_with_two_engines_killed_midway(socket_dir, forkserver):
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--reclaim-grace-seconds", "0.2",
                      "--progress-interval-ms", "0")
    try:
        reports = run_soak(forkserver, d, "kill", kill=KILLED)
        check_reports(reports)
        check_daemon_clean(d, reclaimed=KILLED)
        t = d.stats().transfers
        for field in ("write_ops", "load_ops", "bytes_written", "bytes_loaded"):
            assert getattr(t, field) >= sum(r[field] for r in reports.values()), (field, t)
    finally:
        assert d.stop() == 0
