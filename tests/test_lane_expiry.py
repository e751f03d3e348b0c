"""A lane call its client gave up on is never started (kvserver.protocol.ring, the slot's expiry
word): a daemon stopped past its clients' deadlines (SIGSTOP, a frozen cgroup, a stalled loop) that
resumes must not run the Puts, Writes and Loads queued on its lanes meanwhile. Their engines have
reported them failed and reused their device slots: a late Put would store the slots' new content
under the old keys, and a late Load would overwrite another request's KV."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
from checks import wait_until
from daemon_proc import DaemonProcess
from test_lane import all_stopped

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys

LAYOUT, DTYPE, LAYERS, PAGE, TOKENS = KVLayout.mha(2, 8), torch.float16, 4, 16, 256
TIMEOUT = 1.0


def fill(pool: ShmKVPool, value: float) -> None:
    for layer in range(LAYERS):
        pool.k_buffer(layer).fill_(value)
        pool.v_buffer(layer).fill_(value)


@pytest.mark.parametrize("plane", ["compiled", "python"])
def test_calls_queued_while_the_daemon_was_stopped_past_their_deadline_never_run(socket_dir, monkeypatch,
                                                                                  plane) -> None:
    monkeypatch.setenv("KVSERVER_DATA_PLANE", plane)
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, \
                KVClient(d.address, timeout=TIMEOUT) as client, \
                CacheView(d.address, model="expiry", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                          num_layers=LAYERS, timeout=5.0) as view:
            client.register(model="expiry", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                            host_tokens=128, page_size=PAGE)
            warm = page_keys(range(1000, 1000 + PAGE), PAGE)
            assert client.put(warm, [0]).stored == 1 and client.lane is not None
            keys = page_keys(range(PAGE), PAGE)
            fill(pool, 1.0)
            os.kill(d.pid, signal.SIGSTOP)
            wait_until(lambda: all_stopped(d.pid), 10, "every thread of the daemon to stop")
            assert client.put(keys, [0]).stored == 0  # given up on: a miss
            fill(pool, 7.0)  # the engine reuses its device slot for other KV
            os.kill(d.pid, signal.SIGCONT)
            wait_until(lambda: client.connected, 20, "the engine to register again")
            time.sleep(0.3)
            assert view.lookup(keys).pages == 0  # the late Put never ran: nothing stored
            assert view.lookup(warm).pages == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_a_client_in_another_time_namespace_writes_expiries_on_the_daemons_clock() -> None:
    from kvclient._transport.lane import ClientLane

    lane = ClientLane.standalone()
    try:
        now = time.monotonic()
        asked = time.monotonic_ns()
        # The same clock, the answer read 1.5 s late (a pause of the engine's thread): no offset.
        lane.learn_clock(asked + 1000, asked, asked + 1_500_000_000)
        assert lane.clock_offset_ns == 0 and abs(lane._expires(now + 1) - int((now + 1) * 1e9)) <= 1
        # Another namespace's clock, an hour ahead, stamped 0.5 s into a 1 s call: the offset
        # from the call's start, never below the true one (an expiry late, never early).
        true = 3_600 * 10**9 - 500_000_000
        lane.learn_clock(asked + 3_600 * 10**9, asked, asked + 1_000_000_000)
        assert true <= lane.clock_offset_ns <= true + 1_000_000_000
        assert lane._expires(now + 1) - int((now + 1) * 1e9) == lane.clock_offset_ns
        # Even 0.3 s behind (no fixed threshold): the offset.
        lane.learn_clock(asked - 300_000_000, asked, asked + 2_000_000)
        assert lane.clock_offset_ns == -300_000_000
        lane.learn_clock(0, asked, asked + 1)  # a daemon that sends no clock reads no expiry
        assert lane.clock_offset_ns == 0
    finally:
        lane.close()


def test_a_lane_opened_slowly_on_the_daemons_own_clock_serves_its_short_calls(socket_dir,
                                                                              monkeypatch) -> None:
    """The OpenLane answer read 1.5 s after the daemon stamped it (the engine's thread paused):
    the client is on the daemon's clock all the same, and its 1 s Lookups are served, not refused."""
    from kvclient._transport import lane as lane_mod

    real = lane_mod.ClientLane.learn_clock

    def late(self, daemon_ns, asked_ns, answered_ns):
        time.sleep(1.5)
        return real(self, daemon_ns, asked_ns, time.monotonic_ns())

    monkeypatch.setattr(lane_mod.ClientLane, "learn_clock", late)
    d = DaemonProcess(os.path.join(socket_dir, "kv.sock"))
    try:
        with ShmKVPool(LAYOUT, DTYPE, LAYERS, TOKENS) as pool, KVClient(d.address, timeout=TIMEOUT) as client:
            client.register(model="slow-open", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                            host_tokens=128, page_size=PAGE)
            keys = page_keys(range(PAGE), PAGE)
            assert client.put(keys, [0]).stored == 1 and client.lane is not None
            assert client.lane.clock_offset_ns == 0
            assert [client.lookup(keys).pages for _ in range(3)] == [1, 1, 1]
            assert client.misses == 0
    finally:
        d.stop()
