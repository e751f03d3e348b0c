"""A Put whose copy ends after its deadline stores nothing: its engine gave up on it and may have
reused the device pages the copy was still reading, so what it copied may be torn.

The daemon is a real process, stopped (SIGSTOP) in the middle of a Put's copy, while the engine
gives up on the Put (its deadline, then the Unregister that would confirm the copy stopped, which
the stopped daemon cannot answer), is told the pages were not stored, and writes other KV into
those device pages. Once the daemon runs again, the copy ends; before, its pages were committed
and every engine sharing the prefix loaded the torn KV. Every path a Put's copy takes (CASES).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from cache_engine import CacheEngine
from checks import wait_until
from daemon_proc import DaemonProcess

from kvclient import KVClientError

PAGES, PAGE_TOKENS = 256, 1024  # one layer of 2 parts: 512 KiB a page, 128 MiB a Put
TIMEOUT = 0.5  # the engine's calls: the Put's deadline
# (case, the engine's lane, the daemon's environment): where the Put's copy runs.
# (The plane's own Put, into the pages it sets aside, is at most 32 MiB: below, with the expiry word.)
CASES = [
    ("plane copies the loop's", "auto", {}),  # a lane Put the loop stores, the compiled plane copies
    ("copy workers", "grpc", {}),  # a gRPC Put: the copy workers
    ("python lane", "auto", {"KVSERVER_DATA_PLANE": "python"}),  # no compiled plane: the loop, the workers
]


def rss_anon(pid: int) -> int:
    """The daemon's resident anonymous memory: its arena's pages as they are first written (the
    engine's pool is shared memory, which the copy's reads bring in too, and counts elsewhere)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def frozen_mid_put(d: DaemonProcess, eng: CacheEngine, keys: list[bytes]) -> tuple[object, float]:
    """Puts ``keys`` (device pages 0..n-1) and stops the daemon once about a third of the copy is
    in its arena (which the copy is the first to touch: its resident anonymous memory grows with
    it); waits for the engine to give up; then the engine writes other KV into those device pages.
    Returns the Put's result and how much of the copy had landed at the stop."""
    pages = np.arange(len(keys))
    eng.fill(keys, pages)
    size = len(keys) * eng.page_bytes
    base = rss_anon(d.pid)
    out: dict = {}
    put = threading.Thread(target=lambda: out.setdefault("result", eng.put(keys, pages)))
    put.start()
    t0 = time.monotonic()
    while rss_anon(d.pid) - base < size // 3:
        assert put.is_alive() and time.monotonic() - t0 < 30, "the Put ended before the daemon was stopped"
    os.kill(d.pid, signal.SIGSTOP)
    landed = (rss_anon(d.pid) - base) / size
    try:
        put.join(30)  # given up: its deadline, then an Unregister the stopped daemon cannot answer
        assert not put.is_alive()
        for parts in eng.raw:  # the engine reuses the pages it was told were not stored
            for buf in parts:
                buf[:] = 7
    finally:
        os.kill(d.pid, signal.SIGCONT)
    return out["result"], landed


