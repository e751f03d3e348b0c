"""A CUDA pool's lane Writes and Loads put on the GPU's stream by the compiled data plane itself
(kvserver/lane/csrc/cuda_jobs.h; KVSERVER_PLANE_CUDA=1), on CPU: CuPy and the driver's
entry points replaced by tests/fake_cupy.py, whose "device memory" is host memory, so each copy
the plane issues really moves bytes and lands in the same streams, events and call log as the
loop's. The real daemon, the real client and its lane. What this cannot show (the driver's own
behaviour, speed) is for scripts/gpu_check.py on a GPU."""

from __future__ import annotations

import random
import threading
import time

import fake_cupy
import grpc
import numpy as np
import pytest
import torch
from fake_cupy import UUID
from ticketing import ticketing_stub

from kvclient import KVClient, KVClientError, KVLayout
from kvclient.cuda_events import LayerEvents
from kvserver.media.cuda import plan
from kvserver.v1 import kvserver_pb2 as pb

LAYERS, TOKENS, PAGE = 4, 256, 16
HEADS, HEAD_DIM = 2, 128  # 512-byte tokens (fp16): an 8 KiB page chunk
LAYOUT = KVLayout.mha(HEADS, HEAD_DIM)
START = 8
READY = (4242).to_bytes(8, "little") * 8  # the engine's ready event (an IPC handle of the stand-in)


class FakeCudaPool:
    """What the client takes of a CudaKVPool: its layout, dtype and descriptor (the stand-in's
    exported allocation), and a device for its layer events (opened by handle: see ``events``)."""

    def __init__(self, fake, parts: int = 2, layout: KVLayout = LAYOUT) -> None:
        self.layout, self.dtype = layout, torch.float16
        token_bytes = layout.token_bytes(torch.float16)
        buffer_bytes = TOKENS * token_bytes
        handle, mem = fake.cuda.runtime.export(LAYERS * parts * buffer_bytes + 4096)
        self.refs = pb.DevicePool(num_tokens=TOKENS, layers=[
            pb.LayerBuffers(parts=[
                pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=handle, device_uuid=UUID,
                                                     allocation_size=mem.size),
                             offset=4096 + (layer * parts + part) * buffer_bytes, token_stride=token_bytes)
                for part in range(parts)])
            for layer in range(LAYERS)])
        self.kv = mem[4096:].reshape(LAYERS, parts, TOKENS, token_bytes)
        self.buffers = [[torch.empty(0)]]  # the client reads buffers[0][0].device

    def descriptor(self) -> pb.DevicePool:
        return self.refs


@pytest.fixture
def fake(monkeypatch):
    cupy = fake_cupy.install(monkeypatch)
    monkeypatch.setattr(plan, "PLANE", True)
    # The engine's side of the layer events: their handles stand for them (no torch.cuda here).
    monkeypatch.setattr(LayerEvents, "event", lambda self, slot, layer: (slot, layer))
    yield cupy
    # Nothing stays queued behind an event a failed test left hung: its pool's quarantine drains
    # and closes its allocations, which the stand-in's handles (the same in every test) would reuse.
    cupy.cuda.runtime.fire_all()


def _client(d, pool: FakeCudaPool) -> KVClient:
    c = KVClient(d.address, timeout=10, resilient=False)
    c.register(model="gpu", pool=pool, start_layer=START, end_layer=START + LAYERS, num_layers=16,
               host_tokens=TOKENS, page_size=PAGE, event_slots=2)
    return c


def _released(device, seconds: float = 10.0) -> None:
    """Waits until a pool's resources are released (a quarantined one's once its stream drained):
    the stand-in's allocations are opened once per process (``_open``), so none may outlive its test."""
    _until(device.released.done, seconds)
    assert device.released.done(), "the pool's resources were not released"


def _own_daemon(daemon_factory, **settings):
    """An in-process daemon of these settings whose compiled data plane runs (else the test is skipped)."""
    d = daemon_factory(**settings)
    if d.core.plane is None:
        pytest.skip("the compiled data plane is not built")
    return d


def _writer(c: KVClient, ended: dict, name: str, t0: float = 0.0, **write) -> threading.Thread:
    """``c.write(**write)`` in a thread of its own, started: ended[name] is then (seconds from
    ``t0``, the bytes written or the KVClientError)."""
    def run() -> None:
        try:
            got = c.write(**write)
        except KVClientError as exc:
            got = exc
        ended[name] = (time.monotonic() - t0, got)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _until(ready, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)


def _scramble(pool: FakeCudaPool, rng) -> None:
    """New random bytes in every token of the pool's "device" buffers."""
    pool.kv[:] = rng.integers(0, 256, pool.kv.shape, dtype=np.uint8)


