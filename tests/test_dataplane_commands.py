"""The loop's commands to the data plane's thread (a lane's opening, a gate's close, a lane's
removal) are waited for off the event loop: a plane's thread that is slow to take one (no CPU for
it, on a busy machine) holds up the call that sent it, not every other engine's calls. Real daemon,
real client, real shared memory; the thread's delay is `Engine.command_delay_us`, the stand-in for
a thread that gets no CPU for that long."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from checks import wait_until
from loop_lag import lag_during
from test_dataplane import LAYERS, LAYOUT, PAGE, TOKENS, _client

from kvclient import ShmKVPool

DELAY_US = 200_000


def _held(d) -> int:
    return len(d.core.plane.lanes)


def test_an_unregister_does_not_hold_the_loop_while_the_plane_s_thread_is_slow(plane_daemon) -> None:
    """An Unregister closes its client's gate and removes its lane: two commands, each taken
    200 ms late. The loop's 2 ms timer stays on time meanwhile, and the release still waits for
    both (its answer means the plane touches none of the client's memory)."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as pool:
        c = _client(d, pool)
        try:
            assert c.lane is not None and d.run(lambda: _held(d)) == 1
            host = c.alloc(4 * PAGE)
            assert c.write(host_indices=host, device_indices=torch.arange(4 * PAGE)) > 0
            d.core.plane.engine.command_delay_us = DELAY_US
            lag, took = d.call(lag_during(lambda: asyncio.to_thread(c.unregister)))
        finally:
            d.core.plane.engine.command_delay_us = 0
            c.close()
    assert took >= 2 * DELAY_US / 1e6, f"the release did not wait for its commands ({took:.3f} s)"
    assert lag < 0.05, f"the loop was held {lag * 1e3:.0f} ms while the plane's thread was slow"
    assert d.run(lambda: _held(d)) == 0 and not d.core.clients


def test_a_registration_made_while_another_s_commands_wait_is_served_on_the_plane(plane_daemon) -> None:
    """Another engine registers, opens its lane and copies on the plane while a release's commands
    wait for the thread: the lane list the loop reads and the thread changes stays whole."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as p0, \
            ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as p1:
        first = _client(d, p0)
        d.core.plane.engine.command_delay_us = DELAY_US
        try:
            gone = d.loop.run_in_executor(None, first.unregister)
            wait_until(lambda: d.run(lambda: _held(d)) == 0, 5, "the first lane's removal begun")
            with _client(d, p1) as second:
                assert second.lane is not None
                host = second.alloc(4 * PAGE)
                served = d.core.plane.engine.served
                assert second.write(host_indices=host, device_indices=torch.arange(4 * PAGE)) > 0
                assert d.core.plane.engine.served > served, "the second lane's Write was not the plane's"
                second.unregister()
            deadline = time.monotonic() + 10
            while not gone.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gone.done()
        finally:
            d.core.plane.engine.command_delay_us = 0
            first.close()
    assert d.run(lambda: _held(d)) == 0 and not d.core.clients


def test_a_stop_while_a_lane_s_removal_waits_ends_cleanly(plane_daemon) -> None:
    """The daemon stops while a release waits for its commands: the plane's thread ends, the
    waiting removal finds the lane gone with it, and nothing hangs or is freed twice."""
    d = plane_daemon  # (stopped here: the fixture's stop then finds it stopped)
    pool = ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS)
    c = _client(d, pool)
    try:
        d.core.plane.engine.command_delay_us = DELAY_US
        d.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(d.core.unregister(c.client_id)))
        time.sleep(0.05)
        started = time.monotonic()
        d.stop()
        assert time.monotonic() - started < 10
    finally:
        c.close()
        pool.close()


def test_a_lane_s_opening_does_not_hold_the_loop_while_the_plane_s_thread_is_slow(plane_daemon) -> None:
    """A Register and its lane's opening: the opening waits 200 ms for the plane's thread, the
    loop's 2 ms timer does not, and the lane is the plane's once open."""
    d = plane_daemon
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as pool:
        made = []
        d.core.plane.engine.command_delay_us = DELAY_US
        try:
            lag, took = d.call(lag_during(lambda: asyncio.to_thread(lambda: made.append(_client(d, pool)))))
        finally:
            d.core.plane.engine.command_delay_us = 0
        c = made[0]
        try:
            assert took >= DELAY_US / 1e6, f"the opening did not wait for the plane's thread ({took:.3f} s)"
            assert lag < 0.05, f"the loop was held {lag * 1e3:.0f} ms while the lane opened"
            assert c.lane is not None and d.run(lambda: _held(d)) == 1
            host = c.alloc(4 * PAGE)
            served = d.core.plane.engine.served
            assert c.write(host_indices=host, device_indices=torch.arange(4 * PAGE)) > 0
            assert d.core.plane.engine.served > served, "the lane's Write was not the plane's"
            c.unregister()
        finally:
            c.close()
    assert d.run(lambda: _held(d)) == 0 and not d.core.clients


def test_a_release_while_the_lane_opens_closes_it_and_the_engine_stays_on_grpc(plane_daemon) -> None:
    """The registration is released while its lane's opening waits for the plane's thread: the
    release waits for the opening and takes the lane off the plane again; the opening is refused
    (the engine stays on gRPC, and finds its registration gone), and nothing of the lane is left
    booked: no lane on the plane, no lane or descriptor counted for its uid."""
    d = plane_daemon
    book = d.daemon.servicer.lanes
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as pool:
        made: list = []
        d.core.plane.engine.command_delay_us = DELAY_US
        try:
            opener = threading.Thread(target=lambda: made.append(_client(d, pool)))
            opener.start()
            wait_until(lambda: d.run(lambda: len(book.lanes)) == 1, 10, "the lane's opening begun")
            (cid,) = d.run(lambda: list(d.core.clients))
            started = time.monotonic()
            d.call(d.core.unregister(cid))
            took = time.monotonic() - started
            opener.join(30)
        finally:
            d.core.plane.engine.command_delay_us = 0
        c = made[0]
        try:
            assert took >= DELAY_US / 1e6 / 2, f"the release did not wait for the opening ({took:.3f} s)"
            assert c.lane is None, "the lane of a released registration opened"
        finally:
            c.close()
    assert d.run(lambda: (_held(d), len(book.lanes), dict(book._fds_per_uid), list(d.core.clients))) \
        == (0, 0, {}, [])


def test_a_stop_while_a_lane_opens_ends_cleanly(plane_daemon) -> None:
    """The daemon stops while a lane's opening waits for the plane's thread: the stop takes the
    lane with the others (the opening reads nothing of it after: the sanitizers' job checks), the
    engine stays on gRPC, and nothing hangs."""
    d = plane_daemon  # (stopped here: the fixture's stop then finds it stopped)
    book = d.daemon.servicer.lanes
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as pool:
        made: list = []
        d.core.plane.engine.command_delay_us = DELAY_US
        opener = threading.Thread(target=lambda: made.append(_client(d, pool)))
        opener.start()
        wait_until(lambda: d.run(lambda: len(book.lanes)) == 1, 10, "the lane's opening begun")
        started = time.monotonic()
        d.stop()
        assert time.monotonic() - started < 10
        opener.join(30)
        assert not opener.is_alive() and made
        made[0].close()


def test_a_lane_opening_while_the_daemon_drains_is_refused_and_never_served(plane_daemon) -> None:
    """The daemon's stop begins (the lanes' drain: the plane takes no request from then on) while
    a lane's opening waits behind another command: the opening is refused (the engine stays on
    gRPC), and the plane's thread never watches that lane."""
    d = plane_daemon
    book = d.daemon.servicer.lanes
    with ShmKVPool(LAYOUT, torch.bfloat16, LAYERS, TOKENS) as pool:
        made: list = []
        d.core.plane._commands.submit(time.sleep, 0.5)  # the command thread busy with an earlier command
        opener = threading.Thread(target=lambda: made.append(_client(d, pool)))
        opener.start()
        wait_until(lambda: d.run(lambda: len(book.lanes)) == 1, 10, "the lane's opening begun")
        d.call(book.drain(0.05))
        opener.join(30)
        c = made[0]
        try:
            assert c.lane is None, "a lane opened after the drain began"
            host = c.alloc(4 * PAGE)
            served = d.core.plane.engine.served
            assert c.write(host_indices=host, device_indices=torch.arange(4 * PAGE)) > 0  # over gRPC
            assert d.core.plane.engine.served == served
        finally:
            c.close()
    assert d.run(lambda: (_held(d), len(book.lanes))) == (0, 0)

