"""The client core without a daemon: the requests it builds, the answers it reads, and what it
decides on each failure; then the shells' cache calls and tickets against a real daemon."""

from __future__ import annotations

import asyncio
import os

import grpc
import numpy as np
import pytest
import torch
from checks import wait_until

from kvclient import (
    AsyncCacheView,
    AsyncKVClient,
    AsyncLoadHandle,
    CacheView,
    KVClient,
    KVClientError,
    KVLayout,
    LoadHandle,
    LookupResult,
    PutResult,
    ShmKVPool,
)
from kvclient._ops import Call, Missed
from kvclient._transport.fd_socket import ticketed
from kvclient.core import TENANT_METADATA, ClientCore
from kvclient.keys import page_keys, split_keys
from kvclient.view_core import MISS, RETRY, ViewCore
from kvserver.v1 import kvserver_pb2 as pb

C = grpc.StatusCode
LAYOUT = KVLayout.mha(2, 8)
START, END = 2, 6


@pytest.fixture
def pool():
    with ShmKVPool(LAYOUT, torch.float16, END - START, 256) as p:
        yield p


def registered(pool, resilient: bool = True, **kw) -> ClientCore:
    core = ClientCore("/nowhere.sock", timeout=2.0, token=None, resilient=resilient, **kw)
    req = core.register_request(model="m", pool=pool, start_layer=START, end_layer=END, num_layers=8,
                                host_tokens=64, page_size=16, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    core.registered(pb.RegisterResponse(client_id="cid-1", host_tokens=64, page_size=16, epoch=3), req, pool)
    return core


def error(code: grpc.StatusCode, ended: bool = False) -> KVClientError:
    return KVClientError(code, "said the daemon", ended)


KEYS = page_keys(list(range(64)), 16)  # 4 keys


# ---- requests and answers ----------------------------------------------------------------------


def test_metadata_carries_the_daemon_token_and_the_tenant_token(monkeypatch):
    monkeypatch.delenv("KVSERVER_TOKEN", raising=False)
    assert ClientCore(None, timeout=1, token=None, resilient=True).metadata is None
    md = ClientCore(None, timeout=1, token="s3cret", resilient=True, tenant_token="tt").metadata
    assert md == (("authorization", "Bearer s3cret"), (TENANT_METADATA, "tt"))
    monkeypatch.setenv("KVSERVER_TOKEN", "env")
    from_env = ClientCore(None, timeout=1, token=None, resilient=True).metadata
    assert from_env == (("authorization", "Bearer env"),)


def test_registration_state(pool):
    core = registered(pool)
    assert core.connected and core.client_id == "cid-1" and core.request.model == "m"
    assert core.request.peer_ticket == ""  # a ticket is added to each send, not kept
    reg = core.registration
    assert (reg.start_layer, reg.end_layer, reg.epoch) == (START, END, 3)


def test_lookup_request_and_answer(pool):
    core = registered(pool)
    call = core.start(core.lookup(split_keys(KEYS), pin_ms=250, whole_space=True))
    assert isinstance(call, Call) and call.timeout == core.timeout
    assert call.request == pb.LookupRequest(client_id="cid-1", keys=KEYS, key_bytes=16, pin_ms=250,
                                            whole_space=True, timeout_ms=int(core.timeout * 1000))
    # Its own bound, where given, travels too (the fast lane has no gRPC deadline to end it).
    assert core.start(core.lookup(split_keys(KEYS), 0, False, timeout=0.25)).request.timeout_ms == 250
    assert call.op.read(pb.LookupResponse(pages=3, lease_id="L")) == LookupResult(3, "L")
    assert call.op.miss == LookupResult(0)
    wide = core.start(core.lookup([b"a" * 32, b"b" * 32], 0, False)).request
    assert (wide.key_bytes, wide.keys) == (32, b"a" * 32 + b"b" * 32)


@pytest.mark.parametrize("pages", [[5, 1, 9, 2], np.array([5, 1, 9, 2]), torch.tensor([5, 1, 9, 2])],
                         ids=["list", "ndarray", "tensor"])
def test_put_request_and_answer(pool, pages):
    core = registered(pool)
    call = core.start(core.put(KEYS, pages, ready_event=b"\x07" * 64))
    assert call.timeout == core.job_deadline > core.timeout  # the daemon's answer ends the call
    assert call.request == pb.PutRequest(client_id="cid-1", keys=KEYS, key_bytes=16,
                                         device_pages=[5, 1, 9, 2], ready_event=b"\x07" * 64, timeout_ms=2000)
    answer = pb.PutResponse(stored=2, present=1, dropped=1, bytes=4096)
    assert call.op.read(answer) == PutResult(2, 1, 1, 4096)
    assert call.op.miss == PutResult(dropped=4)


def test_get_request_layers_and_miss(pool):
    core = registered(pool)
    call = core.start_stream(core.get(KEYS, [0, 1, 2, 3], layers=[3, 4], event_slot=1, ready_event=None,
                                      lease_id="L"))
    assert call.request == pb.GetRequest(client_id="cid-1", keys=KEYS, key_bytes=16,
                                         device_pages=[0, 1, 2, 3], layers=[3, 4], event_slot=1,
                                         timeout_ms=2000, lease_id="L")
    assert call.layers == [3, 4] and call.events == {} and call.timeout == core.job_deadline
    every = core.start_stream(core.get(KEYS, [0, 1, 2, 3], None, 0, None, ""))
    assert every.layers == list(range(START, END)) and list(every.request.layers) == []
    core.connected = False
    missed = core.start_stream(core.get(KEYS, [0, 1, 2, 3], None, 0, None, ""))
    assert missed == Missed(list(range(START, END))) and core.misses == 1


def test_release_request_and_answer(pool):
    core = registered(pool)
    call = core.start(core.release("one"))
    assert call.request == pb.ReleaseRequest(client_id="cid-1", lease_ids=["one"])
    assert list(core.start(core.release(["a", "b"])).request.lease_ids) == ["a", "b"]
    assert call.op.read(pb.ReleaseResponse(released=1)) == 1 and call.op.miss == 0


def test_keys_of_unequal_length_are_refused_before_anything_is_sent(pool):
    core = registered(pool)
    for build in (lambda: core.lookup([b"ab", b"abc"], 0, False), lambda: core.put(b"abc", [0], None, 2),
                  lambda: core.get([b"a", b"bb"], [0, 1], None, 0, None, "")):
        with pytest.raises(KVClientError) as err:
            build()
        assert err.value.code == C.INVALID_ARGUMENT


def test_index_api_requests(pool):
    core = registered(pool)
    assert core.start(core.alloc(40)).request == pb.AllocRequest(client_id="cid-1", num_tokens=40)
    write = core.start(core.write(torch.arange(4), [9, 8, 7, 6], [2], None))
    assert write.request == pb.WriteRequest(client_id="cid-1", host_indices=[0, 1, 2, 3],
                                            device_indices=[9, 8, 7, 6], layers=[2], timeout_ms=2000)
    assert write.op.job and not core.alloc(1).job
    stats = core.start(core.stats(all_clients=True))
    assert stats.reg is None and stats.request == pb.StatsRequest()
    size = core.available_size().read(pb.StatsResponse(clients=[pb.ClientStats(capacity_tokens=64,
                                                                                used_tokens=16)]))
    assert size == 48


def test_calls_before_register_are_refused(pool):
    core = ClientCore(None, timeout=1, token=None, resilient=True)
    with pytest.raises(KVClientError) as err:
        core.start(core.release("x"))
    assert err.value.code == C.FAILED_PRECONDITION
    with pytest.raises(KVClientError):
        core.start_stream(core.get(KEYS, [0], None, 0, None, ""))


# ---- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code, miss, lose", [
    (C.UNAVAILABLE, True, True), (C.NOT_FOUND, True, True), (C.FAILED_PRECONDITION, True, False),
    (C.DEADLINE_EXCEEDED, True, False), (C.CANCELLED, True, False),
    (C.INVALID_ARGUMENT, False, False), (C.OUT_OF_RANGE, False, False), (C.RESOURCE_EXHAUSTED, False, False),
    (C.UNIMPLEMENTED, False, False), (C.PERMISSION_DENIED, False, False),
])
def test_which_failures_are_misses(pool, code, miss, lose):
    core = registered(pool)
    assert core.judge(error(code), core.registration) == (miss, lose)
    assert core.misses == int(miss)
    strict = registered(pool, resilient=False)
    assert strict.judge(error(code), strict.registration) == (False, False) and strict.misses == 0
    assert core.judge(error(code), None) == (False, False)  # a call on no registration raises all


