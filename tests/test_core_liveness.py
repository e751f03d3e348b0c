"""A dead engine's memory comes back: sessions, reclaim grace, leases, and a kill loop."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time

import pytest
from daemon_proc import DaemonProcess
from light_engine import LightEngine, killed_mid_load, registered_without_session

from kvserver.protocol.shared_memory import SHM_DIR
from kvserver.v1 import kvserver_pb2 as pb

KILL_LOOPS = 30


@pytest.fixture(scope="module")
def forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["light_engine"])
    return ctx


def start_killable(ctx, address: str, name: str, target=killed_mid_load):
    """An engine process running ``target``; returns once it says it is ready, with what it said."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(address, name, child))
    proc.start()
    assert parent.poll(30), "the engine never got ready"
    return proc, parent.recv()


def kill_and_await_reclaim(d: DaemonProcess, proc, name: str) -> None:
    """SIGKILLs the engine; the daemon holds nothing of it (no client, no region, no page in use, no
    mapping of its pool) within 2 s."""
    os.kill(proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    proc.join(10)
    d.wait_for(lambda s: s.num_clients == 0 and s.reserved_bytes == 0 and s.used_bytes == 0, timeout=10)
    elapsed = time.monotonic() - t_kill
    assert elapsed < 2.0, f"reclaimed after {elapsed:.2f} s"
    assert not [m for m in d.shm_maps() if name in m], "the dead engine's pool is still mapped"


def test_killed_engine_is_reclaimed_within_two_seconds(socket_dir, forkserver):
    """Default settings: SIGKILL mid-load, and the daemon holds nothing of it 2 s later."""
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--progress-interval-ms", "0")
    name = f"kvtest-kill-{secrets.token_hex(4)}"
    try:
        proc, said = start_killable(forkserver, d.address, name)
        assert said == b"loading"
        assert d.stats().num_clients == 1 and d.stats().clients[0].sessions == 1
        assert f"/memfd:{name} (deleted)" in d.shm_maps()
        kill_and_await_reclaim(d, proc, name)
        assert d.stats().reclaimed_clients == 1
        assert name not in os.listdir(SHM_DIR)  # a memfd: it went with its last holder
    finally:
        assert d.stop() == 0


def test_kill_mid_load_loop_releases_everything(socket_dir, forkserver):
    """SIGKILL an engine mid-load, over and over: accounting, mappings, fds and RSS stay flat."""
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"), "--progress-interval-ms", "0",
                      "--reclaim-grace-seconds", "0.2")
    try:
        base_fds = None
        rss = []
        mid_load = 0
        for i in range(KILL_LOOPS):
            name = f"kvtest-loop-{i}-{secrets.token_hex(4)}"
            loads_before = d.stats().transfers.load_ops
            proc, _ = start_killable(forkserver, d.address, name)
            kill_and_await_reclaim(d, proc, name)
            assert d.shm_maps() == [], f"iteration {i}: mappings left: {d.shm_maps()}"
            mid_load += d.stats().transfers.load_ops == loads_before  # the load never finished
            if i == 4:
                base_fds = d.num_fds()
            if i >= 4:
                assert d.num_fds() == base_fds, f"iteration {i}: fds {d.num_fds()} vs {base_fds}"
                rss.append(d.rss())
        assert d.stats().reclaimed_clients == KILL_LOOPS
        # Killed while the load was streaming: kills land before the last layer often enough that the
        # loop covers it (alone about two in three do; with other tests on two cores a fifth do).
        assert mid_load >= 3, f"only {mid_load} of {KILL_LOOPS} kills landed mid-load"
        growth = max(rss[-10:]) - min(rss[:10])
        assert growth < 32 << 20, f"daemon RSS grew by {growth >> 20} MiB over {KILL_LOOPS} kills"
    finally:
        assert d.stop() == 0


def test_client_without_session_lives_for_its_lease(daemon_factory):
    d = daemon_factory(lease=0.5)
    name = f"kvtest-lease-{secrets.token_hex(4)}"
    eng = LightEngine(d.address, name, session=False)
    try:
        for _ in range(4):  # calls renew the lease
            time.sleep(0.3)
            eng.alloc(16)
        assert d.run(lambda: len(d.core.clients)) == 1
        time.sleep(0.9)
        assert d.run(lambda: len(d.core.clients)) == 0
        assert d.run(lambda: d.core.reclaimed) == 1
    finally:
        eng.drop()


