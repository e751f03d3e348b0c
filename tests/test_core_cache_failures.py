"""A Put or Get that fails before its copy reaches the medium hands its pages back to the cache:
nothing stays marked as being written or read."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvclient.keys import page_keys
from kvserver.core import copier
from kvserver.core.cache_ops import CacheOps
from kvserver.media.shm import ShmDevicePool
from kvserver.store.cache import KVCache
from kvserver.store.pages import WRITING
from kvserver.v1 import kvserver_pb2 as pb

PAGE = 16


@pytest.fixture
def engine(daemon):
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, 2, 8 * PAGE) as pool, \
            KVClient(daemon.address, resilient=False) as client:
        client.register(model="fail", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=0,
                        page_size=PAGE)
        yield client


def test_a_get_whose_progress_signal_cannot_be_made_leaves_no_reader(daemon, engine, monkeypatch):
    keys = page_keys(range(3 * PAGE), PAGE)
    assert engine.put(keys, [0, 1, 2]).stored == 3

    def no_descriptors(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(copier, "LayerSignal", no_descriptors)
    request = pb.GetRequest(client_id=engine.client_id, keys=keys, key_bytes=16, device_pages=[3, 4, 5])
    with pytest.raises(grpc.RpcError) as err:
        list(engine._stub.Get(request))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the daemon's shortage: try again
    assert "out of file descriptors" in err.value.details()
    cache = daemon.core.cache
    assert int(cache.pages.readers.sum()) == 0
    client = daemon.core.clients[engine.client_id]
    assert not client.jobs and client.inflight == 0  # nothing of the job is left behind
    monkeypatch.undo()
    assert engine.lookup(keys).pages == 3 and cache.make_room(daemon.core.arena.capacity) is True


def test_a_put_whose_copy_cannot_start_stores_nothing(daemon, engine, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("the medium refused the job")

    monkeypatch.setattr(ShmDevicePool, "start", broken)
    keys = page_keys(range(1000, 1000 + 2 * PAGE), PAGE)
    request = pb.PutRequest(client_id=engine.client_id, keys=keys, key_bytes=16, device_pages=[0, 1])
    with pytest.raises(grpc.RpcError) as err:
        engine._stub.Put(request)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    cache = daemon.core.cache
    assert int((cache.pages.state == WRITING).sum()) == 0
    client = daemon.core.clients[engine.client_id]
    assert not client.jobs and client.inflight == 0
    monkeypatch.undo()
    assert engine.lookup(keys).pages == 0
    assert engine.put(keys, [0, 1]).stored == 2  # not "present": the failed Put left no trace


def test_a_put_of_keys_another_put_is_writing_counts_them_only_once_stored(daemon, engine, monkeypatch):
    """Keys a first Put is still writing are not "present" to a second Put: it waits for that copy,
    and when the copy fails it stores them itself, so that what it reports stored is stored."""
    monkeypatch.setattr(ShmDevicePool, "inline_ok", property(lambda self: False))
    real = ShmDevicePool.start
    started: list[object] = []

    def first_fails_late(self, job, *args):
        if started:
            return real(self, job, *args)
        started.append(job)
        failing: Future[None] = Future()
        threading.Timer(0.5, failing.set_exception, [RuntimeError("the copy failed")]).start()
        return failing

    monkeypatch.setattr(ShmDevicePool, "start", first_fails_late)
    real_put_on_plane = CacheOps.put_on_plane

    def first_on_the_loop(self, req, ended):  # where the first Put's failure is made: the loop's copy
        return None if req.client_id == engine.client_id else real_put_on_plane(self, req, ended)

    # (The second Put, on its own lane, finds keys being written: it is not taken without a task.)
    monkeypatch.setattr(CacheOps, "put_on_plane", first_on_the_loop)
    keys = page_keys(range(2000, 2000 + 2 * PAGE), PAGE)
    cache = daemon.core.cache
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, 2, 8 * PAGE) as pool, \
            KVClient(daemon.address, resilient=False) as other, ThreadPoolExecutor(1) as pool_exec:
        other.register(model="fail", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=0,
                       page_size=PAGE)
        first = pool_exec.submit(engine.put, keys, [0, 1])
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int((cache.pages.state == WRITING).sum()) == 2  # the first Put's pages, being written
        second = other.put(keys, [2, 3])
        with pytest.raises(KVClientError):
            first.result(timeout=10)
    assert (second.stored, second.present, second.dropped) == (2, 0, 0)
    assert engine.lookup(keys).pages == 2


def test_a_key_another_put_was_writing_left_out_counts_every_key_after_it_dropped(daemon, engine,
                                                                                  monkeypatch):
    """The first Put's copy of k0 fails and the second Put, which waited for it, finds no room to
    store k0 itself: its dropped keys are still its last ones, every key from k0 on, so that the
    leading keys less the dropped ones are what the part holds (kvclient's SGLang backend reads
    it so), though it stored k1 and k2."""
    monkeypatch.setattr(ShmDevicePool, "inline_ok", property(lambda self: False))
    real = ShmDevicePool.start
    started: list[object] = []
    failed = threading.Event()

    def first_fails_late(self, job, *args):
        if started:
            return real(self, job, *args)
        started.append(job)
        failing: Future[None] = Future()

        def fail() -> None:
            failed.set()
            failing.set_exception(RuntimeError("the copy failed"))

        threading.Timer(0.5, fail).start()
        return failing

    monkeypatch.setattr(ShmDevicePool, "start", first_fails_late)
    real_put_on_plane = CacheOps.put_on_plane
    monkeypatch.setattr(CacheOps, "put_on_plane", lambda self, req, ended: (
        None if req.client_id == engine.client_id else real_put_on_plane(self, req, ended)))
    real_allocate = KVCache._allocate
    monkeypatch.setattr(KVCache, "_allocate", lambda self, *a, **k: np.empty(0, np.int64) if failed.is_set()
                        else real_allocate(self, *a, **k))  # no room once the first copy failed
    keys = page_keys(range(5000, 5000 + 3 * PAGE), PAGE)
    with ShmKVPool(KVLayout.mha(2, 8), torch.float16, 2, 8 * PAGE) as pool, \
            KVClient(daemon.address, resilient=False) as other, ThreadPoolExecutor(1) as pool_exec:
        other.register(model="fail", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=0,
                       page_size=PAGE)
        first = pool_exec.submit(engine.put, keys[:16], [0])
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        second = other.put(keys, [2, 3, 4])
        with pytest.raises(KVClientError):
            first.result(timeout=10)
    assert (second.stored, second.present, second.dropped) == (0, 0, 3)
    assert engine.lookup(keys).pages == 0 and engine.lookup(keys[16:]).pages == 2


@pytest.mark.parametrize("call", ["put", "get"])
def test_a_client_released_between_a_calls_steps_gets_no_copy(daemon, engine, monkeypatch, call):
    """A Put or Get yields between its steps; if its client is released meanwhile (Unregister,
    reclaim), it answers UNKNOWN client and copies nothing: its pool may be closed by then."""
    import asyncio

    import kvserver.store.cache as cache_module
    from kvserver.errors import UnknownClient

    keys = page_keys(range(3000, 3000 + 4 * PAGE), PAGE)
    if call == "get":
        assert engine.put(keys, [0, 1, 2, 3]).stored == 4
    monkeypatch.setattr(cache_module, "STEP_KEYS", 1)
    ops = daemon.daemon.servicer.cache
    cid = engine.client_id

    async def race() -> None:
        if call == "put":
            task = asyncio.ensure_future(ops.put(pb.PutRequest(client_id=cid, keys=keys, key_bytes=16,
                                                               device_pages=[4, 5, 6, 7])))
        else:
            async def get() -> None:
                async for _ in ops.get(pb.GetRequest(client_id=cid, keys=keys, key_bytes=16,
                                                     device_pages=[4, 5, 6, 7])):
                    pass
            task = asyncio.ensure_future(get())
        await asyncio.sleep(0)  # its first step is done; it yields
        await daemon.core.unregister(cid)
        with pytest.raises(UnknownClient):
            await task

    daemon.call(race())
    cache = daemon.core.cache
    assert int((cache.pages.state == WRITING).sum()) == 0 and int(cache.pages.readers.sum()) == 0