@pytest.mark.parametrize("code", [C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION])
def test_a_cache_call_the_daemon_cannot_serve_now_is_a_miss_logged_once(pool, code, caplog):
    core = registered(pool)
    with caplog.at_level("WARNING", logger="kvclient.core"):
        assert core.judge(error(code), core.registration, cache=True) == (True, False)
        assert core.judge(error(code), core.registration, cache=True) == (True, False)
    assert core.misses == 2
    assert len([r for r in caplog.records if "cache call missed" in r.getMessage()]) == 1
    assert core.judge(error(C.INVALID_ARGUMENT), core.registration, cache=True) == (False, False)
    strict = registered(pool, resilient=False)
    assert strict.judge(error(code), strict.registration, cache=True) == (False, False)


def test_a_job_failure_is_confirmed_unless_the_daemon_said_it_ended(pool):
    core = registered(pool)
    put = core.start(core.put(KEYS, [0, 1, 2, 3], None))
    get = core.start_stream(core.get(KEYS, [0, 1, 2, 3], None, 0, None, ""))
    lookup = core.start(core.lookup(KEYS, 0, False))
    assert core.unconfirmed(put, error(C.DEADLINE_EXCEEDED)) and core.unconfirmed(get, error(C.CANCELLED))
    assert not core.unconfirmed(put, error(C.DEADLINE_EXCEEDED, ended=True))
    assert not core.unconfirmed(put, error(C.UNAVAILABLE))
    assert not core.unconfirmed(lookup, error(C.DEADLINE_EXCEEDED))
    assert core.confirm_request(core.registration) == pb.UnregisterRequest(client_id="cid-1")
    assert core.confirmed(pb.UnregisterResponse())
    assert not core.confirmed(pb.UnregisterResponse(copies_pending=True))
    assert core.confirmed(None, error(C.NOT_FOUND)) and not core.confirmed(None, error(C.DEADLINE_EXCEEDED))
    core.closing()
    assert core.confirm_request(core.registration) is None