def test_an_engine_killed_before_its_session_is_reclaimed_within_two_seconds(socket_dir, forkserver):
    """An engine killed between its Register and its Session kept its registration (its region,
    its mapping of the pool) for the whole lease (30 s by default). Its ticket's pidfd now stays
    with the registration, and its process's exit counts as a Session's end."""
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    name = f"kvtest-nosession-{secrets.token_hex(4)}"
    try:
        proc, _ = start_killable(forkserver, d.address, name, registered_without_session)
        assert d.stats().num_clients == 1 and d.stats().clients[0].sessions == 0
        kill_and_await_reclaim(d, proc, name)
    finally:
        assert d.stop() == 0


def test_a_registration_without_session_whose_process_lives_keeps_its_lease(daemon_factory):
    """The process's exit ends it, not the Session's absence: a live process without a Session
    keeps its registration for its lease, as before."""
    d = daemon_factory(lease=30, reclaim_grace=0.2)
    eng = LightEngine(d.address, f"kvtest-alive-{secrets.token_hex(4)}", session=False)
    try:
        time.sleep(0.6)
        assert d.run(lambda: len(d.core.clients)) == 1
    finally:
        eng.drop()


def test_new_session_within_grace_keeps_the_registration(daemon_factory):
    d = daemon_factory(reclaim_grace=0.5)
    name = f"kvtest-grace-{secrets.token_hex(4)}"
    eng = LightEngine(d.address, name)
    try:
        host = eng.alloc(64)
        eng.session.cancel()  # the connection blips
        time.sleep(0.2)
        eng.session = eng.stub.Session(pb.SessionRequest(client_id=eng.client_id))
        next(eng.session)
        time.sleep(0.8)  # past the grace period of the first session
        assert d.run(lambda: len(d.core.clients)) == 1
        assert eng.free(host) == 64
        eng.session.cancel()
        time.sleep(0.8)
        assert d.run(lambda: len(d.core.clients)) == 0
    finally:
        eng.drop()


def test_unregister_ends_the_session(daemon):
    name = f"kvtest-unreg-{secrets.token_hex(4)}"
    eng = LightEngine(daemon.address, name)
    eng.stub.Unregister(pb.UnregisterRequest(client_id=eng.client_id), timeout=10)
    assert list(eng.session) == []  # the daemon closed the stream cleanly
    eng.drop()


