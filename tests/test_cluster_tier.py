"""The cluster tier (--cluster-master): a real Mooncake Store master and two real daemons on
loopback, engines over shared memory on each. A prefix one node stores is a bit-exact hit on the
other; local pages always win; a space (tenant, model, weights) never sees another's pages; a dead
master or a dead node costs misses within the deadline, never a stall, and the nodes re-join."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from cache_engine import CacheEngine
from daemon_proc import DaemonProcess
from mooncake_master import MooncakeMaster, free_port, needs_mooncake

from kvserver.lane import plane

PAGE_BYTES = 32 * 1024  # CacheEngine's pages


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i:05d}".encode() for i in range(n)]


def cluster_stat(d: DaemonProcess):
    return next(t for t in d.stats().tiers if t.name == "cluster")


# A join takes about a second here (Mooncake's setup, a probe first); a loaded CI machine once
# took more than 20 s, so a test waits longer than that before it calls the join lost.
JOIN_WAIT = 60


def wait_joined(d: DaemonProcess) -> None:
    d.wait_for(lambda s: any(t.name == "cluster" and t.joined for t in s.tiers), JOIN_WAIT)


def node(tmp_path, name: str, master: MooncakeMaster, *extra: str) -> DaemonProcess:
    d = DaemonProcess(str(tmp_path / f"{name}.sock"), "--cluster-master", master.address,
                      "--cluster-timeout-ms", "1000", *extra, host_memory="256MiB")
    wait_joined(d)
    return d


def store(eng: CacheEngine, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 100):
        chunk = keys[i : i + 100]
        pages = np.arange(len(chunk))
        eng.fill(chunk, pages)
        r = eng.put(chunk, pages)
        assert r.stored + r.present == len(chunk)


def published(d: DaemonProcess, n: int, timeout: float = 20) -> None:
    d.wait_for(lambda s: next(t for t in s.tiers if t.name == "cluster").written_pages
               + next(t for t in s.tiers if t.name == "cluster").present_pages >= n, timeout)


@pytest.fixture
def master(tmp_path):
    needs_mooncake()
    m = MooncakeMaster()
    yield m
    m.kill()


@pytest.fixture
def nodes(tmp_path, master):
    made = [node(tmp_path, "a", master)]
    made.append(node(tmp_path, "b", master, "--metrics-listen", f"127.0.0.1:{free_port()}"))
    yield made
    for d in made:
        d.kill()


def test_a_prefix_stored_on_one_node_is_a_bit_exact_hit_on_the_other(nodes):
    a, b = nodes
    rng = np.random.default_rng(1)
    keys = keys_of("shared", 300)
    with CacheEngine(a.address, pages=400) as ea, CacheEngine(b.address, pages=400) as eb:
        store(ea, keys)
        published(a, 300)
        assert cluster_stat(a).written_bytes == 300 * PAGE_BYTES
        # B stored the first 100 itself: they are its own hit, the cluster gives the rest.
        store(eb, keys[:100])
        before = b.stats().spaces[0].counters
        found = eb.lookup(keys)
        assert (found.pages, found.cluster_pages, found.host_pages) == (300, 200, 100)
        # The space counts what its Lookups found, wherever (the cluster's 200 were misses), and a
        # Get's pull is no Put (the 100 it found stored were counted as a Put's dedup).
        after = b.stats().spaces[0].counters
        assert (after.hits - before.hits, after.misses - before.misses) == (300, 0), after
        host = next(t for t in b.stats().tiers if t.name == "host")
        assert host.hits == after.hits - 200  # the cluster's 200 are its tier's, not host memory's
        assert eb.load_checked(keys, rng) == 300
        after = b.stats().spaces[0].counters
        assert (after.dedup_pages, after.dropped) == (before.dedup_pages, before.dropped), after
        c = cluster_stat(b)
        assert c.promoted_pages == 200 and c.promoted_bytes == 200 * PAGE_BYTES, c
        assert c.read_errors == 0 and c.hits == 200
        # B's host memory holds them now: the cluster is not asked again. B's data plane serves
        # such a Get whole; the one that pulled from the cluster was its event loop's.
        found = eb.lookup(keys)
        assert (found.pages, found.cluster_pages) == (300, 0)
        assert cluster_stat(b).hits == 200
        lane = eb.client.lane
        assert lane.gets_on_plane == 0
        assert eb.load_checked(keys, rng) == 300
        assert lane.gets_on_plane == (1 if plane.available() and plane.GETS else 0)
        assert cluster_stat(b).hits == 200
        # B stored its 100 first: the cluster had them (first writer wins, no second copy).
        published(b, 100)
        assert cluster_stat(b).written_pages == 0 and cluster_stat(b).present_pages == 100
    from test_api_metrics import scrape, value

    c = cluster_stat(b)
    m = scrape(int(b.args[b.args.index("--metrics-listen") + 1].rsplit(":", 1)[1]))
    assert value(m, "kvserver_cluster_pulled_pages_total") == c.promoted_pages == 200
    assert value(m, "kvserver_cluster_pulled_bytes_total") == 200 * PAGE_BYTES
    assert value(m, "kvserver_cluster_present_pages_total") == 100
    assert value(m, "kvserver_tier_hits_total", tier="cluster") == c.hits == 200
    assert value(m, "kvserver_tier_capacity_bytes", tier="cluster") == 64 << 20  # 25% of 256 MiB
    assert value(m, "kvserver_cluster_available") == 1
    for sample in ("published_pages", "skipped_pages", "put_errors", "get_errors", "breaker_trips",
                   "timeouts", "busy", "quarantined_pages"):
        assert value(m, f"kvserver_cluster_{sample}_total") == 0, sample


def test_the_cluster_tells_spaces_apart(nodes):
    a, b = nodes
    keys = keys_of("space", 50)
    with CacheEngine(a.address, pages=64, weights="sha256:aaaa") as ea:
        store(ea, keys)
        published(a, 50)
    with CacheEngine(b.address, pages=64, weights="sha256:bbbb") as other, \
            CacheEngine(b.address, pages=64, model="another-model", weights="sha256:aaaa") as model, \
            CacheEngine(b.address, pages=64, start=0, end=2, num_layers=4, pp_size=2,
                        weights="sha256:aaaa") as stage:
        assert other.lookup(keys).pages == 0  # other weights
        assert model.lookup(keys).pages == 0  # another model
        assert stage.lookup(keys).pages == 0  # another part (a PP stage's layers)
    with CacheEngine(b.address, pages=64, weights="sha256:aaaa") as same:
        assert same.lookup(keys).cluster_pages == 50


def test_a_dead_master_costs_misses_within_the_deadline_and_the_nodes_rejoin(nodes, master):
    a, b = nodes
    rng = np.random.default_rng(2)
    mine, theirs = keys_of("mine", 100), keys_of("theirs", 100)
    with CacheEngine(a.address, pages=128) as ea, CacheEngine(b.address, pages=128) as eb:
        store(ea, theirs)
        published(a, 100)
        store(eb, mine)
        master.kill()
        worst = 0.0
        for _ in range(5):
            t0 = time.monotonic()
            found = eb.lookup(theirs)
            worst = max(worst, time.monotonic() - t0)
            assert found.pages == 0
        assert eb.lookup(mine).pages == 100  # local hits are served throughout
        t0 = time.monotonic()
        n = eb.load_checked(theirs, rng)
        worst = max(worst, time.monotonic() - t0)
        assert n == 0
        assert worst < 1.5, f"a call waited {worst:.2f} s on a dead master"
        assert eb.load_checked(mine, rng) == 100
        # The loop answers small calls at once meanwhile.
        lag = max(_timed(lambda: b.stats()) for _ in range(20))
        assert lag < 0.25, f"Stats took {lag:.3f} s with the master down"
        c = cluster_stat(b)
        assert not c.available and c.breaker_trips >= 1
        # Pages stored while the master is down are not queued for seconds: skipped.
        store(ea, keys_of("down", 50))
        a.wait_for(lambda s: next(t for t in s.tiers if t.name == "cluster").skipped_pages
                   + next(t for t in s.tiers if t.name == "cluster").write_errors >= 50, 15)
        # The master comes back (empty: it forgot every object); both nodes answer again.
        master.restart()
        for d in (a, b):
            d.wait_for(lambda s: next(t for t in s.tiers if t.name == "cluster").available, 30)
        tries: list[list[bytes]] = []
        _until(lambda: _stored_anew(ea, a, tries), 30)
        again = tries[-1]
        assert eb.lookup(again).cluster_pages == 60
        assert eb.load_checked(again, rng) == 60


def test_a_hung_master_costs_misses_within_the_deadline_never_a_stall(nodes, master):
    a, b = nodes
    rng = np.random.default_rng(5)
    theirs = keys_of("hung", 50)
    with CacheEngine(a.address, pages=64) as ea, CacheEngine(b.address, pages=64) as eb:
        store(ea, theirs)
        published(a, 50)
        os.kill(master.proc.pid, signal.SIGSTOP)  # it answers nothing: Mooncake's calls wait 30 s
        try:
            t0 = time.monotonic()
            assert eb.lookup(theirs).pages == 0
            assert time.monotonic() - t0 < 1.5
            t0 = time.monotonic()
            assert eb.load_checked(theirs, rng) == 0
            assert time.monotonic() - t0 < 1.5
            store(ea, keys_of("meanwhile", 20))  # puts go on locally
            assert ea.lookup(keys_of("meanwhile", 20)).pages == 20
            lag = max(_timed(lambda: b.stats()) for _ in range(20))
            assert lag < 0.25, f"Stats took {lag:.3f} s with the master hung"
            c = cluster_stat(b)
            assert c.timeouts >= 1 and c.breaker_trips >= 1 and not c.available
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        b.wait_for(lambda s: next(t for t in s.tiers if t.name == "cluster").available, 60)
        assert eb.lookup(theirs).cluster_pages == 50
        assert eb.load_checked(theirs, rng) == 50


def test_lookups_shorter_than_the_tiers_timeout_answer_their_local_hit_and_open_the_breaker(nodes, master):
    """A hung master and Lookups whose timeout_ms is below --cluster-timeout-ms (vLLM's scheduler
    sends at most 980 ms against the tier's 1000): each answers its local hit within its own
    timeout, not DEADLINE_EXCEEDED, and the questions left hanging still open the breaker at the
    tier's timeout, after which Lookups answer at once."""
    _, b = nodes
    mine, rest = keys_of("mine", 20), keys_of("rest", 20)
    with CacheEngine(b.address, pages=64) as eb:
        store(eb, mine)
        published(b, 20)
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                t0 = time.monotonic()
                assert eb.lookup(mine + rest, timeout=0.9).pages == 20
                assert time.monotonic() - t0 < 0.9
            _until(lambda: cluster_stat(b).breaker_trips >= 1, 5)
            t0 = time.monotonic()
            assert eb.lookup(mine + rest, timeout=0.9).pages == 20
            assert time.monotonic() - t0 < 0.2
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)