def test_lose_then_reregister(pool):
    core = registered(pool)
    old = core.registration
    session = object()
    assert core.hold(old, session)
    lost = core.lose(old, "gone")
    assert lost.session is session and lost.reconnect and not core.connected
    assert core.lose(old, "again") is None  # lost once
    # while lost: calls are misses without an RPC
    assert core.start(core.put(KEYS, [0, 1, 2, 3], None)) == Missed(PutResult(dropped=4))
    assert core.start(core.lookup(KEYS, 0, False)) == Missed(LookupResult(0))
    assert core.misses == 2
    retry = core.retry_request(old)
    assert retry.replaces_client_id == "cid-1" and retry.model == "m"
    assert core.request.replaces_client_id == ""  # the kept request is not changed
    new = core.reregistered(pb.RegisterResponse(client_id="cid-2", epoch=4), old, 3)
    assert new.client_id == "cid-2" and (new.start_layer, new.end_layer) == (START, END)
    assert core.connected and core.reconnects == 1 and core.registration is new
    assert core.retry_request(old) is None  # that loss is over
    # the new registration lost before its session is held: a new re-registration starts, and the
    # session opened late is refused (the shell cancels it)
    assert core.lose(new, "again").reconnect
    assert not core.hold(new, object())
    core.reconnect_ended(old)  # an older re-registration ending does not stop the new one
    assert core.retry_request(new) is not None


def test_not_resilient_and_closed(pool):
    strict = registered(pool, resilient=False)
    assert strict.lose(strict.registration, "gone").reconnect is False
    with pytest.raises(KVClientError) as err:
        strict.start(strict.lookup(KEYS, 0, False))
    assert err.value.code == C.UNAVAILABLE
    core = registered(pool)
    old = core.registration
    core.closing()
    assert core.lose(old, "gone") is None and core.retry_request(old) is None
    assert core.reregistered(pb.RegisterResponse(client_id="x"), old, 1) is None


def test_unregister_forgets_everything(pool):
    core = registered(pool)
    core.hold(core.registration, "session")
    reg, session = core.unregistering()
    assert reg.client_id == "cid-1" and session == "session"
    assert core.registration is None and core.request is None and not core.connected
    core.unregister_failed(error(C.UNAVAILABLE))  # a miss: not raised
    with pytest.raises(KVClientError):
        core.unregister_failed(error(C.PERMISSION_DENIED))


# ---- the scheduler's view ----------------------------------------------------------------------


def view_core() -> ViewCore:
    return ViewCore("/nowhere.sock", model="m", layout=KVLayout.mla(16, 8), dtype=torch.bfloat16,
                    page_size=16, num_layers=8, tp_size=4, pp_size=2, timeout=1.0, token=None,
                    tenant_token="tt")