def test_a_killed_engines_pinning_leases_end_with_its_reclaim(daemon):
    """A pinning Lookup's lease was the tenant's only: a killed engine's pins stayed until their
    pin_ms ran out (up to 60 s), keeping its pages from eviction and the arena from a new region,
    well past the reclaim of everything else. A lease now ends with the registration that took it."""
    import numpy as np
    from cache_engine import put_pin_and_hang

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tokens = np.random.default_rng(0).integers(0, 50000, 8 * 16)
    proc = ctx.Process(target=put_pin_and_hang, args=(daemon.address, tokens, out), daemon=True)
    proc.start()
    try:
        kind, payload = out.get(timeout=60)
        assert kind == "pinned" and payload == (8, True), payload
        assert daemon.run(lambda: len(daemon.core.cache.leases.leases)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        deadline = t_kill + 10
        while daemon.run(lambda: (len(daemon.core.clients), len(daemon.core.cache.leases.leases),
                                  int((daemon.core.cache.pages.pins > 0).sum()))) != (0, 0, 0):
            assert time.monotonic() < deadline, "the dead engine's pins outlived its reclaim"
            time.sleep(0.02)
        elapsed = time.monotonic() - t_kill
        assert elapsed < 2.0, f"its pins ended {elapsed:.2f} s after the kill"
    finally:
        proc.kill()
        proc.join(10)


def test_a_registrations_pidfd_past_1024_is_watched_and_a_bad_client_stops_no_others_reclaim(daemon_factory,
                                                                                             caplog):
    """The registering process's exit was read with select(), which refuses descriptors past
    1024: on a daemon holding many peers' descriptors every reaper pass then failed, and neither
    that client nor any after it was ever reclaimed. Now poll() reads it, and a client whose check
    fails holds up no other's reclaim."""
    import resource

    from kvserver.peers.tickets import process_exited

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip("descriptors past 1024 cannot be opened here")
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    low = os.pidfd_open(child)
    high = os.dup2(low, 1500)
    try:
        assert not process_exited(high)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        assert process_exited(high)
    finally:
        os.close(low)
        os.close(high)
    d = daemon_factory(lease=0.3, reclaim_grace=0.1)
    engines = [LightEngine(d.address, f"kvtest-reap-{i}-{secrets.token_hex(4)}", session=False)
               for i in range(2)]
    try:
        first = next(iter(d.run(lambda: list(d.core.clients.values()))))
        d.run(lambda: setattr(first, "pidfd", "not a descriptor"))  # its check raises
        deadline = time.monotonic() + 5
        while d.run(lambda: len(d.core.clients)) > 1:
            assert time.monotonic() < deadline, "one client's failed check held up the other's reclaim"
            time.sleep(0.02)
        time.sleep(0.3)  # more passes of the reaper: its failure is logged once, not at each
        failed = [r for r in caplog.records if "deciding whether client" in r.getMessage()]
        assert len(failed) == 1, len(failed)
        d.run(lambda: setattr(first, "pidfd", -1))
    finally:
        for eng in engines:
            eng.drop()


def _unregistered_during_its_lookup(daemon, eng, req: pb.LookupRequest) -> None:
    """The engine is unregistered once its pinning Lookup's first step ran: the Lookup finds it
    gone (UnknownClient) and leaves no lease and no pin."""
    import asyncio

    from kvserver.errors import UnknownClient

    ops = daemon.daemon.servicer.cache

    async def race():
        lookup = asyncio.ensure_future(ops.lookup(req))
        await asyncio.sleep(0)  # its first step ran
        await daemon.core.unregister(eng.client_id)
        try:
            return await lookup
        except UnknownClient as exc:
            return exc

    assert isinstance(daemon.call(race()), UnknownClient)
    assert daemon.run(lambda: (len(daemon.core.cache.leases.leases),
                               int(daemon.core.cache.pages.pins.sum()))) == (0, 0)


def test_a_pinning_lookup_whose_registration_goes_while_its_tenants_expired_leases_end_leaves_no_lease(
        daemon, monkeypatch):
    """A pinning Lookup whose tenant holds the most leases ends the expired ones first, in steps,
    the loop serving others between them: a registration released then must not get a lease
    taken after its release ended its leases. The Lookup finds it gone and pins nothing."""
    import time

    import kvserver.store.leases as leases_module

    monkeypatch.setattr(leases_module, "END_STEP_PINS", 1)  # a lease a step
    eng = LightEngine(daemon.address, f"kvtest-gap-{secrets.token_hex(4)}", session=False)
    try:
        keys = b"".join(secrets.token_bytes(16) for _ in range(4))
        eng.stub.Put(pb.PutRequest(client_id=eng.client_id, keys=keys, key_bytes=16,
                                   device_pages=list(range(4))), timeout=10)
        daemon.run(lambda: setattr(daemon.core.cache.leases, "max_per_tenant", 4))
        daemon.run(daemon.daemon._stop_leases.set)  # no sweep: the expired leases are the Lookup's to end
        time.sleep(0.05)
        for _ in range(4):
            eng.stub.Lookup(pb.LookupRequest(client_id=eng.client_id, keys=keys, key_bytes=16, pin_ms=1),
                            timeout=10)
        time.sleep(0.01)  # expired
        req = pb.LookupRequest(client_id=eng.client_id, keys=keys, key_bytes=16, pin_ms=60_000)
        _unregistered_during_its_lookup(daemon, eng, req)
    finally:
        eng.drop()


def test_a_pinning_lookup_whose_registration_goes_while_its_keys_are_read_leaves_no_lease(daemon):
    """A Lookup's keys of more than 32 bytes are read in steps, the loop serving others between
    them: a registration released then had its leases ended already, and the Lookup then pinned
    under a new lease of the gone registration, for its whole pin_ms. It now finds the
    registration gone, as a Put or a Get does, and pins nothing."""


    eng = LightEngine(daemon.address, f"kvtest-gap-{secrets.token_hex(4)}", session=False)
    try:
        keys = [secrets.token_bytes(40) for _ in range(64)]
        eng.stub.Put(pb.PutRequest(client_id=eng.client_id, keys=b"".join(keys), key_bytes=40,
                                   device_pages=list(range(64))), timeout=10)
        more = b"".join(secrets.token_bytes(40) for _ in range(40_000))
        req = pb.LookupRequest(client_id=eng.client_id, keys=b"".join(keys) + more, key_bytes=40,
                               pin_ms=60_000)
        _unregistered_during_its_lookup(daemon, eng, req)
    finally:
        eng.drop()
