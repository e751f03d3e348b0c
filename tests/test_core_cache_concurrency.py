"""Eight engine processes Put and Get overlapping prefixes of the same documents through one daemon
for a bounded time, under a budget the cache must keep evicting to stay inside: every page a Get
loads holds the bytes its key names, a pinned prefix is never cut short, the cache never holds more
than the budget, and once the engines are gone the daemon holds none of their descriptors or maps."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import secrets
import time

import pytest
from cache_engine import PAGE, churn_worker
from daemon_proc import DaemonProcess

SECONDS = float(os.environ.get("KVSERVER_CACHE_CHURN_SECONDS", "8"))
PROCS = 8
DOCS, DOC_PAGES = 6, 32
PAGE_BYTES = PAGE * 256 * 2 * 4


@pytest.fixture(scope="module")
def forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["cache_engine"])
    return ctx


def chain(doc: int) -> list[bytes]:
    keys, prev = [], f"doc{doc}".encode()
    for i in range(DOC_PAGES):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
    return keys


def test_eight_engines_share_and_churn_the_cache(forkserver, tmp_path) -> None:
    # 8 regions of 2 MiB and room for 3 slabs of 8 MiB: far less than what the engines Put.
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="44MiB")
    try:
        d.stats()  # this test's own connection, open before the baseline
        fds0, maps0 = d.num_fds(), d.shm_maps()
        docs = [chain(i) for i in range(DOCS)]
        out = forkserver.Queue()
        run = secrets.token_hex(3)
        names = [f"kvchurn-{run}-{i}" for i in range(PROCS)]
        procs = [forkserver.Process(target=churn_worker, args=(d.address, n, 100 + i, SECONDS, docs, out))
                 for i, n in enumerate(names)]
        for p in procs:
            p.start()
        reports, started = {}, set()
        most_cache = 0
        deadline = time.monotonic() + SECONDS + 90
        while len(reports) < PROCS:
            try:
                kind, name, payload = out.get(timeout=0.2)
            except queue.Empty:
                assert time.monotonic() < deadline, f"engines did not report in time: {sorted(reports)}"
                dead = [p.pid for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"engine processes {dead} died"
            else:
                if kind == "started":
                    started.add(name)
                else:
                    reports[name] = payload
            stats = d.stats()
            most_cache = max(most_cache, stats.cache_bytes)
            # reserved_bytes counts the regions and the cache's slabs.
            assert stats.cache_bytes <= stats.reserved_bytes <= stats.capacity_bytes, stats
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0] * PROCS

        for name, r in reports.items():
            assert not r["errors"], f"{name}: {r['errors'][0]}"
            assert r["puts"] >= 10 and r["gets"] >= 10, r
            assert r["corrupt"] == 0, f"{name}: {r['corrupt']} of {r['pages_checked']} pages corrupt"
            assert r["short_pinned"] == 0, f"{name}: a Get returned fewer pages than its pin held"
            assert r["bad_counts"] == 0 and r["untouched_violations"] == 0, r
        assert sum(r["pages_checked"] for r in reports.values()) > 1000
        assert sum(r["pinned_gets"] for r in reports.values()) > 0

        stats = d.stats()
        (space,) = stats.spaces
        c = space.counters
        assert c.evictions > 0, "the budget never made the cache evict"
        assert c.dedup_pages > 0 and c.hits > 0
        assert c.bytes == c.pages * PAGE_BYTES and stats.cache_bytes >= c.bytes
        assert most_cache <= stats.capacity_bytes
        # The engines are gone; their pages are not, but nothing else of theirs is left.
        d.wait_for(lambda s: s.num_clients == 0 and s.reserved_bytes == s.cache_bytes, timeout=10)
        deadline = time.monotonic() + 10
        while (d.num_fds(), d.shm_maps()) != (fds0, maps0):
            assert time.monotonic() < deadline, (d.num_fds(), fds0, d.shm_maps(), maps0)
            time.sleep(0.05)
    finally:
        d.stop()