def test_view_requests():
    core = view_core()
    req = core.open_request("ticket")
    assert req.peer_ticket == "ticket"
    sp = req.space
    assert (sp.model, sp.page_size, sp.num_layers, sp.tp_size, sp.pp_size) == ("m", 16, 8, 4, 2)
    assert req.space.layout.WhichOneof("kind") == "mla" and req.space.dtype == pb.DTYPE_BFLOAT16
    assert core.metadata == ((TENANT_METADATA, "tt"),)
    assert core.opened(pb.OpenSpaceResponse(space_id="S", tenant="uid:5")) == "S" and core.tenant == "uid:5"
    op = core.lookup(KEYS, 100)
    assert op.build("S") == pb.LookupRequest(space_id="S", keys=KEYS, key_bytes=16, pin_ms=100)
    assert op.read(pb.LookupResponse(pages=2, lease_id="L")) == LookupResult(2, "L")
    assert core.release(["L"]).build("S") == pb.ReleaseRequest(space_id="S", lease_ids=["L"])


def test_view_failures():
    core = view_core()
    core.opened(pb.OpenSpaceResponse(space_id="S"))
    lookup, release = core.lookup(KEYS, 0), core.release("L")
    assert core.failed(lookup, error(C.NOT_FOUND), retried=False) == RETRY and core.space_id == ""
    assert core.failed(lookup, error(C.NOT_FOUND), retried=True) == MISS
    assert core.failed(release, error(C.NOT_FOUND), retried=False) == MISS  # its leases went with the space
    assert core.failed(lookup, error(C.UNAVAILABLE), retried=False) == MISS
    assert core.failed(lookup, error(C.DEADLINE_EXCEEDED), retried=False) == MISS
    assert core.misses == 4 and core.reopens == 1
    with pytest.raises(KVClientError):
        core.failed(lookup, error(C.INVALID_ARGUMENT), retried=False)


# ---- handles of a Get ---------------------------------------------------------------------------


def progress(pages: int, layer: int, done: int, final: bool) -> pb.LoadProgress:
    return pb.LoadProgress(pages=pages, last_layer=layer, layers_done=done, done=final, bytes=100 * done)


def test_a_get_handle_reads_its_pages_from_the_first_message():
    handle = LoadHandle([2, 3], get=True)
    handle._consume([progress(3, 2, 1, False), progress(3, 3, 2, True)])
    assert handle.pages(1) == 3 and handle.wait_layer(3, 1) and handle.wait(1) == 200
    nothing = LoadHandle([2, 3], get=True)
    nothing._consume([pb.LoadProgress(pages=0, done=True)])
    assert nothing.pages(1) == 0 and nothing.wait_layer(2, 1) is False and nothing.wait(1) == 0
    assert LoadHandle.miss([2, 3], get=True).pages(1) == 0


def test_an_async_get_handle_reads_its_pages_from_the_first_message():
    async def stream(*messages):
        for m in messages:
            yield m

    async def run():
        handle = AsyncLoadHandle([2, 3], stream(progress(3, 2, 1, False), progress(3, 3, 2, True)), get=True)
        got = (await handle.pages(), await handle.wait_layer(3), await handle.wait())
        nothing = AsyncLoadHandle([2, 3], stream(pb.LoadProgress(pages=0, done=True)), get=True)
        got += (await nothing.pages(), await nothing.wait_layer(2), await nothing.wait())
        return got + (await AsyncLoadHandle([2], None, get=True).pages(),)

    assert asyncio.run(asyncio.wait_for(run(), 5)) == (3, True, 200, 0, False, 0, 0)


# ---- against a real daemon ---------------------------------------------------------------------


def test_a_pool_without_descriptors_still_gets_a_peer_ticket(daemon):
    """A CUDA pool has no descriptors to pass; its Register carries a ticket all the same, which
    tells the daemon the caller's uid."""

    class NoFds:
        pass

    sent = ticketed(daemon.address, NoFds(), pb.RegisterRequest(model="m"))
    assert sent.peer_ticket and sent.model == "m"
    ticket = daemon.run(lambda: daemon.core.tickets.redeem(sent.peer_ticket))
    assert (ticket.peer.uid, ticket.peer.pid, ticket.fds) == (os.getuid(), os.getpid(), [])
    assert ticketed("localhost:1", NoFds(), pb.RegisterRequest()).peer_ticket == ""  # TCP: no fd socket