def _random_pool(fake, seed: int, **kw) -> tuple[FakeCudaPool, np.random.Generator]:
    """A pool of random bytes, and the generator that made them."""
    pool, rng = FakeCudaPool(fake, **kw), np.random.default_rng(seed)
    _scramble(pool, rng)
    return pool, rng


def _pages(rng, n: int) -> list[int]:
    pages = rng.permutation(TOKENS // PAGE)[:n]
    return (pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1).tolist()


def test_lane_writes_and_loads_of_a_cuda_pool_are_the_planes_bit_exact(plane_daemon, fake) -> None:
    d, rt = plane_daemon, fake.cuda.runtime
    pool, rng = _random_pool(fake, 5)
    with _client(d, pool) as c:
        assert c.lane is not None
        client = d.core.clients[c.registration.client_id]
        gate = client.gate
        assert gate is not None and gate.cuda, "the CUDA pool's lane is not the plane's"
        host = c.alloc(8 * PAGE)
        dev = _pages(rng, 8)
        want = pool.kv[:, :, dev].copy()
        # The first Write naming a ready event is the loop's, which opens it and hands it to the plane.
        nbytes = 8 * PAGE * LAYOUT.token_bytes(torch.float16) * 2 * LAYERS
        assert c.write(host_indices=host, device_indices=dev, ready_event=READY) == nbytes
        assert gate.cuda_jobs == 0 and READY in client.device.plane_ready
        _scramble(pool, rng)  # other bytes for the plane to write
        want = pool.kv[:, :, dev].copy()
        rt.calls.clear()
        assert c.write(host_indices=host, device_indices=dev, ready_event=READY) == nbytes
        assert gate.cuda_jobs == 1, "the second Write was not the plane's"
        names = [call[0] for call in rt.calls]
        # On the stream: the wait on the engine's event, then the copies, then the write's own
        # event, created first, queried until it passed, then destroyed.
        assert names[0] == "eventCreateWithFlags" and rt.calls[0][1] == 1 | 2
        assert names[1] == "streamWaitEvent" and rt.calls[1][1] == fake_cupy.FakeRuntime.opened_id(READY)
        copies = [call for call in rt.calls if call[0] == "memcpyAsync"]
        assert len(copies) == 8 * 2 * LAYERS and {call[1] for call in copies} == {PAGE * 512}
        stream = client.device.stream.ptr
        assert {call[2] for call in copies} == {stream}
        assert names.index("eventRecord") > names.index("memcpyAsync") and names[-1] == "eventDestroy"
        pool.kv[:] = 0

        rt.calls.clear()
        handle = c.load(host_indices=host, device_indices=dev, event_slot=1)
        assert handle.wait() > 0
        assert gate.cuda_jobs == 2 and gate.cuda_kernel_jobs == 0  # by DMA
        assert np.array_equal(pool.kv[:, :, dev], want)
        assert not pool.kv[:, :, sorted(set(range(TOKENS)) - set(dev))].any()
        # Slot 1's layer events, each recorded after its layer's copies, in layer order.
        slot1 = client.device.events[LAYERS:]
        records = [call[1] for call in rt.calls if call[0] == "eventRecord"]
        assert records == slot1
        # A subset of layers: only theirs, and only their events.
        pool.kv[:] = 0
        rt.calls.clear()
        handle = c.load(host_indices=host[:PAGE], device_indices=dev[:PAGE], layers=[START + 1, START + 3])
        assert handle.wait() > 0 and handle.landed(START + 1) and handle.landed(START + 3)
        assert [call[1] for call in rt.calls if call[0] == "eventRecord"] == [client.device.events[1],
                                                                                client.device.events[3]]
        assert np.array_equal(pool.kv[[1, 3]][:, :, dev[:PAGE]], want[[1, 3]][:, :, :PAGE])
        assert not pool.kv[[0, 2]].any()
        # Both sides lay the host pages out alike: what the plane wrote, the loop loads (a gRPC
        # Load) into other device tokens.
        other = rng.permutation(TOKENS)[: 8 * PAGE].tolist()
        pool.kv[:] = 0
        jobs = gate.cuda_jobs
        with grpc.insecure_channel(d.address) as ch:
            steps = list(ticketing_stub(ch, d.address).Load(pb.LoadRequest(
                client_id=c.registration.client_id, host_indices=host, device_indices=other), timeout=10))
        assert steps[-1].done and gate.cuda_jobs == jobs and np.array_equal(pool.kv[:, :, other], want)
        assert fake.driver.errors == []
        st = c.stats().clients[0]
        assert st.transfers.write_ops == 2 and st.transfers.load_ops == 3


def test_many_small_rows_are_the_planes_kernel_launches(plane_daemon, fake) -> None:
    """Scattered tokens (2048 copies of 512 bytes: past the copies the plane issues one by one) are
    the copy kernel's, launched by the plane: one launch for a write, one a layer for a load, each
    layer's event after its launch, on the pool's stream; bit for bit both ways and against the
    loop's own kernel copy."""
    d, rt = plane_daemon, fake.cuda.runtime
    pool, rng = _random_pool(fake, 7)
    with _client(d, pool) as c:
        client = d.core.clients[c.registration.client_id]
        gate, stream = client.gate, client.device.stream.ptr
        host = c.alloc(TOKENS)
        dev = rng.permutation(TOKENS).tolist()
        want = pool.kv[:, :, dev].copy()
        rt.calls.clear()
        c.write(host_indices=host, device_indices=dev)
        kernels = [call for call in rt.calls if call[0] == "kernel"]
        assert gate.cuda_jobs == 1 and gate.cuda_kernel_jobs == 1 and len(kernels) == 1
        assert not any(call[0] == "memcpyAsync" for call in rt.calls)
        assert kernels[0][1:3] == (2 * LAYERS, TOKENS) and kernels[0][-1] == stream  # all (layer, part)s
        pool.kv[:] = 0
        rt.calls.clear()
        c.load(host_indices=host, device_indices=dev, event_slot=1).wait()
        names = [call[0] for call in rt.calls if call[0] in ("kernel", "eventRecord")]
        assert gate.cuda_jobs == gate.cuda_kernel_jobs == 2 and names == ["kernel", "eventRecord"] * LAYERS
        assert np.array_equal(pool.kv[:, :, dev], want)
        # The loop's kernel copy (a gRPC Load) reads what the plane's wrote, into other tokens.
        other = rng.permutation(TOKENS).tolist()
        pool.kv[:] = 0
        with grpc.insecure_channel(d.address) as ch:
            list(ticketing_stub(ch, d.address).Load(pb.LoadRequest(
                client_id=c.registration.client_id, host_indices=host, device_indices=other), timeout=10))
        assert gate.cuda_jobs == 2 and np.array_equal(pool.kv[:, :, other], want)
        assert {call[3] for call in rt.calls if call[0] == "kernel"} == {"kv_copy_rows"}  # 8-byte words
        assert fake.driver.errors == []


def test_the_planes_kernel_takes_the_widest_word_the_rows_allow(plane_daemon, fake) -> None:
    """Tokens of 6 bytes (1 head of 3 fp16 values): the 2-byte kernel, bit for bit."""
    d, rt = plane_daemon, fake.cuda.runtime
    pool, rng = _random_pool(fake, 8, layout=KVLayout.mha(1, 3))
    with _client(d, pool) as c:
        gate = d.core.clients[c.registration.client_id].gate
        host = c.alloc(TOKENS)
        dev = rng.permutation(TOKENS).tolist()
        want = pool.kv[:, :, dev].copy()
        rt.calls.clear()
        c.write(host_indices=host, device_indices=dev)
        pool.kv[:] = 0
        c.load(host_indices=host, device_indices=dev).wait()
        assert gate.cuda_jobs == 2 and np.array_equal(pool.kv[:, :, dev], want)
        assert {call[3] for call in rt.calls if call[0] == "kernel"} == {"kv_copy_rows_w2"}
        assert fake.driver.errors == []


def test_the_planes_dma_jobs_are_at_most_its_own_copy_limit(plane_daemon, fake, monkeypatch) -> None:
    """Large runs are the plane's DMA up to PLANE_DMA_MAX_COPIES copies a job (its calls are made
    on its one thread, and count against the queue bound), the copy kernel's past it, though the
    loop's DMA_MAX_COPIES would allow more."""
    monkeypatch.setattr(plan, "PLANE_DMA_MAX_COPIES", 16)
    monkeypatch.setattr(plan, "PLANE_SMALL_COPIES", 0)
    monkeypatch.setattr(plan, "DMA_MIN_CHUNK_BYTES", PAGE * 512)  # a run is a page's chunk
    d, rt = plane_daemon, fake.cuda.runtime
    pool, rng = _random_pool(fake, 10)
    with _client(d, pool) as c:
        gate = d.core.clients[c.registration.client_id].gate
        host = c.alloc(TOKENS)
        for pages, kernel in ((2, False), (4, True)):  # pages x 4 layers x 2 parts copies: 16, then 32
            dev = _pages(rng, pages)
            want = pool.kv[:, :, dev].copy()
            rt.calls.clear()
            c.write(host_indices=host[:PAGE * pages], device_indices=dev)
            pool.kv[:, :, dev] = 0
            c.load(host_indices=host[:PAGE * pages], device_indices=dev).wait()
            assert np.array_equal(pool.kv[:, :, dev], want), pages
            names = {call[0] for call in rt.calls}
            assert ("kernel" in names, "memcpyAsync" in names) == (kernel, not kernel), (pages, names)
        assert gate.cuda_jobs == 4 and gate.cuda_kernel_jobs == 2


def test_what_the_plane_does_not_take_of_a_cuda_pool_is_the_loops(plane_daemon, fake, monkeypatch) -> None:
    """A kernel job whose arguments do not fit the pool's area, and a ready event the loop has not
    opened, go to the loop, which answers alike."""
    monkeypatch.setattr(plan, "PLANE_ARGS_BYTES", 4096)  # 16 B a token and a (layer, part): 247 tokens
    d, rt = plane_daemon, fake.cuda.runtime
    pool, rng = _random_pool(fake, 6)
    with _client(d, pool) as c:
        gate = d.core.clients[c.registration.client_id].gate
        host = c.alloc(TOKENS)
        dev = rng.permutation(TOKENS).tolist()  # scattered tokens: 2048 copies of 512 bytes
        want = pool.kv[:, :, dev].copy()
        c.write(host_indices=host, device_indices=dev)
        assert gate.cuda_jobs == 0 and any(call[0] == "kernel" for call in rt.calls)
        pool.kv[:] = 0
        c.load(host_indices=host, device_indices=dev).wait()
        assert gate.cuda_jobs == 0 and np.array_equal(pool.kv[:, :, dev], want)
        c.load(host_indices=host[:128], device_indices=dev[:128]).wait()  # fits: the plane's kernel
        assert gate.cuda_jobs == 1
        # One page: the plane's (no ready event), then a new ready event: the loop's.
        c.write(host_indices=host[:PAGE], device_indices=list(range(PAGE)))
        assert gate.cuda_jobs == 2
        other = (777).to_bytes(8, "little") * 8
        c.write(host_indices=host[:PAGE], device_indices=list(range(PAGE)), ready_event=other)
        assert gate.cuda_jobs == 2
        c.write(host_indices=host[:PAGE], device_indices=list(range(PAGE)), ready_event=other)
        assert gate.cuda_jobs == 3
        # Bad input still gets the one validation's answer: a slot out of range.
        with pytest.raises(KVClientError, match="event_slot 2"):
            c.load(host_indices=host[:PAGE], device_indices=list(range(PAGE)), event_slot=2).wait()


def test_a_ready_event_that_never_fires_gives_the_pool_up_and_frees_it(daemon_factory, fake) -> None:
    """No progress for --cuda-wait-seconds: the call is answered DEADLINE_EXCEEDED, the client is
    failed and reclaimed, and its pool's release waits for the stream (the stand-in's: it drains
    once the event fires) or quarantines it."""
    d = _own_daemon(daemon_factory, cuda_wait_seconds=0.3, lease=60.0)
    rt = fake.cuda.runtime
    pool = FakeCudaPool(fake)
    with _client(d, pool) as c:
        client = d.core.clients[c.registration.client_id]
        gate = client.gate
        host = c.alloc(PAGE)
        c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)  # opened by the loop
        rt.hang(READY)
        t0 = time.monotonic()
        with pytest.raises(KVClientError) as got:
            c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)
        took = time.monotonic() - t0
        assert got.value.code.name == "DEADLINE_EXCEEDED" and "given up on" in str(got.value), got.value
        assert 0.25 < took < 5, took
        assert gate.cuda_jobs == 1 and "no progress" in gate.cuda_failed
        _until(lambda: c.registration.client_id not in d.core.clients)
        assert c.registration.client_id not in d.core.clients, "the failed client was not reclaimed"
        threading.Timer(0.2, rt.fire, (READY,)).start()
        _released(client.device)  # once its stream drained


