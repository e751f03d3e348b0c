"""The device-pool interface (kvserver/media): every medium implements all of it, and copy jobs
whose host side is the node-wide cache's table (rows are byte offsets into the arena, no client
pages) move bytes exactly in both media, through the daemon's own copier.

The CUDA medium runs on tests/fake_cupy.py, which refuses rows in host memory that is not
registered with the GPU: cache slabs must be pinned (``SlabPinner``) for its copies to run.
"""

from __future__ import annotations

import pathlib
import re
import typing

import fake_cupy
import grpc
import numpy as np
import pytest
import torch
from checks import wait_until
from kernel_host import compiler
from test_media_cuda_fake import cuda_pool, register
from ticketing import ticketing_stub

from kvclient import KVClient, KVLayout, ShmKVPool
from kvserver import media
from kvserver.copies import transfer
from kvserver.core import kvcore as core_module
from kvserver.core.cache_ops import cache_table
from kvserver.core.copier import ClientJob as Job
from kvserver.errors import FailedPrecondition, GpuStalled, InvalidArgument
from kvserver.media.base import INLINE, DevicePool
from kvserver.media.cuda import SlabPinner
from kvserver.media.shm import ShmDevicePool

LAYERS, TOKENS, PAGE = 4, 256, 16
HEADS, HEAD_DIM = 2, 128  # fp16: 512 bytes per token and part
needs_kernel = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) to build the copy kernel")


@pytest.fixture
def fake(monkeypatch):
    return fake_cupy.install(monkeypatch)


def shm_client(daemon) -> tuple[str, ShmKVPool, KVClient]:
    """A shared-memory registration of the test geometry."""
    pool = ShmKVPool(KVLayout.mha(HEADS, HEAD_DIM), torch.float16, num_layers=LAYERS, num_tokens=TOKENS)
    client = KVClient(daemon.address, timeout=10.0, resilient=False)
    reg = client.register(model="m", pool=pool, start_layer=8, end_layer=8 + LAYERS, num_layers=16,
                          host_tokens=TOKENS, page_size=PAGE)
    return reg.client_id, pool, client


def shm_bytes(pool: ShmKVPool) -> list[list[np.ndarray]]:
    """The pool's bytes, one [token, byte] array per (layer, part), sharing its memory."""
    return [[b.reshape(TOKENS, -1).view(torch.uint8).numpy() for b in layer] for layer in pool.buffers]


def cache_job(client, table, offsets: np.ndarray, device_tokens: np.ndarray) -> Job:
    device = client.device
    plan = transfer.make_plan(offsets, device_tokens, client.spec.page_size,
                              device.num_pages if device.paged else None)
    return Job(client, plan, list(range(len(client.spec.layers))), np.empty(0, np.int64), host_table=table)


async def put_then_get(core, client_id: str, offsets: np.ndarray, src: np.ndarray, dst: np.ndarray,
                       settled: list | None = None):
    """Copies device tokens ``src`` into cache pages at arena ``offsets``, then those pages into
    device tokens ``dst``; returns the load's steps. Each job's settling goes into ``settled``."""
    client = core.client(client_id)
    table = cache_table(core.arena.address, client.spec)
    put, get = cache_job(client, table, offsets, src), cache_job(client, table, offsets, dst)
    if settled is not None:
        put.on_settled = lambda ok: settled.append(("put", ok))
        get.on_settled = lambda ok: settled.append(("get", ok))
    await core.copier.write(put)
    return [step async for step in core.copier.load(get)]


def arena_page(core, offset: int, spec) -> np.ndarray:
    """One cached page as [layer, part, token, byte]."""
    arena = core.arena.view(np.uint8)
    page = arena[offset: offset + spec.page_bytes]
    return page.reshape(len(spec.layers), spec.layout.num_parts, spec.page_size, spec.token_bytes)


def check_round_trip(daemon, client_id: str, dev, offsets: np.ndarray, src: np.ndarray, dst: np.ndarray):
    """``dev(layer, part)``: the pool's bytes of one buffer as [token, byte]. The cache pages
    must hold exactly the source tokens, the destination tokens exactly them afterwards, and
    the client's own region and pages must be untouched."""
    core = daemon.core
    client = daemon.run(core.client, client_id)
    start, end = client.region_offset, client.region_offset + client.region_bytes
    region = core.arena.view(np.uint8)[start:end]
    region_before = region.copy()
    settled: list = []
    steps = daemon.call(put_then_get(core, client_id, offsets, src, dst, settled))
    assert settled == [("put", True), ("get", True)]  # each once its copy was done
    spec = client.spec
    n = spec.page_size
    for i, offset in enumerate(offsets.tolist()):
        page = arena_page(core, offset, spec)
        for layer in range(LAYERS):
            for part in range(2):
                rows = dev(layer, part)
                np.testing.assert_array_equal(page[layer, part], rows[src[i * n:(i + 1) * n]])
                np.testing.assert_array_equal(rows[dst[i * n:(i + 1) * n]], rows[src[i * n:(i + 1) * n]])
    assert steps[-1].layers_done == LAYERS
    np.testing.assert_array_equal(region, region_before)
    assert not client.busy.any() and client.pages.num_used == 0 and client.inflight == 0
    return steps