def test_cache_calls_are_misses_while_the_daemon_is_away(daemon_factory, pool):
    d = daemon_factory()
    with KVClient(d.address, timeout=1.0) as client:
        client.register(model="m", pool=pool, start_layer=START, end_layer=END, num_layers=8, host_tokens=64,
                        page_size=16)
        d.stop()
        wait_until(lambda: not client.connected, 5, "the session to end")
        assert client.lookup(KEYS) == LookupResult(0)
        assert client.put(KEYS, [0, 1, 2, 3]) == PutResult(dropped=4)
        handle = client.get(KEYS, [0, 1, 2, 3])
        assert handle.missed and handle.pages(1) == 0 and handle.wait_layer(START, 1) is False
        assert client.release(["L"]) == 0
        assert client.misses == 4


def test_views_answer_nothing_while_the_daemon_is_away(socket_dir):
    address = os.path.join(socket_dir, "absent.sock")
    kw = dict(model="m", layout=LAYOUT, dtype=torch.float16, page_size=16, num_layers=8, timeout=0.5)
    with CacheView(address, **kw) as view:
        assert view.lookup(KEYS, pin_ms=10) == LookupResult(0) and view.release("L") == 0
        assert view.misses == 2 and view.space_id == ""
        with pytest.raises(KVClientError) as err:
            view.open()
        assert err.value.code == C.UNAVAILABLE

    async def run():
        async with AsyncCacheView(address, **kw) as view:
            return await view.lookup(split_keys(KEYS)), await view.release(["L"]), view.misses

    assert asyncio.run(run()) == (LookupResult(0), 0, 2)


def test_async_cache_calls_are_misses_while_the_daemon_is_away(daemon_factory, pool):
    d = daemon_factory()

    async def run():
        async with AsyncKVClient(d.address, timeout=1.0) as client:
            await client.register(model="m", pool=pool, start_layer=START, end_layer=END, num_layers=8,
                                  host_tokens=64, page_size=16)
            await asyncio.to_thread(d.stop)
            for _ in range(100):
                if not client.connected:
                    break
                await asyncio.sleep(0.05)
            handle = client.get(KEYS, [0, 1, 2, 3])
            return (client.connected, await client.lookup(KEYS), await client.put(KEYS, [0, 1, 2, 3]),
                    await handle.pages(), handle.missed, await client.release("L"), client.misses)

    assert asyncio.run(run()) == (False, LookupResult(0), PutResult(dropped=4), 0, True, 0, 4)


# ---- re-registration's pace and log, and a late lease --------------------------------------------


def test_a_refused_reregistration_is_warned_once_per_status_and_reason_and_slowed(caplog):
    import logging

    from kvclient import core as core_mod

    caplog.set_level(logging.DEBUG, logger="kvclient")
    tries = core_mod.Reregistration()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    tries.failed(None, "no peer ticket")  # the daemon is not back: DEBUG only
    tries.failed(C.UNAVAILABLE, "")
    assert warnings() == [] and tries.refusals == 0
    for free in (100, 90, 80):  # the same reason, other numbers
        tries.failed(C.RESOURCE_EXHAUSTED, f"grant of 256 pages refused ({free} free)")
    assert len(warnings()) == 1 and "RESOURCE_EXHAUSTED" in warnings()[0] and "(100 free)" in warnings()[0]
    assert tries.refusals == core_mod.REFUSALS_TO_SLOW and tries.attempts == 5
    assert all(core_mod.REFUSED_FIRST / 2 <= tries.next() <= core_mod.REFUSED_CAP for _ in range(20))
    tries.failed(C.RESOURCE_EXHAUSTED, "no host memory left for one page")  # another reason
    tries.failed(C.PERMISSION_DENIED, "not yours")  # another status
    assert len(warnings()) == 3
    tries.failed(C.UNAVAILABLE, "")  # away again: the quick pace
    assert tries.refusals == 0 and tries.next() <= 0.05


def test_a_late_lookup_answer_is_released_only_with_a_lease():
    from kvclient._transport.lane import late_release

    late = pb.LookupResponse(pages=2, lease_id="L").SerializeToString()
    assert late_release(late, client_id="cid-1") == pb.ReleaseRequest(client_id="cid-1", lease_ids=["L"])
    assert late_release(late, space_id="s") == pb.ReleaseRequest(space_id="s", lease_ids=["L"])
    assert late_release(pb.LookupResponse(pages=2).SerializeToString(), client_id="c") is None
    assert late_release(b"\xff\xff", client_id="c") is None  # not a LookupResponse