def test_a_failed_copy_is_reported_once_what_went_on_the_stream_has_passed(plane_daemon, fake) -> None:
    d = plane_daemon
    pool = FakeCudaPool(fake)
    with _client(d, pool) as c:
        gate = d.core.clients[c.registration.client_id].gate
        host = c.alloc(2 * PAGE)
        fake.driver.fail_copy_after = 3
        with pytest.raises(KVClientError, match="CUresult 700"):
            c.write(host_indices=host, device_indices=list(range(2 * PAGE)))
        assert gate.cuda_jobs == 0  # counted once on the stream whole
        fake.driver.fail_copy_after = None
        pool.kv[:] = 9
        c.write(host_indices=host, device_indices=list(range(2 * PAGE)))  # the pool serves on
        pool.kv[:] = 0
        c.load(host_indices=host, device_indices=list(range(2 * PAGE))).wait()
        assert (pool.kv[:, :, : 2 * PAGE] == 9).all() and gate.cuda_jobs == 2


def test_the_compiled_check_of_a_cuda_pool_takes_nothing_the_validation_refuses(plane_daemon, fake) -> None:
    """Differential, as for shared memory (tests/test_dataplane.py), with a CUDA pool's own fields:
    its event slots and the ready event's length."""
    from kvserver.errors import KVError
    from kvserver.protocol import lane_request as LR

    d = plane_daemon
    rnd = random.Random(11)
    pool = FakeCudaPool(fake)
    with _client(d, pool) as c:
        host = c.alloc(TOKENS // 2).numpy()
        cid = c.registration.client_id
        client = d.core.clients[cid]
        taken = refused = 0
        for _ in range(300):
            pages = rnd.randint(1, 4)
            rows = host.reshape(-1, PAGE)
            h = np.concatenate([rows[rnd.randrange(len(rows))] for _ in range(pages)])
            dv = np.array(rnd.sample(range(TOKENS), pages * PAGE), dtype=np.int64)
            layers = sorted(rnd.sample(range(START, START + LAYERS), rnd.randint(0, 2)))
            slot = rnd.choice([0, 0, 1, 2, 3])
            ready = rnd.choice([b"", READY, READY[:63], READY + b"\x00"])
            data = LR.pack(rnd.choice([LR.KIND_WRITE, LR.KIND_LOAD]), h, dv, layers, PAGE, event_slot=slot,
                           ready_event=ready)
            if data is None:
                continue

            def judge(h=h, dv=dv, layers=layers, data=data, slot=slot, ready=ready) -> tuple[bool, str]:
                ok = client.gate.check(data)
                try:
                    client.device.check_request(ready, slot)
                    d.core.prepare(cid, h, dv, layers)
                except KVError as exc:
                    return ok, str(exc)
                return ok, ""

            ok, error = d.run(judge)
            assert not (ok and error), f"the compiled check took slot {slot}, ready {len(ready)} B: {error}"
            taken += ok
            refused += not ok
        assert taken > 50 and refused > 50


def _stuck_write_given_up(d, rt, c: KVClient, host, client) -> None:
    """A write of ``c`` whose ready event never fires is given up on, its client released; the
    event fired after that, its device let go."""
    rt.hang(READY)
    with pytest.raises(KVClientError, match="given up on"):
        c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)
    _until(lambda: c.registration.client_id not in d.core.clients)
    rt.fire(READY)
    _released(client.device)