def slab(core, pages: int, page_size: int = PAGE) -> int:
    """Arena memory outside every client's region, as a cache slab is."""
    return core.arena.reserve(pages * page_bytes(page_size))


def page_bytes(page_size: int = PAGE) -> int:
    return LAYERS * 2 * page_size * HEADS * HEAD_DIM * 2


def fill(rows_of, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for layer in range(LAYERS):
        for part in range(2):
            rows = rows_of(layer, part)
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)


# ---- the interface ---------------------------------------------------------------------------


def interface_members() -> set[str]:
    attrs = set(typing.get_type_hints(DevicePool))
    methods = {n for n, v in vars(DevicePool).items() if callable(v) or isinstance(v, property)}
    return (attrs | methods | set(DevicePool.__abstractmethods__)) - {"__init__", "__subclasshook__"}


def test_the_interface_names_every_member_the_daemon_uses():
    assert {"num_tokens", "page_size", "num_pages", "paged", "dtype", "event_slots", "event_handles",
            "ipc_allocations", "inline_ok", "records_events", "failed", "check_request", "check_sizes",
            "attach_host", "start", "close"} <= interface_members()


@needs_kernel
def test_each_medium_implements_every_member(daemon, fake):
    shm_id, pool, client = shm_client(daemon)
    refs, _, _ = cuda_pool(fake, HEADS, HEAD_DIM)
    with grpc.insecure_channel(daemon.address) as ch:
        cuda_id = register(ticketing_stub(ch, daemon.address), refs, HEADS, HEAD_DIM, PAGE).client_id
    shm_dev = daemon.run(daemon.core.client, shm_id).device
    cuda_dev = daemon.run(daemon.core.client, cuda_id).device
    from kvserver.media.cuda.pool import CudaDevicePool

    for dev, cls in ((shm_dev, ShmDevicePool), (cuda_dev, CudaDevicePool)):
        assert type(dev) is cls and isinstance(dev, DevicePool)
        assert not cls.__abstractmethods__
        for name in interface_members():
            getattr(dev, name)  # every attribute is there (raises AttributeError if not)
        assert dev.num_tokens == TOKENS and dev.page_size == PAGE and dev.num_pages == TOKENS // PAGE
        assert dev.paged and dev.dtype == np.int64 and dev.failed is None
    assert (shm_dev.inline_ok, shm_dev.records_events, shm_dev.event_slots) == (True, False, 0)
    assert list(shm_dev.event_handles) == [] and shm_dev.ipc_allocations == frozenset()
    assert (cuda_dev.inline_ok, cuda_dev.records_events, cuda_dev.event_slots) == (False, True, 2)
    assert len(cuda_dev.event_handles) == 2 * LAYERS
    assert cuda_dev.ipc_allocations == frozenset(cuda_dev.handles) and len(cuda_dev.ipc_allocations) == 1

    shm_dev.check_request(b"", 0)
    with pytest.raises(InvalidArgument, match="for CUDA pools; this pool is shared memory"):
        shm_dev.check_request(b"\0" * 64, 0)
    with pytest.raises(InvalidArgument, match="for CUDA pools"):
        shm_dev.check_request(b"", 1)
    cuda_dev.check_request(b"\0" * 64, 1)
    with pytest.raises(InvalidArgument, match="event_slot 2 is not one of this registration's 2 slots"):
        cuda_dev.check_request(b"", 2)
    with pytest.raises(InvalidArgument, match="64-byte CUDA IPC event handle, got 3 bytes"):
        cuda_dev.check_request(b"abc", 0)
    client.close()
    pool.close()