_REFUSE_ONE_REGISTRATION = """
from mooncake.store import MooncakeDistributedStore as _Store

_register, _refused = _Store.register_buffer, []


def _register_once_refused(self, address, nbytes):
    if not _refused:  # as RDMA refuses memory past RLIMIT_MEMLOCK: the rest of the join is real
        _refused.append(1)
        return -1
    return _register(self, address, nbytes)


_Store.register_buffer = _register_once_refused
"""


def test_a_join_whose_registration_is_refused_tries_again_without_holding_the_loop(tmp_path, master,
                                                                                  monkeypatch):
    """The store refuses to register the host arena once (the master answered, setup worked): the
    half-joined client is kept and its registration tried again, never closed on the daemon's
    behalf (Mooncake's close holds the interpreter's lock for seconds: every retry held the loop
    that long), and the daemon answers small calls at once all the while."""
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(_REFUSE_ONE_REGISTRATION)
    paths = [str(patch), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    d = DaemonProcess(str(tmp_path / "refused.sock"), "--cluster-master", master.address,
                      host_memory="128MiB")
    try:
        slowest, deadline = 0.0, time.monotonic() + 30
        while True:
            t0 = time.monotonic()
            joined = cluster_stat(d).joined
            slowest = max(slowest, time.monotonic() - t0)
            if joined:
                break
            assert time.monotonic() < deadline, "the tier never joined"
            time.sleep(0.02)
        assert slowest < 0.5, f"a Stats call took {slowest:.2f} s while the tier joined"
        with CacheEngine(d.address, pages=16) as eng:
            store(eng, keys_of("joined", 10))
            published(d, 10)
    finally:
        d.kill()


def test_a_half_joined_client_leaves_the_cluster_with_the_daemon(daemon_factory, master, monkeypatch):
    """The store refuses every registration of host memory: the client set up for it is kept for
    the next try, and the daemon's stop closes it (it leaves the cluster), not left to the exit."""
    from mooncake.store import MooncakeDistributedStore

    closed: list[int] = []
    close = MooncakeDistributedStore.close
    monkeypatch.setattr(MooncakeDistributedStore, "register_buffer", lambda self, address, nbytes: -1)
    monkeypatch.setattr(MooncakeDistributedStore, "close", lambda self: (closed.append(1), close(self))[1])
    d = daemon_factory(cluster_master=master.address, cluster_segment=64 << 20, host_memory=128 << 20)
    client = d.core.cluster.client
    deadline = time.monotonic() + 20
    while not client.half_open:
        assert time.monotonic() < deadline, "no join was tried"
        time.sleep(0.05)
    assert not d.core.cluster.joined and closed == []  # kept, not closed on the way
    d.stop()
    assert closed == [1] and not client.half_open


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_daemon_stops_within_its_grace_while_its_master_hangs(tmp_path, master, in_flight):
    """SIGTERM while the master answers nothing (Mooncake's calls wait 30 s, its leaving twice
    that), with or without a Put's publish in flight: the daemon ends within its grace, not after
    a minute and a half (past systemd's and Kubernetes' stop timeouts, into a SIGKILL)."""
    d = node(tmp_path, "stop", master, "--shutdown-grace", "2")
    try:
        with CacheEngine(d.address, pages=128) as eng:
            store(eng, keys_of("before", 100))
            published(d, 100)
            os.kill(master.proc.pid, signal.SIGSTOP)
            if in_flight:
                store(eng, keys_of("during", 100))  # published while the master hangs
                time.sleep(0.3)
        t0 = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - t0 < 2 + 3, time.monotonic() - t0
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
        if d.proc.poll() is None:
            d.kill()


def test_a_stalled_peer_costs_a_get_its_cluster_pages_not_its_local_hit(nodes):
    """A peer that stops answering mid-way (SIGSTOP: its sockets accept, nothing comes back) while
    the master answers: the Get loads its local prefix within the cluster's deadline, its pulled
    pages stay being written until the transfer ends, and the breaker stays closed (a slow peer
    is not a dead store)."""
    a, b = nodes
    rng = np.random.default_rng(7)
    keys = keys_of("stalled", 150)
    with CacheEngine(a.address, pages=160) as ea, CacheEngine(b.address, pages=160) as eb:
        store(ea, keys[50:])
        published(a, 100)
        store(eb, keys[:50])
        assert eb.lookup(keys).cluster_pages == 100
        os.kill(a.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            n = eb.load_checked(keys, rng)
            took = time.monotonic() - t0
            assert n == 50 and took < 2.0, (n, took)  # the local hit, within the deadline
            lag = max(_timed(lambda: b.stats()) for _ in range(20))
            assert lag < 0.25, f"Stats took {lag:.3f} s with a peer stalled"
            c = cluster_stat(b)
            assert c.timeouts >= 1 and c.breaker_trips == 0 and c.available
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # The transfer ends once the peer answers: then the pages count (or were never used).
        _until(lambda: eb.load_checked(keys, rng) == 150, 30)


def test_a_peer_that_stalls_then_dies_takes_a_bounded_share_and_leaves_its_keys_storable(tmp_path, master):
    """A Get pulls from a peer that stalls (SIGSTOP) and then dies: the pull takes at most a
    quarter of host memory (pulls under way and failed ones together), so most of the node's own
    cache stays; its pages, out of use while the dead transfer might still land, are out of their
    part at once, so the node's engine stores those keys again at once, not after minutes."""
    a = node(tmp_path, "a", master, "--cluster-segment", "160MiB")  # room for both nodes' pages
    b = DaemonProcess(str(tmp_path / "b.sock"), "--cluster-master", master.address,
                      "--cluster-timeout-ms", "1000", "--cluster-segment", "160MiB", host_memory="64MiB")
    try:
        wait_joined(b)
        theirs, mine = keys_of("theirs", 1000), keys_of("mine", 1500)  # 31 and 47 MiB of pages
        with CacheEngine(a.address, pages=256) as ea:
            for i in range(0, len(theirs), 200):
                store(ea, theirs[i : i + 200])
            published(a, 1000, timeout=30)
        with CacheEngine(b.address, pages=1100, timeout=3.0) as eb:
            for i in range(0, len(mine), 200):
                store(eb, mine[i : i + 200])
            assert eb.lookup(mine, memory_only=True).pages == 1500
            assert eb.lookup(theirs).cluster_pages == 1000
            os.kill(a.pid, signal.SIGSTOP)
            assert eb.get(theirs, np.arange(1000)) == 0  # nothing came within the deadline
            quarter = (64 << 20) // 4 // PAGE_BYTES
            assert eb.lookup(mine, memory_only=True).pages >= 1500 - quarter - 8
            time.sleep(1.5)
            a.kill()  # its transfers fail now, after Mooncake stopped waiting on them
            _until(lambda: cluster_stat(b).quarantined_pages > 0, 30)
            assert cluster_stat(b).quarantined_pages <= quarter
            rng = np.random.default_rng(11)
            chunk = theirs[:50]
            eb.fill(chunk, np.arange(50))
            t0 = time.monotonic()
            r = eb.put(chunk, np.arange(50))
            assert (r.stored, r.dropped) == (50, 0) and time.monotonic() - t0 < 1.0, r
            assert eb.lookup(chunk, memory_only=True).pages == 50
            assert eb.load_checked(chunk, rng) == 50
    finally:
        for d in (a, b):
            d.kill()


def test_a_dead_node_s_pages_are_misses_within_the_deadline(nodes):
    a, b = nodes
    rng = np.random.default_rng(3)
    keys = keys_of("gone", 100)
    with CacheEngine(b.address, pages=128) as eb:
        with CacheEngine(a.address, pages=128) as ea:
            store(ea, keys)
            published(a, 100)
        a.kill()
        for _ in range(3):  # until the master's client TTL, it still lists the dead node's pages
            t0 = time.monotonic()
            n = eb.load_checked(keys, rng)
            took = time.monotonic() - t0
            assert n == 0 and took < 0.5, (n, took)  # a miss at once: it waits on no page of a pull
        c = cluster_stat(b)
        assert c.read_errors >= 1 or c.timeouts >= 1
        # A dead peer's transfers fail at once (its sockets refuse): none was left running that
        # could land later, so their pages are free at once, not kept out of use for minutes
        # (which evicted the node's own pages and dropped its Puts of those keys).
        assert c.quarantined_pages == 0
        store(eb, keys)  # the engine computes the prefix again and stores it here
        assert eb.lookup(keys, memory_only=True).pages == 100
        assert cluster_stat(b).available  # a dead peer is not a dead store
        store(eb, keys_of("alive", 10))
        assert eb.lookup(keys_of("alive", 10)).pages == 10


def test_a_daemon_started_before_its_master_serves_at_once_and_joins_when_it_comes(tmp_path):
    needs_mooncake()
    ports = (free_port(), free_port(), free_port())
    d = DaemonProcess(str(tmp_path / "early.sock"), "--cluster-master", f"127.0.0.1:{ports[0]}",
                      host_memory="128MiB")
    master = None
    try:
        with CacheEngine(d.address, pages=32) as eng:
            keys = keys_of("early", 20)
            store(eng, keys)  # the node serves its own cache meanwhile
            assert eng.lookup(keys).pages == 20
            # Mooncake's join retries an absent master for minutes holding the interpreter's lock:
            # the daemon's loop answers small calls at once all the while.
            lag = max(_timed(lambda: d.stats()) for _ in range(30))
            assert lag < 0.25, f"Stats took {lag:.3f} s while the master was absent"
            assert not cluster_stat(d).joined
            master = MooncakeMaster(ports=ports)
            d.wait_for(lambda s: any(t.name == "cluster" and t.available for t in s.tiers), 20)
            more = keys_of("later", 20)
            store(eng, more)
            published(d, 20)
        t0 = time.monotonic()
        assert d.stop() == 0 and time.monotonic() - t0 < 8
    finally:
        if d.proc.poll() is None:
            d.kill()
        if master is not None:
            master.kill()


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def _until(pred, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def _stored_anew(eng: CacheEngine, d: DaemonProcess, tries: list[list[bytes]]) -> bool:
    """Stores 60 new keys (a restarted master forgot everything, and its first puts may fail);
    whether the cluster took all of them."""
    before = cluster_stat(d).written_pages
    tries.append(keys_of(f"again{len(tries)}", 60))
    store(eng, tries[-1])
    deadline = time.monotonic() + 3
    while cluster_stat(d).written_pages - before < 60:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_join_probe_dies_with_its_daemon(tmp_path, master):
    """A daemon whose master hangs from the start probes it in a child process; stopped meanwhile,
    it leaves no child behind retrying the master."""

    def probes() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"MooncakeDistributedStore" in cmd and master.address.encode() in cmd:
                found.append(int(pid))
        return found

    os.kill(master.proc.pid, signal.SIGSTOP)
    d = DaemonProcess(str(tmp_path / "probe.sock"), "--cluster-master", master.address, host_memory="64MiB")
    try:
        _until(lambda: bool(probes()), 10)
        assert d.stop() == 0
        _until(lambda: not probes(), 5)
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
        for pid in probes():
            os.kill(pid, signal.SIGKILL)
        if d.proc.poll() is None:
            d.kill()