def test_the_gpu_check_counts_what_the_plane_put_on_the_gpu(daemon_factory, fake, caplog, tmp_path) -> None:
    """scripts/gpu_check.py --plane-cuda proves the plane served, by DMA and by the copy kernel,
    and gave up the stuck engine's write itself, by what the daemon logs as it releases each CUDA
    client (its gate's cuda_jobs, cuda_kernel_jobs and cuda_failed), parsed from the daemon's log."""
    import logging
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import gpu_check

    d = _own_daemon(daemon_factory, cuda_wait_seconds=0.3, lease=60.0)
    rt = fake.cuda.runtime
    pool = FakeCudaPool(fake)
    with caplog.at_level(logging.INFO):
        with _client(d, pool) as c:
            host = c.alloc(TOKENS)
            for _ in range(3):  # by DMA
                c.write(host_indices=host[:2 * PAGE], device_indices=list(range(2 * PAGE)))
            c.load(host_indices=host[:2 * PAGE], device_indices=list(range(2 * PAGE))).wait()
            dev = np.random.default_rng(3).permutation(TOKENS).tolist()
            c.write(host_indices=host, device_indices=dev)  # by the copy kernel
            c.load(host_indices=host, device_indices=dev).wait()
            c.unregister()
        with _client(d, FakeCudaPool(fake)) as c:  # the stuck engine of the check's step 6
            stuck = c.registration.client_id[:8] + "..."  # as gpu_check's safety engine reports it
            client = d.core.clients[c.registration.client_id]
            host = c.alloc(PAGE)
            c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)  # the loop's
            _stuck_write_given_up(d, rt, c, host, client)
        with _client(d, FakeCudaPool(fake)) as c:  # stuck on the loop: its first write names the event
            client = d.core.clients[c.registration.client_id]
            _stuck_write_given_up(d, rt, c, c.alloc(PAGE), client)
    log = tmp_path / "daemon.log"
    log.write_text("\n".join(f"2026-12-05 INFO {r.name}: {r.getMessage()}" for r in caplog.records) + "\n")
    assert gpu_check.plane_cuda_counts(str(log)) == ({"calls": 7, "kernel_calls": 2}, {stuck})