def test_the_inline_executor_runs_at_once_and_keeps_errors():
    ran = []
    assert INLINE.submit(ran.append, 1).result(0) is None and ran == [1]
    fut = INLINE.submit(lambda: 1 // 0)
    assert fut.done() and isinstance(fut.exception(), ZeroDivisionError)


def test_no_medium_branch_outside_the_media():
    root = pathlib.Path(media.__file__).parent.parent
    medium = re.compile(r"\bkind\s*[!=]=\s*[\"'](cuda|shm)|getattr\(\s*\w*\.?device\b")
    outside = [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "media"]
    hits = [f"{p.relative_to(root)}:{i}" for p in outside
            for i, line in enumerate(p.read_text().splitlines(), 1) if medium.search(line)]
    assert hits == []


# ---- cache jobs in each medium -----------------------------------------------------------------


@pytest.mark.parametrize("scattered", [False, True], ids=["pages", "tokens"])
def test_shm_cache_rows_round_trip(daemon, scattered):
    client_id, pool, client = shm_client(daemon)
    rows = shm_bytes(pool)
    fill(lambda layer, part: rows[layer][part], 1)
    base = slab(daemon.core, 3)
    offsets = np.array([base + 2 * page_bytes(), base], dtype=np.int64)  # out of order, one page apart
    src = np.arange(2 * PAGE, dtype=np.int64)
    dst = (np.arange(2 * PAGE, dtype=np.int64) * 3 + 70) if scattered else np.arange(4 * PAGE, 6 * PAGE)
    steps = check_round_trip(daemon, client_id, lambda layer, part: rows[layer][part], offsets, src, dst)
    assert not any(s.events_recorded for s in steps)
    client.close()
    pool.close()


def with_pinner(monkeypatch, pinner: SlabPinner) -> None:
    """The daemon's pools open with ``pinner`` as their cache slabs' pinner."""
    def open_pool(*args, slabs=None, **kwargs):
        return media.open_pool(*args, slabs=pinner, **kwargs)

    monkeypatch.setattr(core_module, "open_pool", open_pool)


def pinned(rt) -> dict[int, int]:
    return dict(rt.registered)


@needs_kernel
@pytest.mark.parametrize("page_size", [16, 64], ids=["kernel", "dma"])
def test_cuda_cache_rows_need_pinned_slabs_and_round_trip(daemon, fake, monkeypatch, page_size):
    rt = fake.cuda.runtime
    core = daemon.core
    pb_ = page_bytes(page_size)
    pinner = SlabPinner()
    with_pinner(monkeypatch, pinner)
    first = daemon.run(slab, core, 2, page_size)
    first_ptr = core.arena.address + first
    pinner.added(first_ptr, 2 * pb_)
    assert first_ptr not in pinned(rt)  # no CUDA in use yet: nothing pinned

    refs, kv, _ = cuda_pool(fake, HEADS, HEAD_DIM)
    kv[:] = np.random.default_rng(page_size).integers(0, 256, kv.shape, dtype=np.uint8)
    with grpc.insecure_channel(daemon.address) as ch:
        client_id = register(ticketing_stub(ch, daemon.address), refs, HEADS, HEAD_DIM, page_size).client_id
    assert pinned(rt)[first_ptr] == 2 * pb_  # pinned at the first CUDA registration
    assert ("hostRegister", first_ptr, 2 * pb_, 3) in rt.calls  # Portable | Mapped
    later = daemon.run(slab, core, 1, page_size)
    pinner.added(core.arena.address + later, pb_)
    assert core.arena.address + later in pinned(rt)  # later slabs as they come

    offsets = np.array([later, first + pb_], dtype=np.int64)  # in two slabs
    src, dst = np.arange(2 * page_size, dtype=np.int64), np.arange(2 * page_size, 4 * page_size)
    path = "kernel" if page_size == 16 else "memcpyAsync"
    launches = sum(c[0] == path for c in rt.calls)
    steps = check_round_trip(daemon, client_id, lambda layer, part: kv[layer, part], offsets, src, dst)
    assert steps[0].events_recorded and sum(c[0] == path for c in rt.calls) > launches

    pinner.removed(core.arena.address + later, pb_)
    assert core.arena.address + later not in pinned(rt)
    assert ("hostUnregister", core.arena.address + later) in rt.calls
    # The stand-in GPU cannot reach unpinned memory: a job on the released slab's rows fails.
    with pytest.raises(RuntimeError, match="cannot reach"):
        daemon.call(put_then_get(core, client_id, np.array([later], dtype=np.int64),
                                 src[:page_size], dst[:page_size]))


@needs_kernel
def test_cuda_cache_rows_refused_without_unified_addressing(daemon, fake, monkeypatch):
    rt = fake.cuda.runtime
    rt.device_offset = 1 << 20  # pinned host memory gets another device address
    pinner = SlabPinner()
    with_pinner(monkeypatch, pinner)
    base = daemon.run(slab, daemon.core, 1)
    pinner.added(daemon.core.arena.address + base, page_bytes())
    refs, kv, _ = cuda_pool(fake, HEADS, HEAD_DIM)
    with grpc.insecure_channel(daemon.address) as ch:
        client_id = register(ticketing_stub(ch, daemon.address), refs, HEADS, HEAD_DIM, PAGE).client_id
    launched = len(rt.stream_ops)
    with pytest.raises(FailedPrecondition, match="without unified addressing"):
        daemon.call(put_then_get(daemon.core, client_id, np.array([base], dtype=np.int64),
                                 np.arange(PAGE), np.arange(PAGE, 2 * PAGE)))
    assert len(rt.stream_ops) == launched  # refused before anything went on the GPU


@needs_kernel
def test_cuda_cache_rows_refused_for_a_pool_without_the_pinner(daemon, fake, monkeypatch):
    # The daemon gives every pool its pinner; a pool opened without one refuses cache rows.
    def open_pool(*args, slabs=None, **kwargs):
        return media.open_pool(*args, **kwargs)

    monkeypatch.setattr(core_module, "open_pool", open_pool)
    refs, _, _ = cuda_pool(fake, HEADS, HEAD_DIM)
    with grpc.insecure_channel(daemon.address) as ch:
        client_id = register(ticketing_stub(ch, daemon.address), refs, HEADS, HEAD_DIM, PAGE).client_id
    base = daemon.run(slab, daemon.core, 1)
    with pytest.raises(FailedPrecondition, match="without the cache's slabs pinned"):
        daemon.call(put_then_get(daemon.core, client_id, np.array([base], dtype=np.int64),
                                 np.arange(PAGE), np.arange(PAGE, 2 * PAGE)))


# ---- the slab pinner on its own ----------------------------------------------------------------


def test_slab_pinner_follows_the_cache_and_refuses_while_a_slab_is_unpinned():
    cupy = fake_cupy.make_fake_cupy()
    rt = cupy.cuda.runtime
    mem = np.zeros(4 << 20, dtype=np.uint8)
    a, b, c = (mem.ctypes.data + i * (1 << 20) for i in range(3))
    pinner = SlabPinner()
    pinner.added(a, 1 << 20)
    with pytest.raises(FailedPrecondition, match="no CUDA pool has attached"):
        pinner.check()
    assert not pinner.active and rt.registered == {}
    pinner.use(cupy, 0)
    pinner.use(cupy, 0)  # once only
    assert rt.registered == {a: 1 << 20} and pinner.pinned_bytes == 1 << 20
    pinner.check()
    rt.registered[b] = 1 << 20  # someone else has it registered: pinning the slab fails
    pinner.added(b, 1 << 20)
    with pytest.raises(FailedPrecondition, match="1 cache slab.s. could not be pinned"):
        pinner.check()
    del rt.registered[b]
    pinner.removed(b, 1 << 20)  # never pinned: nothing to unpin, and the refusal ends
    assert ("hostUnregister", b) not in rt.calls
    pinner.check()
    pinner.added(c, 1 << 20)
    pinner.removed(a, 1 << 20)
    assert rt.registered == {c: 1 << 20}
    pinner.close()
    assert rt.registered == {} and pinner.pinned_bytes == 0


@needs_kernel
def test_a_stalled_cuda_cache_job_settles_once_its_gpu_work_has_drained(daemon_factory, fake, monkeypatch):
    """A Put's copy waits on an engine event that never fires: its call fails past
    --cuda-wait-seconds and the client is reclaimed, but the GPU may still read the cache pages,
    so the job settles (the cache may end its marks) only once the quarantined stream drains."""
    d = daemon_factory(cuda_wait_seconds=1.0)
    rt = fake.cuda.runtime
    pinner = SlabPinner()
    with_pinner(monkeypatch, pinner)
    refs, _, _ = cuda_pool(fake, HEADS, HEAD_DIM)
    with grpc.insecure_channel(d.address) as ch:
        client_id = register(ticketing_stub(ch, d.address), refs, HEADS, HEAD_DIM, PAGE).client_id
    base = d.run(slab, d.core, 1)
    pinner.added(d.core.arena.address + base, page_bytes())
    hung = (779).to_bytes(8, "little") * 8
    rt.hang(hung)
    settled: list[bool] = []

    async def stalled_put() -> None:
        client = d.core.client(client_id)
        job = cache_job(client, cache_table(d.core.arena.address, client.spec), np.array([base]),
                        np.arange(PAGE))
        job.ready_event, job.on_settled = hung, settled.append
        await d.core.copier.write(job)

    try:
        with pytest.raises(GpuStalled):
            d.call(stalled_put())
        wait_until(lambda: client_id not in d.run(lambda: set(d.core.clients)), 10, "the client reclaimed")
        assert d.run(lambda: list(settled)) == []  # reclaimed, quarantined: the GPU may still copy
        rt.fire(hung)
        wait_until(lambda: d.run(lambda: list(settled)) == [False], 10, "the job settled as failed")
    finally:
        rt.fire(hung)
