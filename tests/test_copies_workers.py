"""Prefetch before offload: the copy workers' queues take loads first, cut jobs in pieces so that a
load waits for at most one piece of an offload, use every idle worker for a large job's pieces,
and never starve writes.

The queue is driven directly with pieces that wait on gates (the order is then exact, not timed);
the daemon's shared-memory copies are then checked bit for bit with pieces made tiny, on one and
two workers, whole layers and split rows, and a small load is shown to overtake a large offload.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import DaemonThread
from test_e2e_roundtrip import fill_random, raw, scattered_slots, snapshot, wipe

from kvclient import KVClient, KVLayout, ShmKVPool
from kvserver.config import ServerConfig
from kvserver.copies import workers as copy_queue
from kvserver.copies.workers import WRITE_EVERY, CopyQueue, Work

WAIT = 10.0


class Gated:
    """A work whose piece i runs only once gate i opens; it logs (name, i) as each piece starts."""

    def __init__(self, name: str, pieces: int, log: list, load: bool = False, parallel: bool = False,
                 gated: bool = True) -> None:
        self.gates = [threading.Event() for _ in range(pieces)]
        if not gated:
            for g in self.gates:
                g.set()
        self.started = [threading.Event() for _ in range(pieces)]
        self.finished = 0
        self.stop = False

        def run(i: int) -> None:
            log.append((name, i))
            self.started[i].set()
            assert self.gates[i].wait(WAIT), f"gate {i} of {name} never opened"

        def finish() -> str:
            self.finished += 1
            return name

        self.work = Work(load, pieces, run, finish, parallel=parallel, stopping=lambda i: self.stop)

    def open_all(self) -> None:
        for g in self.gates:
            g.set()


@pytest.fixture
def queue():
    q = CopyQueue(1)
    yield q
    q.shutdown()


def test_a_load_waits_for_one_piece_of_an_offload_not_all_of_it(queue):
    log: list = []
    offload = Gated("write", 4, log)
    queue.submit_work(offload.work)
    assert offload.started[0].wait(WAIT)
    load = Gated("load", 1, log, load=True, gated=False)
    fut = queue.submit_work(load.work)
    offload.gates[0].set()  # the piece running when the load came ends
    assert fut.result(WAIT) == "load"
    assert log[:2] == [("write", 0), ("load", 0)]
    offload.open_all()
    assert offload.work.future.result(WAIT) == "write"
    assert [i for name, i in log if name == "write"] == [0, 1, 2, 3]
    assert offload.finished == 1


def test_loads_go_first_in_arrival_order_and_writes_are_not_starved(queue):
    log: list = []
    blocker = Gated("hold", 1, log)
    queue.submit_work(blocker.work)
    assert blocker.started[0].wait(WAIT)
    write = Gated("write", 1, log, gated=False)
    queue.submit_work(write.work)
    loads = [Gated(f"load{i}", 1, log, load=True, gated=False) for i in range(WRITE_EVERY + 3)]
    for g in loads:
        queue.submit_work(g.work)
    blocker.open_all()
    for g in loads:
        g.work.future.result(WAIT)
    write.work.future.result(WAIT)
    order = [name for name, _ in log[1:]]
    assert order[:WRITE_EVERY] == [f"load{i}" for i in range(WRITE_EVERY)]
    assert order[WRITE_EVERY] == "write"  # its turn after WRITE_EVERY loads in a row
    assert order[WRITE_EVERY + 1:] == [f"load{i}" for i in range(WRITE_EVERY, WRITE_EVERY + 3)]


def test_a_cancelled_work_never_runs_and_a_stopped_one_ends_after_its_piece(queue):
    log: list = []
    blocker = Gated("hold", 1, log)
    queue.submit_work(blocker.work)
    assert blocker.started[0].wait(WAIT)
    dropped = Gated("dropped", 2, log, gated=False)
    assert queue.submit_work(dropped.work).cancel()
    stopped = Gated("stopped", 3, log)
    queue.submit_work(stopped.work)
    blocker.open_all()
    assert stopped.started[0].wait(WAIT)
    stopped.stop = True
    stopped.gates[0].set()
    assert stopped.work.future.result(WAIT) == "stopped"  # its finish says what a stop means
    assert ("dropped", 0) not in log and [e for e in log if e[0] == "stopped"] == [("stopped", 0)]
    assert dropped.finished == 0 and stopped.finished == 1


def test_a_failed_piece_is_the_outcome_and_no_later_piece_runs(queue):
    log: list = []

    def run(i: int) -> None:
        log.append(i)
        if i == 1:
            raise OSError("piece 1 broke")

    work = Work(False, 4, run, finish=lambda: pytest.fail("finish runs only for work that did not fail"))
    with pytest.raises(OSError, match="piece 1 broke"):
        queue.submit_work(work).result(WAIT)
    assert log == [0, 1]
    assert queue.submit(lambda: 7).result(WAIT) == 7  # the worker goes on


def test_parallel_pieces_use_every_worker_and_ordered_ones_never_overlap():
    """A load's parallel pieces run on both workers at once (a write's take one worker, leaving
    the other core to the event loop: see the next test); an ordered work's never overlap."""
    q = CopyQueue(2)
    try:
        log: list = []
        wide = Gated("wide", 2, log, load=True, parallel=True)
        q.submit_work(wide.work)
        assert wide.started[0].wait(WAIT) and wide.started[1].wait(WAIT)  # both at once
        wide.open_all()
        wide.work.future.result(WAIT)

        running, most = [0], [0]
        lock = threading.Lock()

        def run(i: int) -> None:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.002)
            with lock:
                running[0] -= 1

        q.submit_work(Work(True, 6, run)).result(WAIT)
        assert most[0] == 1
    finally:
        q.shutdown()