def test_an_unregister_waits_for_the_gpu_to_finish_the_planes_copies(daemon_factory, fake) -> None:
    """A released client's CUDA jobs end only once the GPU is done with them (as the loop's do):
    the release waits for a copy held behind the engine's ready event, which then completes."""
    d = _own_daemon(daemon_factory, cuda_wait_seconds=10.0)
    rt = fake.cuda.runtime
    pool = FakeCudaPool(fake)
    c = _client(d, pool)
    try:
        host = c.alloc(PAGE)
        c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)  # opened by the loop
        gate = d.core.clients[c.registration.client_id].gate
        rt.hang(READY)
        ended: dict = {}
        writer = _writer(c, ended, "w", host_indices=host, device_indices=list(range(PAGE)),
                         ready_event=READY)
        _until(lambda: gate.cuda_jobs >= 1)
        assert gate.cuda_jobs == 1 and gate.inflight == 1
        unregister = threading.Thread(target=c.unregister)
        unregister.start()
        _until(lambda: gate.closed)
        assert gate.closed
        time.sleep(0.3)
        assert gate.inflight == 1, "the released client's copy ended while the GPU still held it"
        assert unregister.is_alive()
        rt.fire(READY)
        unregister.join(10)
        writer.join(10)
        # (The writer's answer is its client's: an unregister closes the lane under its calls.)
        assert not unregister.is_alive() and gate.inflight == 0 and "w" in ended
    finally:
        rt.fire(READY)
        c.close()


