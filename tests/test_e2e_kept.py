"""kill -9 of a daemon that keeps its cache (--host-memory-dir), in the middle of a Put and Get
storm from several engine processes, 8 times (4 with host memory alone; KVSERVER_KILL_ROUNDS sets
the 8): after each restart every page a Put confirmed is
found again and bit-exact, no engine ever loads a wrong byte, and the engines carry on through
every restart without one of their own."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import time

import numpy as np
import pytest
from cache_engine import CacheEngine, scattered
from daemon_proc import DaemonProcess
from kept_engine import storm_engine

ENGINES = 3
ROUNDS = int(os.environ.get("KVSERVER_KILL_ROUNDS", "8"))
PAGE_SIZE = 4  # tokens a page: 8 KiB pages, so that the rounds of Puts fit the cache whole


@pytest.fixture
def kept_dir():
    path = f"/dev/shm/kvserver-test-storm-{os.getpid()}-{os.urandom(3).hex()}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def drain(out, confirmed: list[bytes], per_engine: list[int], until: float = 0.0) -> list:
    """Takes every message waiting (and those arriving until ``until``); keeps confirmed keys."""
    other = []
    while True:
        try:
            kind, idx, payload = out.get(timeout=max(0.0, until - time.monotonic()) or 0.01)
        except queue.Empty:
            return other
        if kind == "confirmed":
            confirmed += payload
            per_engine[idx] += len(payload)
        else:
            other.append((kind, idx, payload))


def check_all_found(address: str, keys: list[bytes], rng: np.random.Generator) -> None:
    """Every key is stored; a sample of them (and every 50th) loads bit-exact."""
    with CacheEngine(address, pages=256, page_size=PAGE_SIZE) as eng:
        for i in range(0, len(keys), 4096):
            chunk = keys[i : i + 4096]
            hit = eng.lookup(chunk).pages
            assert hit == len(chunk), f"confirmed key {chunk[hit]!r} was not found after the restart"
        sample = [keys[i] for i in sorted(set(rng.integers(0, len(keys), 200).tolist()))] + keys[::50]
        for i in range(0, len(sample), 256):
            chunk = sample[i : i + 256]
            pages = scattered(rng, len(chunk), eng.num_pages)
            eng.wipe()
            assert eng.get(chunk, pages) == len(chunk)
            assert eng.wrong(chunk, pages) == [], "a confirmed page came back with other bytes"


@pytest.mark.parametrize("tiers", ["host", "host+disk"])
def test_kill_9_storms_lose_no_confirmed_page_and_serve_no_torn_one(socket_dir, kept_dir, tmp_path, tiers):
    """With the disk tier the host memory is small: the storm's pages go on to disk as host memory
    evicts them, and both tiers are found again after every kill (a page leaves host memory only
    once its disk copy is written; pages the killed daemon had not written yet are in the kept
    host memory, and the next daemon writes them)."""
    more = ("--disk-cache", str(tmp_path / "disk"), "--disk-size", "1GiB") if tiers == "host+disk" else ()
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--host-memory-dir", kept_dir,
                      "--log-level", "INFO", *more, host_memory="24MiB" if more else "1GiB")
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=storm_engine, args=(d.address, i, stop, out, PAGE_SIZE, 0.004))
             for i in range(ENGINES)]
    for p in procs:
        p.start()
    confirmed: list[bytes] = []
    per_engine = [0] * ENGINES
    rng = np.random.default_rng(7)
    results, errors = {}, []
    try:
        ready = 0
        deadline = time.monotonic() + 120
        while ready < ENGINES:
            for kind, idx, payload in drain(out, confirmed, per_engine, time.monotonic() + 0.5):
                assert kind == "ready", f"engine {idx} {kind}: {payload}"
                ready += 1
            assert time.monotonic() < deadline, "engines did not start"
        restarts = []
        # Host memory alone takes half the rounds: the disk variant runs the same storm over it whole.
        for _ in range(ROUNDS if more else max(1, ROUNDS // 2)):
            before = list(per_engine)
            time.sleep(float(rng.uniform(0.3, 0.8)))  # the storm runs
            d.kill()
            # What the engines heard confirmed before the kill reaches the queue within moments.
            for kind, idx, payload in drain(out, confirmed, per_engine, time.monotonic() + 0.2):
                errors.append((kind, idx, payload))
            assert not errors, errors
            assert sum(per_engine) > sum(before), "no Put was confirmed in a round: no storm to kill"
            t0 = time.monotonic()
            d.start()
            restarts.append(time.monotonic() - t0)
            check_all_found(d.address, list(confirmed), rng)
        # Engines carry on after the last restart: new Puts are confirmed by the new daemon.
        last = list(per_engine)
        deadline = time.monotonic() + 30
        while not all(per_engine[i] > last[i] for i in range(ENGINES)):
            assert time.monotonic() < deadline, f"engines stopped storing after the restarts: {per_engine}"
            errors += drain(out, confirmed, per_engine, time.monotonic() + 0.2)
        assert not errors, errors
        check_all_found(d.address, list(confirmed), rng)
        if more:
            disk = next(t for t in d.stats().tiers if t.name == "disk")
            assert disk.kept.adopted_pages > 0 and disk.promoted_pages > 0, disk  # the disk served
    finally:
        stop.set()
        deadline = time.monotonic() + 60
        while len(results) + len(errors) < ENGINES and time.monotonic() < deadline:
            for kind, idx, payload in drain(out, confirmed, per_engine, time.monotonic() + 0.5):
                if kind == "result":
                    results[idx] = payload
                else:
                    errors.append((kind, idx, payload))
        for p in procs:
            p.join(30)
        d.stop()
    assert not errors, errors
    assert len(results) == ENGINES
    for idx, r in results.items():
        assert r["wrong"] == 0, f"engine {idx} loaded wrong bytes: {r}"
        assert r["hit_pages"] > 0 and r["confirmed"] > 0, r
    print(f"{len(restarts)} kills, {len(confirmed)} confirmed pages, all found; restart to socket "
          f"{min(restarts):.2f}-{max(restarts):.2f} s")


def test_stats_and_metrics_say_what_the_start_adopted(socket_dir, kept_dir):
    import socket as so

    from test_api_metrics import scrape, value

    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--host-memory-dir", kept_dir,
                      "--metrics-listen", f"127.0.0.1:{port}", host_memory="256MiB")
    try:
        first = d.stats().kept
        assert first.reason == "no kept cache was found" and first.adopted_pages == 0
        assert first.dir == os.path.realpath(kept_dir)
        keys = [f"m{i:05d}".encode() for i in range(40)]
        with CacheEngine(d.address, pages=64, page_size=PAGE_SIZE) as eng:
            pages = np.arange(40)
            eng.fill(keys, pages)
            assert eng.put(keys, pages).stored == 40
            page_bytes = eng.page_bytes
        d.kill()
        d.start()
        kept = d.stats().kept
        assert (kept.reason, kept.adopted_pages, kept.adopted_bytes) == ("", 40, 40 * page_bytes)
        assert kept.torn_pages == kept.dropped_pages == kept.evicted_pages == 0 and kept.adopt_seconds > 0
        deadline = time.monotonic() + 10
        while True:
            try:
                m = scrape(port)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert value(m, "kvserver_cache_kept") == 1
        assert value(m, "kvserver_cache_adopted_pages") == 40
        assert value(m, "kvserver_cache_adopted_bytes") == 40 * page_bytes
        assert value(m, "kvserver_cache_adopt_torn_pages") == 0
        with CacheEngine(d.address, pages=64, page_size=PAGE_SIZE) as eng:
            eng.wipe()
            assert eng.get(keys, np.arange(40)) == 40 and eng.wrong(keys, np.arange(40)) == []
    finally:
        d.stop()
    plain = DaemonProcess(os.path.join(socket_dir, "kv2.sock"), host_memory="64MiB")
    try:
        assert not plain.stats().HasField("kept")
    finally:
        plain.stop()