def test_writes_take_one_worker_and_wait_while_a_load_copies():
    """On two workers, a write's parallel pieces run one at a time, and while a load's piece
    copies no write piece starts (the bandwidth, and a core for the loop, go to the load)."""
    q = CopyQueue(2)
    try:
        log: list = []
        write = Gated("write", 3, log, parallel=True)
        q.submit_work(write.work)
        assert write.started[0].wait(WAIT)
        time.sleep(0.05)
        assert not write.started[1].is_set(), "a second worker took a write piece"
        load = Gated("load", 1, log, load=True)
        q.submit_work(load.work)
        assert load.started[0].wait(WAIT)  # on the free worker, while the write's piece runs
        write.gates[0].set()
        time.sleep(0.05)
        assert not write.started[1].is_set(), "a write piece started while a load copied"
        load.open_all()
        write.open_all()
        assert write.work.future.result(WAIT) == "write" and load.work.future.result(WAIT) == "load"
    finally:
        q.shutdown()


# ---- the daemon's copies in pieces -------------------------------------------------------------

LAYOUT = KVLayout.mha(2, 8)  # 2 heads x 8 x fp16: 32 B a token and part
LAYERS = 8
POOL = 512
WIDE = KVLayout.mha(4, 8)  # 64 B a token and part


@pytest.fixture(params=[(1, 1 << 20), (2, 4096), (2, 64)], ids=["1w-layers", "2w-split", "2w-rows"])
def pieced_daemon(request, socket_dir, monkeypatch):
    """A daemon whose copies are cut in tiny pieces: (workers, piece bytes). 4 KiB pieces group
    whole layers or split them; 64 B pieces split every layer's rows many times."""
    threads, chunk = request.param
    monkeypatch.setattr(copy_queue, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(copy_queue, "MIN_RANGE_BYTES", 1)
    monkeypatch.setattr(copy_queue, "PARALLEL_BYTES", 0 if threads > 1 else 1 << 40)
    d = DaemonThread(ServerConfig(socket=f"{socket_dir}/kv.sock", host_memory=64 << 20, copy_threads=threads))
    yield d
    d.stop()


@pytest.mark.parametrize("page_size", [1, 16])
def test_pieced_copies_are_bit_exact_and_layers_land_in_order(pieced_daemon, page_size, monkeypatch):
    from kvserver.copies.progress import LayerSignal

    published: list[int] = []
    real_publish = LayerSignal.publish

    def publish(self, layers_done: int) -> None:
        time.sleep(0.0005)  # widens any window in which two workers could publish out of order
        published.append(layers_done)
        real_publish(self, layers_done)

    monkeypatch.setattr(LayerSignal, "publish", publish)
    n = 256
    with ShmKVPool(LAYOUT, torch.float16, LAYERS, POOL) as pool, KVClient(pieced_daemon.address) as client:
        client.register(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                        host_tokens=n, page_size=page_size)
        fill_random(pool, 1)
        src = scattered_slots(n, page_size, 2)
        before = [[b[src] for b in layer] for layer in token_rows(pool)]
        host = client.alloc(n)
        assert client.write(host_indices=host, device_indices=src) == n * 32 * 2 * LAYERS
        wipe(pool)
        dst = scattered_slots(n, page_size, 3)
        handle = client.load(host_indices=host, device_indices=dst)
        seen = []
        for layer in range(LAYERS):
            assert handle.wait_layer(layer, WAIT)
            seen.append(layer)
            got = [b[dst] for b in token_rows(pool)[layer]]
            assert all(torch.equal(g, e) for g, e in zip(got, before[layer], strict=True)), layer
        assert handle.wait() > 0
        assert seen == list(range(LAYERS))
        assert published == sorted(published), f"progress went back: {published}"


def token_rows(pool: ShmKVPool) -> list[list[torch.Tensor]]:
    """A copy of each buffer as [tokens, bytes a token]."""
    return [[raw(b).view(POOL, -1) for b in layer] for layer in snapshot(pool)]


def test_a_small_load_overtakes_a_large_offload(socket_dir, monkeypatch):
    """One worker, held while an offload of 64 MiB in 256 KiB pieces and then a 1-page load of
    another engine queue up: once the worker is free, the load's copy is the first it makes."""
    from kvserver.copies import transfer

    monkeypatch.setattr(copy_queue, "CHUNK_BYTES", 256 << 10)
    monkeypatch.setattr(copy_queue, "MIN_RANGE_BYTES", 256 << 10)
    made: list[bool] = []  # to_device of each kernel call, in order
    real = transfer.RowCopier.copy

    def recorded(self, *args):
        made.append(self.to_device)
        return real(self, *args)

    monkeypatch.setattr(transfer.RowCopier, "copy", recorded)
    d = DaemonThread(ServerConfig(socket=f"{socket_dir}/kv.sock", host_memory=256 << 20, copy_threads=1))
    big_layout = KVLayout.mha(8, 128)  # 2 KiB a token and part
    tokens = 16384  # x 2 KiB x (K, V): 64 MiB
    try:
        # On gRPC: these are the copy workers' copies (the lane's go to the compiled data plane,
        # whose own order tests/test_dataplane.py checks).
        with ShmKVPool(big_layout, torch.float16, 1, tokens) as pool, \
                KVClient(d.address, lane="grpc") as big, \
                ShmKVPool(big_layout, torch.float16, 1, 64) as small_pool, \
                KVClient(d.address, lane="grpc") as small:
            big.register(model="big", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                         host_tokens=tokens, page_size=16)
            small.register(model="small", pool=small_pool, start_layer=0, end_layer=1, num_layers=1,
                           host_tokens=64, page_size=16)
            host_small = small.alloc(16)
            assert small.write(host_indices=host_small, device_indices=torch.arange(16)) > 0
            host_big = big.alloc(tokens)
            gate = threading.Event()
            d.core.copier._executor.submit(gate.wait, WAIT)  # the one worker is busy: both queue up
            done: dict = {}

            def offload() -> None:
                done["bytes"] = big.write(host_indices=host_big, device_indices=torch.arange(tokens))

            t = threading.Thread(target=offload)
            t.start()
            while d.run(lambda: d.core.copier.queued) < 1:  # the offload waits behind the hold
                time.sleep(0.001)
            handle = small.load(host_indices=host_small, device_indices=torch.arange(16, 32))
            while d.run(lambda: d.core.copier.queued) < 2:
                time.sleep(0.001)
            assert d.run(d.core.copier.waiting) == (1, 1)  # what kvserver_copies_waiting shows
            made.clear()
            gate.set()
            assert handle.wait() > 0
            t.join(60)
            assert done["bytes"] == tokens * 2048 * 2
            assert made[0] is True, "the offload's pieces went before the load"
            assert made.count(False) == 256  # the offload, in its 256 KiB pieces
    finally:
        d.stop()


def test_a_load_after_a_write_of_the_same_pages_reads_what_it_stored(socket_dir):
    """Loads go first, but not past a write of their client they depend on: queued behind a
    write of the same host pages, a load reads what that write stores."""
    d = DaemonThread(ServerConfig(socket=f"{socket_dir}/kv.sock", host_memory=64 << 20, copy_threads=1))
    try:
        with ShmKVPool(WIDE, torch.float16, LAYERS, 2 * POOL) as pool, KVClient(d.address, lane="grpc") as c:
            c.register(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                       host_tokens=POOL, page_size=16)
            a, b = torch.arange(POOL), torch.arange(POOL, 2 * POOL)  # 512 KiB each: never inline
            host = c.alloc(POOL)
            for layer in pool.buffers:
                for buf in layer:
                    buf[a] = 1
            assert c.write(host_indices=host, device_indices=a) > 0  # the host pages hold 1s
            for layer in pool.buffers:
                for buf in layer:
                    buf[a] = 2
            gate = threading.Event()
            d.core.copier._executor.submit(gate.wait, WAIT)
            t = threading.Thread(target=lambda: c.write(host_indices=host, device_indices=a))
            t.start()
            while d.run(lambda: d.core.copier.queued) < 1:
                time.sleep(0.001)
            handle = c.load(host_indices=host, device_indices=b)
            while d.run(lambda: d.core.copier.queued) < 2:
                time.sleep(0.001)
            gate.set()
            assert handle.wait() > 0
            t.join(30)
            assert all(bool((buf[b] == 2).all()) for layer in pool.buffers for buf in layer), (
                "the load read the pages before the write queued ahead of it")
    finally:
        d.stop()


def test_a_load_stopped_between_pieces_lands_no_later_layer(socket_dir, monkeypatch):
    """A load whose layers are split in pieces, its first piece of layer 1 held until the job's
    deadline stopped it: it is reported missed (and confirmed); layer 1, begun, is finished (a job
    stops at a layer boundary, never with a layer half copied) and no later layer is touched."""
    from kvserver.copies import transfer

    monkeypatch.setattr(copy_queue, "CHUNK_BYTES", 64)  # every layer in many row pieces
    monkeypatch.setattr(copy_queue, "MIN_RANGE_BYTES", 1)
    held = threading.Event()
    real = transfer.RowCopier.copy
    calls = [0]

    def slow_at_layer_1(self, lo, hi, *args):
        if (lo, hi) == (1, 2) and self.to_device:  # a load's layer 1
            calls[0] += 1
            if calls[0] == 1:  # a piece that takes until the job's deadline has passed
                held.set()
                deadline = time.monotonic() + WAIT
                while not stopped() and time.monotonic() < deadline:
                    time.sleep(0.005)
        return real(self, lo, hi, *args)

    def stopped() -> bool:  # read from the copy worker: a glance at the daemon's jobs
        return any(j.stopping for c in list(d.core.clients.values()) for j in list(c.jobs))

    monkeypatch.setattr(transfer.RowCopier, "copy", slow_at_layer_1)
    d = DaemonThread(ServerConfig(socket=f"{socket_dir}/kv.sock", host_memory=64 << 20, copy_threads=1))
    try:
        # On gRPC: the copy workers' pieces (the plane's own stop at a layer boundary is
        # tests/test_dataplane.py's).
        with ShmKVPool(WIDE, torch.float16, LAYERS, POOL) as pool, \
                KVClient(d.address, timeout=0.5, lane="grpc") as c:
            c.register(model="m", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                       host_tokens=POOL, page_size=16)
            fill_random(pool, 5)
            dev = torch.arange(POOL)  # 512 KiB: too large to copy inline
            host = c.alloc(POOL)
            assert c.write(host_indices=host, device_indices=dev) > 0
            stored = token_rows(pool)
            wipe(pool)
            handle = c.load(host_indices=host, device_indices=dev)
            assert held.wait(WAIT)
            assert handle.wait() == 0 and handle.missed  # its deadline passed while held
            assert handle.confirmed and c.connected
            while d.run(lambda: any(cl.inflight for cl in d.core.clients.values())):
                time.sleep(0.01)
            after = token_rows(pool)
            for layer in (0, 1):
                assert all(torch.equal(a, b) for a, b in zip(after[layer], stored[layer], strict=True))
            for layer in range(2, LAYERS):
                assert all(not b.any() for b in after[layer]), f"layer {layer} landed after the miss"
    finally:
        d.stop()


def test_shutdown_runs_what_is_queued_and_wakes_every_worker():
    """A worker waiting while another runs the pieces of an ordered work is woken when that work
    ends: shutdown returns once the queued work is done."""
    q = CopyQueue(2)
    log: list = []
    ordered = Gated("ordered", 3, log)
    q.submit_work(ordered.work)
    assert ordered.started[0].wait(WAIT)
    t = threading.Thread(target=q.shutdown, daemon=True)
    t.start()
    ordered.open_all()
    assert ordered.work.future.result(WAIT) == "ordered"
    t.join(WAIT)
    assert not t.is_alive(), "shutdown hung"
    assert [i for _, i in log] == [0, 1, 2]


def test_a_dense_jobs_order_is_the_order_of_its_scattered_marks():
    """A job of many pages is marked by whole-array adds (``dense_marks``, made off
    the loop) instead of a scattered update an index: which earlier jobs each job waits for, and
    the marks left, are the same either way, repeats and loads past writes included."""
    from types import SimpleNamespace

    from kvserver.copies.order import JobOrder, dense_marks

    rng = np.random.default_rng(3)
    region, tokens, page = 64, 256, 4

    def job(dense: bool, n: int):
        pages = rng.integers(0, region, rng.integers(1, 40))
        rows = rng.integers(0, tokens, len(pages))
        j = SimpleNamespace(pages=pages, plan=SimpleNamespace(device_pages=None, device_rows=rows,
                                                               page_size=page), dense=None, load=False, n=n)
        if dense:
            j.dense = dense_marks(j, region, tokens, page)
        return j

    for _ in range(20):
        plain, dense = JobOrder(region, tokens, page), JobOrder(region, tokens, page)
        live: list[tuple] = []
        for n in range(30):
            if live and rng.random() < 0.3:
                a, b = live.pop(rng.integers(len(live)))
                plain.finished(a)
                dense.finished(b)
                continue
            state = rng.bit_generator.state
            a = job(False, n)
            rng.bit_generator.state = state
            b = job(True, n)
            load = bool(rng.random() < 0.5)
            assert [x.n for x in plain.admit(a, load)] == [x.n for x in dense.admit(b, load)]
            live.append((a, b))
        assert all(np.array_equal(x, y) for x, y in zip(plain.arrays(), dense.arrays(), strict=True))


def test_only_a_job_of_a_large_share_of_the_clients_pages_is_marked_densely(monkeypatch):
    """Dense marks cost the loop a pass over the client's whole arrays, and memory as large: a job
    of 64 Ki pages in a region of 16 Mi was marked densely (16-24 ms a pass against 2 ms scattered,
    and 64 MiB a job). A job is marked densely only where it names at least one in ``DENSE_SHARE``
    of the region's pages and of the pool's slots; and the arrays' pages are faulted in by pieces
    (each call holds the process's mapping lock)."""
    from types import SimpleNamespace

    from kvserver.copies import order
    from kvserver.host import arena

    def job(pages: int, rows: int):
        return SimpleNamespace(pages=np.arange(pages), plan=SimpleNamespace(
            device_pages=None, device_rows=np.arange(rows), page_size=1))

    big = order.DENSE_PAGES + 1
    assert order.dense_pays(job(big, big), big, big, 1)
    assert not order.dense_pays(job(big, big), 16 << 20, big, 1)  # a small share of the region
    assert not order.dense_pays(job(big, big), big, 16 << 20, 1)  # ... of the pool's slots
    assert not order.dense_pays(job(order.DENSE_PAGES, order.DENSE_PAGES), 1024, 1024, 1)
    calls = []
    monkeypatch.setattr(arena, "_libc", SimpleNamespace(madvise=lambda at, n, advice: calls.append(n) or 0))
    arena.populate(np.zeros(3 * arena.POPULATE_PIECE // 4 + 5 * 4096, np.int32))
    assert calls and max(calls) <= arena.POPULATE_PIECE and len(calls) >= 3, calls