def test_a_pool_given_up_on_gives_up_its_other_copies_at_once(daemon_factory, fake) -> None:
    d = _own_daemon(daemon_factory, cuda_wait_seconds=1.0, lease=60.0)
    rt = fake.cuda.runtime
    pool = FakeCudaPool(fake)
    with _client(d, pool) as c:
        host = c.alloc(2 * PAGE)
        c.write(host_indices=host, device_indices=list(range(2 * PAGE)), ready_event=READY)
        device = d.core.clients[c.registration.client_id].device
        rt.hang(READY)
        ended: dict[str, tuple[float, object]] = {}
        t0 = time.monotonic()
        a = _writer(c, ended, "a", t0, host_indices=host[:PAGE], device_indices=list(range(PAGE)),
                    ready_event=READY)
        time.sleep(0.6)
        b = _writer(c, ended, "b", t0, host_indices=host[PAGE:], device_indices=list(range(PAGE)),
                    ready_event=READY)  # behind a on the stream
        a.join(10)
        b.join(10)
        rt.fire(READY)
        for name in "ab":
            took, got = ended[name]
            assert isinstance(got, KVClientError) and got.code.name == "DEADLINE_EXCEEDED", (name, got)
        # b was given up with a, not a whole deadline after its own start (0.6 s after a's).
        assert ended["b"][0] - ended["a"][0] < 0.35, ended
        _released(device)


def test_a_stalled_stream_takes_no_more_of_the_planes_calls_than_its_bound(daemon_factory, fake,
                                                                            monkeypatch) -> None:
    """Behind an engine's event that never fires, a pool's stream takes no more driver calls from
    the plane than PLANE_MAX_QUEUED (a full driver queue would hold the plane's thread, for every
    engine): the next call is the loop's, whose turn waits behind the plane's and fails with it."""
    monkeypatch.setattr(plan, "PLANE_MAX_QUEUED", 100)  # a write of 8 pages: 8 runs x 4 layers x 2 parts + 2
    d = _own_daemon(daemon_factory, cuda_wait_seconds=1.0, lease=60.0)
    rt = fake.cuda.runtime
    pool = FakeCudaPool(fake)
    with _client(d, pool) as c:
        host = c.alloc(16 * PAGE)
        c.write(host_indices=host[:PAGE], device_indices=list(range(PAGE)), ready_event=READY)
        gate = d.core.clients[c.registration.client_id].gate
        device = d.core.clients[c.registration.client_id].device
        rt.hang(READY)
        ended: dict[str, tuple[float, object]] = {}
        a = _writer(c, ended, "a", host_indices=host[:8 * PAGE], device_indices=list(range(8 * PAGE)),
                    ready_event=READY)
        _until(lambda: gate.cuda_jobs >= 1)
        b = _writer(c, ended, "b", host_indices=host[8 * PAGE:], device_indices=list(range(8 * PAGE)),
                    ready_event=READY)
        a.join(10)
        b.join(10)
        rt.fire(READY)
        assert gate.cuda_jobs == 1, "the plane put a second job on the stalled stream"
        for name in "ab":
            got = ended[name][1]
            assert isinstance(got, KVClientError) and got.code.name == "DEADLINE_EXCEEDED", ended
        _released(device)