@pytest.mark.parametrize("lane,env", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_put_whose_copy_ends_after_its_deadline_stores_nothing(tmp_path, monkeypatch, lane, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    d = DaemonProcess(str(tmp_path / "d.sock"), host_memory="640MiB")
    try:
        with CacheEngine(d.address, start=0, end=1, pages=PAGES, page_size=PAGE_TOKENS, timeout=TIMEOUT,
                         lane=lane, resilient=True) as eng:
            tries = []
            for attempt in range(3):  # a stop that came too late (this process waited for a core): again
                keys = [f"late{attempt}-{i:05d}".encode() for i in range(PAGES)]
                tries.append(keys)
                result, landed = frozen_mid_put(d, eng, keys)
                if landed < 0.9:
                    break
            assert 0.2 < landed < 0.9, landed
            assert result.stored == 0 and result.dropped == PAGES, result  # the engine was told so
        with CacheEngine(d.address, start=0, end=1, pages=PAGES, page_size=PAGE_TOKENS, lane=lane) as other:
            # The first engine's registration is gone once its copy ended (the daemon ran again).
            wait_until(lambda: len(d.stats().clients) == 1, 10, "the first engine's registration to go")
            assert other.lookup(keys).pages == 0, "a Put its engine gave up on stored its pages"
            assert other.load_checked(keys, np.random.default_rng(0)) == 0
            # Nothing of it is held either: the cache holds the pages of earlier tries that ended in time.
            held = sum(other.lookup(k).pages for k in tries)
            assert d.stats().cache_bytes == held * other.page_bytes, (d.stats().cache_bytes, held)
            # The daemon stores and serves those keys as before.
            other.fill(keys, np.arange(PAGES))
            assert other.put(keys, np.arange(PAGES)).stored == PAGES
            assert other.load_checked(keys, np.random.default_rng(1)) == PAGES
    finally:
        d.kill()


LATE = "copy ended after its timeout_ms"  # kvserver.errors.JobStopped.LATE, the plane's LATE_WRITE
NOT_STARTED = "had stopped waiting for it when the daemon took it"


def late_on_the_lane(eng: CacheEngine, call, attempts: int = 60) -> list[str]:
    """Runs ``call(attempt)`` (a Put or Write on the lane) with its slot's expiry word set a moment
    after it is submitted (a client may write any expiry there), until one is taken before its
    expiry and its copy ends after it: one taken after it is not started, one whose copy ends
    before it is done, and the moment is moved for the next try. Returns each try's outcome: the
    status message, or "done"; the last one is the late end."""
    lane, outcomes, after = eng.client.lane, [], 1_000_000
    real = lane._expires
    for attempt in range(attempts):
        lane._expires = lambda deadline, after=after: time.monotonic_ns() + after
        try:
            call(attempt)
            outcomes.append("done")
            after = max(50_000, after * 2 // 3)
        except KVClientError as exc:
            outcomes.append(exc.message)
            if LATE in exc.message:
                return outcomes
            assert NOT_STARTED in exc.message, exc.message
            after = after * 3 // 2
        finally:
            lane._expires = real
    raise AssertionError(f"no try ended late: {outcomes}")


def test_the_planes_own_put_and_write_ending_after_their_expiry_keep_nothing(daemon_factory):
    """The compiled data plane's own Put (into the pages it set aside, try_put) and Write, each
    taken before its lane call's expiry word and copied past it: answered DEADLINE_EXCEEDED, the
    copy ended late; the Put files no key and gives its pages back, the Write leaves no page busy;
    the same calls in time then store and write as before."""
    d = daemon_factory()
    plane = d.core.copier.plane
    if plane is None:
        pytest.skip("the compiled data plane is not built here")
    n = 32  # 16 MiB a call: what the plane sets aside for a Put of this page size at most
    with CacheEngine(d.address, start=0, end=1, pages=64, page_size=PAGE_TOKENS, host_tokens=n * PAGE_TOKENS,
                     lane="auto") as eng:
        first = [f"first-{i:04d}".encode() for i in range(2)]
        eng.fill(first, np.arange(2))
        assert eng.put(first, np.arange(2)).stored == 2  # a registration's first Put is the loop's
        gate = d.run(lambda: next(c.gate for c in d.core.clients.values()))
        wait_until(lambda: gate.stashed >= n, 10, "the pages set aside for the plane's Puts")

        def put(attempt: int) -> None:
            keys = [f"late-{attempt:03d}-{i:03d}".encode() for i in range(n)]
            eng.fill(keys, np.arange(2, 2 + n))
            stores = plane.plane_stores
            try:
                eng.put(keys, np.arange(2, 2 + n))
            except KVClientError:
                assert plane.plane_stores == stores and eng.lookup(keys).pages == 0
                wait_until(lambda: gate.stashed >= n, 10, "the late Put's pages to come back")
                raise
            assert plane.plane_stores == stores + 1, "not the plane's own Put"
            wait_until(lambda: gate.stashed >= n, 10, "the pages set aside to be made again")

        late_on_the_lane(eng, put)
        keys = [f"again-{i:04d}".encode() for i in range(n)]
        eng.fill(keys, np.arange(2, 2 + n))
        assert eng.put(keys, np.arange(2, 2 + n)).stored == n
        assert eng.load_checked(first + keys, np.random.default_rng(2)) == n + 2

        host = eng.client.alloc(n * PAGE_TOKENS)
        dev = np.arange(n * PAGE_TOKENS)
        late_on_the_lane(eng, lambda _: eng.client.write(host_indices=host, device_indices=dev))
        assert eng.client.free(host) == n * PAGE_TOKENS  # no page left busy
        host = eng.client.alloc(n * PAGE_TOKENS)
        assert eng.client.write(host_indices=host, device_indices=dev) > 0