def test_the_kernels_argument_area_is_a_ring_reused_once_its_jobs_end(plane_daemon, fake,
                                                                      monkeypatch) -> None:
    """Spans of the pool's argument area go back as their jobs end, and are written again only
    then: round after round of kernel jobs wraps the area, each bit for bit; jobs held behind an
    engine's event keep theirs, and one that finds no room is the loop's."""
    monkeypatch.setattr(plan, "PLANE_ARGS_BYTES", 8192)  # 128 tokens, 4 layers x 2 parts: 2176 bytes a job
    d, rt = plane_daemon, fake.cuda.runtime
    pool = FakeCudaPool(fake)
    rng = np.random.default_rng(9)
    with _client(d, pool) as c:
        gate = d.core.clients[c.registration.client_id].gate
        host = c.alloc(TOKENS)
        for round_ in range(8):
            _scramble(pool, rng)
            dev = rng.permutation(TOKENS)[:128].tolist()
            hosts = host[(round_ % 2) * 128:(round_ % 2 + 1) * 128]
            want = pool.kv[:, :, dev].copy()
            c.write(host_indices=hosts, device_indices=dev)
            pool.kv[:] = 0
            c.load(host_indices=hosts, device_indices=dev).wait()
            assert np.array_equal(pool.kv[:, :, dev], want), round_
        assert gate.cuda_jobs == 16
        # Three writes held behind the engine's event hold three spans; a fourth finds no room.
        c.write(host_indices=host[:PAGE], device_indices=list(range(PAGE)), ready_event=READY)  # opened
        jobs = gate.cuda_jobs
        rt.hang(READY)
        ended: dict[str, tuple[float, object]] = {}

        def write(i: int) -> threading.Thread:
            return _writer(c, ended, str(i), host_indices=host[(i % 2) * 128:(i % 2 + 1) * 128],
                           device_indices=rng.permutation(TOKENS)[:128].tolist(), ready_event=READY)

        threads = [write(i) for i in range(3)]
        _until(lambda: gate.cuda_jobs >= jobs + 3)
        assert gate.cuda_jobs == jobs + 3
        threads.append(write(3))  # the loop's: it waits for its turn behind the plane's three
        time.sleep(0.2)
        assert gate.cuda_jobs == jobs + 3
        rt.fire(READY)
        for t in threads:
            t.join(10)
        assert gate.cuda_jobs == jobs + 3 and gate.inflight == 0
        assert [ended[str(i)][1] for i in range(4)] == [128 * 512 * 2 * LAYERS] * 4, ended
        _scramble(pool, rng)  # and the ring serves on
        dev = rng.permutation(TOKENS)[:128].tolist()
        want = pool.kv[:, :, dev].copy()
        c.write(host_indices=host[:128], device_indices=dev)
        pool.kv[:] = 0
        c.load(host_indices=host[:128], device_indices=dev).wait()
        assert np.array_equal(pool.kv[:, :, dev], want) and gate.cuda_jobs == jobs + 5


def test_the_kernels_functions_given_the_plane_outlive_cupys_caches(monkeypatch) -> None:
    """A CUfunction the plane launches is valid only while its module is loaded, which its CuPy
    Function keeps: driver.kernel_functions keeps them, whatever CuPy's caches drop (CuPy 13 may
    drop a module two threads compiled at once), and loads them once per device."""
    import gc
    import weakref

    from kvserver.media.cuda import driver, kernels

    made: list[weakref.ref] = []

    class Function:  # unloads its module when it goes
        def __init__(self) -> None:
            self.ptr = id(self)
            made.append(weakref.ref(self))

    class Kernel:
        def __init__(self, source: str, name: str) -> None:
            self.name = name

        @property
        def kernel(self) -> Function:  # as a cache that forgot its module would give it
            return Function()

    class Cupy:
        RawKernel = Kernel

        class cuda:  # noqa: N801 - CuPy's name
            Device = staticmethod(lambda ordinal: threading.Lock())

    monkeypatch.setattr(driver, "_plane_kernels", {})
    try:
        got = [driver.kernel_functions(Cupy(), 3) for _ in range(2)]  # the second: no load again
        gc.collect()
        assert len(made) == 4 and all(ref() is not None for ref in made)
        assert got[0] == got[1] == tuple(ref().ptr for ref in made)
    finally:
        kernels.copy_rows_kernel.cache_clear()  # its cache holds the stand-ins


def test_the_plane_takes_nothing_of_a_pool_the_loop_gave_up_on(daemon_factory, fake, monkeypatch):
    """The loop's writes of engine A, behind a ready event that never fires, are given up on at
    --cuda-wait-seconds: their calls stay on A's stream, and their plane turns end with them. Before
    the reaper's next tick closed A's gate, the plane took A's next lane writes onto that stream,
    past what its own bound counts; with the stand-in's queue depth reached, the plane's thread
    waited in a driver call and every engine's lane with it. The plane now takes no job of a pool
    the loop gave up on: those calls are the loop's, which refuses them at once."""
    from kvserver.core.liveness import Reaper

    monkeypatch.setattr(plan, "MAX_QUEUED", 40)
    monkeypatch.setattr(plan, "PLANE_MAX_QUEUED", 40)
    monkeypatch.setattr(Reaper, "reap_once", lambda self: [])  # the window before A is reclaimed
    d = _own_daemon(daemon_factory, cuda_wait_seconds=1.0, lease=60.0)
    rt = fake.cuda.runtime
    rt.queue_depth = 48
    pool_a, pool_b = FakeCudaPool(fake), FakeCudaPool(fake)
    with _client(d, pool_a) as a, _client(d, pool_b) as b, grpc.insecure_channel(d.address) as ch:
        stub = ticketing_stub(ch, d.address)
        cid = a.registration.client_id
        host = a.alloc(8 * PAGE)
        host_b = b.alloc(PAGE)
        a.write(host_indices=host[:PAGE], device_indices=list(range(PAGE)), ready_event=READY)  # opened
        device, gate = d.core.clients[cid].device, d.core.clients[cid].gate
        stream = device.stream.ptr
        rt.hang(READY)
        try:
            codes: list[str] = []

            def loop_write(k: int) -> None:  # on gRPC: the loop's
                try:
                    stub.Write(pb.WriteRequest(client_id=cid, host_indices=host[k * PAGE:(k + 1) * PAGE],
                                               device_indices=list(range(k * PAGE, (k + 1) * PAGE)),
                                               ready_event=READY), timeout=20)
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)

            writers = [threading.Thread(target=loop_write, args=(k,)) for k in range(4)]
            for t in writers:
                t.start()
                time.sleep(0.05)
            for t in writers:
                t.join(10)
            assert codes == ["DEADLINE_EXCEEDED"] * 4 and device.failed
            left, jobs = rt.outstanding(stream), gate.cuda_jobs
            ended: dict = {}
            lane_writes = [_writer(a, ended, f"a{k}", host_indices=host[(4 + k) * PAGE:(5 + k) * PAGE],
                                   device_indices=list(range((4 + k) * PAGE, (5 + k) * PAGE)),
                                   ready_event=READY) for k in range(2)]
            for t in lane_writes:
                t.join(10)
            assert gate.cuda_jobs == jobs and rt.outstanding(stream) == left  # nothing more on A's stream
            assert all(isinstance(v[1], KVClientError) for v in ended.values()), ended
            t0 = time.monotonic()
            b.write(host_indices=host_b, device_indices=list(range(PAGE)))
            assert time.monotonic() - t0 < 1.0
        finally:
            rt.fire(READY)


def test_a_planes_cuda_write_whose_event_fires_after_its_deadline_is_not_done(plane_daemon, fake) -> None:
    """The plane's own CUDA Write waits on the GPU for the engine's ready event, which fires after
    the Write's timeout_ms (within --cuda-wait-seconds and the client's own wait): the copy, seen
    done only then, ended late, so it is answered DEADLINE_EXCEEDED and not counted done; the
    next Write, in time, is."""
    d, rt = plane_daemon, fake.cuda.runtime
    pool = FakeCudaPool(fake)
    c = KVClient(d.address, timeout=0.3, resilient=False)
    c.register(model="gpu", pool=pool, start_layer=START, end_layer=START + LAYERS, num_layers=16,
               host_tokens=TOKENS, page_size=PAGE, event_slots=2)
    try:
        gate = d.core.clients[c.registration.client_id].gate
        host = c.alloc(PAGE)
        c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)  # the loop opens it
        jobs = gate.cuda_jobs
        rt.hang(READY)
        out: dict = {}

        def write() -> None:
            try:
                out["got"] = c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY)
            except KVClientError as exc:
                out["got"] = exc

        t = threading.Thread(target=write)
        t.start()
        deadline = time.monotonic() + 10
        while gate.cuda_jobs == jobs:  # on the GPU, waiting for the event: its deadline runs from before
            assert time.monotonic() < deadline, "the plane did not put the Write on the GPU"
            time.sleep(0.005)
        time.sleep(0.5)  # past its timeout_ms (0.3 s), within the client's wait (0.3 s + 1 s)
        rt.fire(READY)
        t.join(10)
        assert gate.cuda_jobs - jobs == 1, "not the plane's"
        assert isinstance(out["got"], KVClientError) and out["got"].code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "copy ended after its timeout_ms" in out["got"].message
        assert c.write(host_indices=host, device_indices=list(range(PAGE)), ready_event=READY) > 0
    finally:
        rt.fire_all()
        c.close()
