"""The daemon's CUDA path end to end through gRPC, with CuPy replaced by tests/fake_cupy.py.

Bit-exact transfers through IPC pointers (kernel and DMA paths), ordering (ready events waited on
before copying, one event recorded per layer, "events recorded" sent before completion), and the
release of every IPC mapping, pin, event and stream when a client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import types

import fake_cupy
import grpc
import numpy as np
import pytest
import torch
from checks import being_written
from fake_cupy import UUID
from kernel_host import compiler
from ticketing import ticketing_stub

from kvserver.v1 import kvserver_pb2 as pb

LAYERS, TOKENS = 4, 256

# The stand-in runs the daemon's CUDA kernel source built for the CPU.
pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) to build the copy kernel")


@pytest.fixture
def fake(monkeypatch):
    return fake_cupy.install(monkeypatch)


def cuda_pool(fake, heads: int, head_dim: int, parts: int = 2, handle_mem=None):
    token_bytes = heads * head_dim * 2  # fp16
    buffer_bytes = TOKENS * token_bytes
    handle, mem = handle_mem or fake.cuda.runtime.export(LAYERS * parts * buffer_bytes + 4096)
    refs = pb.DevicePool(num_tokens=TOKENS, layers=[
        pb.LayerBuffers(parts=[
            pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=b"\x02c" + handle, device_uuid=UUID,
                                                 allocation_size=mem.size),
                         offset=4096 + (layer * parts + part) * buffer_bytes, token_stride=token_bytes)
            for part in range(parts)
        ])
        for layer in range(LAYERS)
    ])
    view = mem[4096:].reshape(LAYERS, parts, TOKENS, token_bytes)
    return refs, view, (handle, mem)


def register(stub, refs, heads, head_dim, page_size):
    parts = len(refs.layers[0].parts)
    layout = (pb.KVLayout(mha=pb.MHALayout(num_heads=heads, head_dim=head_dim)) if parts == 2 else
              pb.KVLayout(mla=pb.MLALayout(kv_lora_rank=heads * head_dim)))
    return stub.Register(pb.RegisterRequest(
        model="gpu", start_layer=8, end_layer=8 + LAYERS, num_layers=16,
        layout=layout, dtype=pb.DTYPE_FLOAT16,
        page_size=page_size, device_pool=refs, host_tokens=TOKENS, event_slots=2,
    ), timeout=10)


@pytest.mark.parametrize(("page_size", "path", "tokens", "parts"), [
    (16, "kernel", False, 2),  # 512 B per token: 8 KiB page chunks go through the kernel
    (64, "memcpyAsync", False, 2),  # 32 KiB page chunks go by DMA
    (16, "kernel", True, 2),  # single scattered device tokens: token rows
    (16, "kernel", False, 1),  # one part per layer, as MLA
])
def test_cuda_round_trip_events_and_release(daemon, fake, page_size, path, tokens, parts):
    rt = fake.cuda.runtime
    heads, head_dim = 2, 128
    refs, kv, _ = cuda_pool(fake, heads, head_dim, parts=parts)
    rng = np.random.default_rng(page_size)
    kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, heads, head_dim, page_size)
        assert len(reg.layer_events) == 2 * LAYERS
        create_calls = list(rt.calls)
        # Interprocess layer events whose waits sleep: BlockingSync | DisableTiming | Interprocess.
        assert [c[1] for c in create_calls if c[0] == "eventCreateWithFlags"] == [1 | 2 | 4] * (2 * LAYERS)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=128)).host_indices)
        pages = rng.permutation(TOKENS // page_size)[: 128 // page_size]
        dev = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1).tolist()
        if tokens:
            dev = rng.permutation(TOKENS)[:128].tolist()
        want = kv[:, :, dev].copy()

        ready = (4242).to_bytes(8, "little") * 8
        rt.calls.clear()
        stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host, device_indices=dev,
                                   ready_event=ready), timeout=10)
        names = [c[0] for c in rt.calls]
        assert names.index("streamWaitEvent") < names.index(path), "copied before the engine was ready"
        # The write's own completion event (blocking sync, not interprocess), recorded after the
        # copies, waited on, then destroyed.
        assert names[-4:] == ["eventCreateWithFlags", "eventRecord", "eventQuery", "eventDestroy"]
        assert rt.calls[-4][1] == 1 | 2 and rt.calls[-3][1] == rt.calls[-2][1] == rt.calls[-1][1]
        # Every copy and record on the registration's own non-blocking stream, never the legacy
        # default one.
        stream = rt.calls[-3][2]
        assert stream != 0 and ("Stream", stream, True) in create_calls
        assert all(c[-1] == stream for c in rt.calls if c[0] in ("kernel", "memcpyAsync", "eventRecord"))
        kv[:] = 0

        rt.calls.clear()
        steps = list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host, device_indices=dev,
                                              event_slot=1), timeout=10))
        assert steps[0].events_recorded and steps[0].layers_done == 0, steps[0]
        assert steps[-1].done and steps[-1].layers_done == LAYERS and steps[-1].last_layer == 8 + LAYERS - 1
        assert np.array_equal(kv[:, :, dev], want)
        assert not kv[:, :, sorted(set(range(TOKENS)) - set(dev))].any()
        # Slot 1's events, one per layer, recorded in layer order after that layer's copy.
        slot1 = [int.from_bytes(h[:8], "little") for h in reg.layer_events[LAYERS:]]
        records = [c[1] for c in rt.calls if c[0] == "eventRecord"]
        assert records == slot1
        names = [c[0] for c in rt.calls]
        first_record = names.index("eventRecord")
        assert path in names[:first_record], "layer 0's event recorded before its copy"
        assert names.index("eventQuery") > len(names) - 1 - names[::-1].index("eventRecord")

        rt.calls.clear()
        stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=10)
        names = [c[0] for c in rt.calls]
        assert names.count("eventDestroy") == 2 * LAYERS + 1  # its layer events + the opened ready event
        assert names.count("hostUnregister") == 1 and names.count("ipcCloseMemHandle") == 1
        assert names[0] == "streamQuery" and ("free_all_blocks", stream) in rt.calls  # drained first


@pytest.mark.parametrize(("head_dim", "word"), [(3, "kv_copy_rows_w2"), (130, "kv_copy_rows_w4")])
def test_unaligned_rows_are_one_launch_per_layer_and_exact(daemon, fake, head_dim, word):
    """Tokens of 6 (or 260) bytes, scattered on the device: rows are not 8-byte aligned, and each
    job is still one kernel launch per layer (a write: one in all) with a narrower word, never a
    copy call per row on the shared worker, and every byte lands."""
    rt = fake.cuda.runtime
    refs, kv, _ = cuda_pool(fake, 1, head_dim)
    rng = np.random.default_rng(head_dim)
    kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 1, head_dim, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=128)).host_indices)
        dev = rng.permutation(TOKENS)[:128].tolist()
        want = kv[:, :, dev].copy()
        rt.calls.clear()
        stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host, device_indices=dev),
                   timeout=10)
        kv[:] = 0
        list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host, device_indices=dev),
                       timeout=10))
        launches = [c for c in rt.calls if c[0] in ("kernel", "memcpyAsync")]
        assert [c[0] for c in launches] == ["kernel"] * (1 + LAYERS)
        assert {c[3] for c in launches} == {word}
        assert np.array_equal(kv[:, :, dev], want)
        assert not kv[:, :, sorted(set(range(TOKENS)) - set(dev))].any()
        stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=10)


def test_allocation_opened_once_for_two_clients(daemon, fake):
    rt = fake.cuda.runtime
    refs, kv, shared = cuda_pool(fake, 2, 64)
    refs2, _, _ = cuda_pool(fake, 2, 64, handle_mem=shared)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        a = register(stub, refs, 2, 64, 16)
        b = register(stub, refs2, 2, 64, 16)
        assert [c[0] for c in rt.calls].count("ipcOpenMemHandle") == 1
        stub.Unregister(pb.UnregisterRequest(client_id=a.client_id), timeout=10)
        assert [c[0] for c in rt.calls].count("ipcCloseMemHandle") == 0
        stub.Unregister(pb.UnregisterRequest(client_id=b.client_id), timeout=10)
        assert [c[0] for c in rt.calls].count("ipcCloseMemHandle") == 1


def oversize(refs, reach: int) -> None:
    """Declares every buffer's allocation 2^63 bytes and moves the last buffer ``reach`` bytes
    from the allocation's base: what a hostile client sends to reach other memory."""
    for layer in refs.layers:
        for part in layer.parts:
            part.cuda.allocation_size = 1 << 63
    refs.layers[-1].parts[-1].offset = reach


@pytest.mark.parametrize("reach", ["far", "one byte past"])
def test_a_span_past_the_real_allocation_is_refused(daemon, fake, reach):
    """The declared allocation_size can only narrow what the daemon may touch: the span is checked
    against the real range of the opened allocation, and a refused pool leaves nothing open."""
    rt = fake.cuda.runtime
    refs, _, (_, mem) = cuda_pool(fake, 2, 64)
    token_bytes = refs.layers[0].parts[0].token_stride
    # "one byte past": the last token ends one byte after the allocation does.
    oversize(refs, 1 << 40 if reach == "far" else mem.size - TOKENS * token_bytes + 1)
    reserved = daemon.run(lambda: daemon.core.arena.reserved)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            register(stub, refs, 2, 64, 16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the allocation the handle opens is {mem.size} bytes" in err.value.details()
        names = [c[0] for c in rt.calls]
        assert names.count("ipcOpenMemHandle") == names.count("ipcCloseMemHandle") == 1
        assert "hostRegister" not in names
        assert stub.Stats(pb.StatsRequest()).num_clients == 0
    assert daemon.run(lambda: daemon.core.arena.reserved) == reserved


def test_an_oversized_span_next_to_a_live_client_leaves_its_mapping_open(daemon, fake):
    """A second client naming the same allocation with an oversized span is refused; the first
    client's mapping (shared, opened once) stays open and it keeps working."""
    rt = fake.cuda.runtime
    refs, kv, shared = cuda_pool(fake, 2, 64)
    bad, _, _ = cuda_pool(fake, 2, 64, handle_mem=shared)
    oversize(bad, 1 << 40)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        good = register(stub, refs, 2, 64, 16)
        with pytest.raises(grpc.RpcError) as err:
            register(stub, bad, 2, 64, 16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ipcCloseMemHandle" not in [c[0] for c in rt.calls]
        kv[:] = 3
        host = list(stub.Alloc(pb.AllocRequest(client_id=good.client_id, num_tokens=16)).host_indices)
        stub.Write(pb.WriteRequest(client_id=good.client_id, host_indices=host,
                                   device_indices=list(range(16))), timeout=10)
        kv[:] = 0
        list(stub.Load(pb.LoadRequest(client_id=good.client_id, host_indices=host,
                                      device_indices=list(range(16))), timeout=10))
        assert (kv[:, :, :16] == 3).all()
        stub.Unregister(pb.UnregisterRequest(client_id=good.client_id), timeout=10)
        assert [c[0] for c in rt.calls].count("ipcCloseMemHandle") == 1


def test_cuda_request_checks(daemon, fake):
    refs, _, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=16)).host_indices)
        for req, text in [
            (pb.LoadRequest(client_id=reg.client_id, host_indices=host, device_indices=list(range(16)),
                            event_slot=2), "not one of this registration's 2 slots"),
            (pb.LoadRequest(client_id=reg.client_id, host_indices=host, device_indices=list(range(16)),
                            ready_event=b"short"), "64-byte CUDA IPC event handle"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Load(req, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
        other_uuid = refs.layers[0].parts[0].cuda.device_uuid.replace("1a2b", "ffff")
        refs.layers[0].parts[0].cuda.device_uuid = other_uuid
        with pytest.raises(grpc.RpcError) as err:
            register(stub, refs, 2, 64, 16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must live on one device" in err.value.details()  # (found before any GPU is asked)
        for layer in refs.layers:  # every buffer on a GPU the daemon cannot see
            for part in layer.parts:
                part.cuda.device_uuid = other_uuid
        with pytest.raises(grpc.RpcError) as err:
            register(stub, refs, 2, 64, 16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not visible to the daemon" in err.value.details()


def _flashinfer(refs, token_bytes: int, block: int = 16, layers=None) -> None:
    """K and V of each layer interleaved per block, as vLLM's FlashInfer [blocks, 2, block, H, D]."""
    for layer, lb in enumerate(refs.layers):
        for part, r in enumerate(lb.parts):
            if layers is not None and layer not in layers:
                continue
            r.offset = 4096 + layer * 2 * TOKENS * token_bytes + part * block * token_bytes
            r.block_tokens, r.block_stride = block, 2 * block * token_bytes


@pytest.mark.parametrize(("mutate", "code", "text"), [
    (lambda refs, tb: (_flashinfer(refs, tb), _flashinfer(refs, tb, block=8, layers=[0])),
     grpc.StatusCode.UNIMPLEMENTED, "every buffer of a CUDA pool with blocks or strided heads must have"),
    (lambda refs, tb: setattr(refs.layers[0].parts[0], "head_stride", 64), grpc.StatusCode.INVALID_ARGUMENT,
     "device_pool buffer 0: head_stride 64 is smaller than one head (128 bytes)"),
    (lambda refs, tb: refs.layers[1].parts[1].MergeFrom(pb.BufferRef(
        offset=refs.layers[1].parts[0].offset + tb, block_tokens=16, block_stride=16 * tb)),
     grpc.StatusCode.INVALID_ARGUMENT, "device_pool buffer 2 and device_pool buffer 3 overlap"),
    (lambda refs, tb: (_flashinfer(refs, tb), setattr(refs.layers[3].parts[1], "block_stride", 1 << 20)),
     grpc.StatusCode.INVALID_ARGUMENT, "but the allocation is"),
], ids=["mixed-geometries", "head-stride-small", "buffers-overlap", "block-span-past-allocation"])
def test_cuda_pool_geometry_is_checked_before_opening(daemon, fake, mutate, code, text):
    """Block and head strides (docs/layouts.md) are checked before any handle is opened; a pool
    whose buffers differ in geometry is refused, never copied by the wrong rule."""
    refs, _, _ = cuda_pool(fake, 2, 64)
    mutate(refs, refs.layers[0].parts[0].token_stride)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            register(stub, refs, 2, 64, 16)
        assert err.value.code() == code and text in err.value.details(), err.value.details()
        assert "ipcOpenMemHandle" not in [c[0] for c in fake.cuda.runtime.calls]
        assert stub.Stats(pb.StatsRequest()).num_clients == 0


def vllm_cuda_pool(fake, kind: str, heads: int, head_dim: int, block: int = 16):
    """A pool in vLLM's FlashInfer ("flashinfer": [blocks, 2, block, H, D]) or its HND variant
    ("flashinfer_hnd": [blocks, 2, H, block, D]) or FlashAttention HND ("flash_attn_hnd":
    [2, blocks, H, block, D]) per layer, fp16, in one fake allocation. Returns the refs and, per
    (layer, part), a [blocks, block, H, head bytes] view of the memory."""
    hb, nb = head_dim * 2, TOKENS // block
    layer_bytes = 2 * TOKENS * heads * hb
    handle, mem = fake.cuda.runtime.export(LAYERS * layer_bytes + 4096)
    views, layers = [], []
    for layer in range(LAYERS):
        flat = mem[4096 + layer * layer_bytes:4096 + (layer + 1) * layer_bytes]
        if kind == "flashinfer":
            t = flat.reshape(nb, 2, block, heads, hb)
            parts = [t[:, p] for p in range(2)]
        elif kind == "flashinfer_hnd":
            t = flat.reshape(nb, 2, heads, block, hb)
            parts = [t[:, p].transpose(0, 2, 1, 3) for p in range(2)]
        else:
            t = flat.reshape(2, nb, heads, block, hb)
            parts = [t[p].transpose(0, 2, 1, 3) for p in range(2)]
        views.append(parts)
        layers.append(pb.LayerBuffers(parts=[
            pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=b"\x02c" + handle, device_uuid=UUID,
                                                 allocation_size=mem.size),
                         offset=v.__array_interface__["data"][0] - mem.__array_interface__["data"][0],
                         block_tokens=block, block_stride=v.strides[0], token_stride=v.strides[1],
                         head_stride=v.strides[2])
            for v in parts]))
    return pb.DevicePool(num_tokens=TOKENS, layers=layers), views, mem


def _tokens(view: np.ndarray) -> np.ndarray:
    return view.reshape(TOKENS, *view.shape[2:])


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("kind", ["flashinfer", "flashinfer_hnd", "flash_attn_hnd"])
def test_cuda_round_trip_in_vllm_layouts(daemon, fake, kind, page_size):
    """Write then Load through the daemon's CUDA planning and its copy kernel (built for the CPU):
    block strides (FlashInfer) and per-head segments (HND) land bit for bit, and nothing else is
    written."""
    heads, head_dim = 4, 8
    refs, views, mem = vllm_cuda_pool(fake, kind, heads, head_dim)
    _write_load_round_trip(daemon, refs, views, mem, heads, head_dim, page_size, seed=7)


def _write_load_round_trip(daemon, refs, views, mem, heads: int, head_dim: int, page_size: int, seed: int):
    """Write 64 scattered tokens of random bytes, wipe the pool, Load them back: they land bit for
    bit, every other token stays zero, and nothing is written before the pool's memory."""
    rng = np.random.default_rng(seed)
    mem[:] = rng.integers(0, 256, mem.shape, dtype=np.uint8)
    want = [[_tokens(v).copy() for v in layer] for layer in views]
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, heads, head_dim, page_size)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64)).host_indices)
        pages = rng.permutation(TOKENS // page_size)[: 64 // page_size]
        dev = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1).tolist()
        stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host, device_indices=dev),
                   timeout=10)
        mem[:] = 0
        steps = list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host, device_indices=dev),
                               timeout=10))
        assert steps[-1].done
        others = sorted(set(range(TOKENS)) - set(dev))
        for layer in range(LAYERS):
            for part in range(2):
                got = _tokens(views[layer][part])
                assert np.array_equal(got[dev], want[layer][part][dev]), (layer, part)
                assert not got[others].any()
        assert not mem[:4096].any()
        stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=10)


LAYOUTS_033 = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def vllm033_cuda_pool(fake, order: str, heads: int, head_dim: int, block: int = 16):
    """vLLM 0.33's per-layer [B, H, N, C] views (C = K then V of one head, docs/layouts.md) of one
    logical [L, B, H, N, C] cache stored in physical ``order``, fp16, in one fake allocation.
    Returns the refs and, per (layer, part), a [B, N, H, head bytes] view of the memory."""
    nb = TOKENS // block
    sizes = dict(L=LAYERS, B=nb, H=heads, N=block, C=2 * head_dim)
    nbytes = LAYERS * TOKENS * heads * 2 * head_dim * 2
    handle, mem = fake.cuda.runtime.export(nbytes + 4096)
    raw = torch.from_numpy(mem[4096:]).view(torch.float16).view([sizes[a] for a in order])
    five = raw.permute([order.index(a) for a in "LBHNC"])
    base = mem.ctypes.data
    views, layers = [], []
    for layer in range(LAYERS):
        parts = [five[layer][..., :head_dim], five[layer][..., head_dim:]]
        views.append([v.view(torch.uint8).permute(0, 2, 1, 3).numpy() for v in parts])  # [B, N, H, bytes]
        layers.append(pb.LayerBuffers(parts=[
            pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=b"\x02c" + handle, device_uuid=UUID,
                                                 allocation_size=mem.size),
                         offset=v.data_ptr() - base, block_tokens=block, block_stride=v.stride(0) * 2,
                         head_stride=v.stride(1) * 2, token_stride=v.stride(2) * 2)
            for v in parts]))
    return pb.DevicePool(num_tokens=TOKENS, layers=layers), views, mem


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("order", LAYOUTS_033)
def test_cuda_round_trip_in_vllm_033_layouts(daemon, fake, order, page_size):
    """vLLM 0.33's six per-layer layouts (LHBNC: each head runs over every block, head_stride
    = blocks * block_stride) through the CUDA planning and copy kernel: bit for bit, nothing else
    written."""
    heads, head_dim = 2, 8
    refs, views, mem = vllm033_cuda_pool(fake, order, heads, head_dim)
    _write_load_round_trip(daemon, refs, views, mem, heads, head_dim, page_size, seed=11)


def test_cuda_lhbnc_heads_overlapping_blocks_are_refused_before_opening(daemon, fake):
    refs, _, _ = vllm033_cuda_pool(fake, "LHBNC", 2, 8)
    for lb in refs.layers:
        for r in lb.parts:
            r.head_stride -= r.block_stride  # head 1 starts inside head 0's last block
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            register(stub, refs, 2, 8, 16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "blocks overlap" in err.value.details(), err.value.details()
        assert "ipcOpenMemHandle" not in [c[0] for c in fake.cuda.runtime.calls]
        assert stub.Stats(pb.StatsRequest()).num_clients == 0


def slow_host_register(rt, monkeypatch, seconds: float, call: str = "hostRegister"):
    """A runtime call (hostRegister by default) that takes ``seconds``, as pinning tens of GiB
    does."""
    real = getattr(rt, call)

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(rt, call, slow)


def test_pinning_runs_off_the_event_loop(daemon, fake, monkeypatch):
    """While one engine's region is being pinned, the daemon answers everyone else at once."""
    slow_host_register(fake.cuda.runtime, monkeypatch, 1.5)
    refs, _, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("reg", register(stub, refs, 2, 64, 16)))
        t.start()
        time.sleep(0.3)  # the registration is now pinning
        t0 = time.monotonic()
        assert stub.Stats(pb.StatsRequest(), timeout=10).num_clients == 0
        assert time.monotonic() - t0 < 0.5, "the event loop was blocked by the registration"
        t.join(10)
        assert result["reg"].client_id and stub.Stats(pb.StatsRequest()).num_clients == 1


@pytest.fixture
def cpu_events(monkeypatch):
    """torch without CUDA cannot open IPC events: the clients get the handle bytes instead."""
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", staticmethod(lambda device, handle: handle))


def gate_gpu(rt, monkeypatch, only: set[int] | None = None):
    """Events (every one, or those in ``only``) do not complete until the returned gate opens:
    those copies 'stay on the GPU' until the test opens it."""
    gate = threading.Event()
    real_query = rt.eventQuery

    def query(event):
        if (only is None or event in only) and not gate.is_set():
            real_query(event)
            return fake_cupy.NOT_READY
        return real_query(event)

    monkeypatch.setattr(rt, "eventQuery", query)
    return gate


def wait_for(predicate, seconds: float = 6.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("slow_call", ["hostRegister", "ipcOpenMemHandle"])
def test_registration_given_up_by_its_engine_leaves_nothing(daemon, fake, monkeypatch, slow_call):
    """An engine whose Register deadline passes while its pool is opened or its region pinned:
    the daemon lets that finish, then releases the IPC mapping (and the pin and host region, if
    it got that far), and holds no client."""
    rt = fake.cuda.runtime
    slow_host_register(rt, monkeypatch, 1.0, slow_call)
    refs, _, _ = cuda_pool(fake, 2, 64)
    free_before = daemon.core.arena.largest_free()
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(pb.RegisterRequest(
                model="gpu", start_layer=8, end_layer=8 + LAYERS, num_layers=16,
                layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=64)), dtype=pb.DTYPE_FLOAT16,
                page_size=16, device_pool=refs, host_tokens=TOKENS, event_slots=2,
            ), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: "ipcCloseMemHandle" in [c[0] for c in rt.calls])
        time.sleep(0.2)
        names = [c[0] for c in rt.calls]
        assert names.count("ipcOpenMemHandle") == names.count("ipcCloseMemHandle") == 1
        pinned = 1 if slow_call == "hostRegister" else 0  # a cancelled open never gets to pinning
        assert names.count("hostRegister") == names.count("hostUnregister") == pinned
        assert stub.Stats(pb.StatsRequest()).num_clients == 0
        assert daemon.core.arena.largest_free() == free_before


def test_a_slow_gpu_copy_does_not_hold_up_other_clients(daemon, fake, monkeypatch):
    """The copy worker only enqueues CUDA copies; waiting for the GPU is a waiter thread's job.
    While one engine's load is still on its GPU, another engine's write and load complete, and
    the first engine already knows its layer events are recorded."""
    rt = fake.cuda.runtime
    refs_a, _, _ = cuda_pool(fake, 2, 64)
    refs_b, kv_b, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        a, b = register(stub, refs_a, 2, 64, 16), register(stub, refs_b, 2, 64, 16)
        gate = gate_gpu(rt, monkeypatch, only={int.from_bytes(h[:8], "little") for h in a.layer_events})
        host_a = list(stub.Alloc(pb.AllocRequest(client_id=a.client_id, num_tokens=64)).host_indices)
        steps_a: list = []
        load_a = threading.Thread(target=lambda: steps_a.extend(stub.Load(pb.LoadRequest(
            client_id=a.client_id, host_indices=host_a, device_indices=list(range(64))), timeout=20)))
        load_a.start()
        assert wait_for(lambda: steps_a)  # A's copy is on the GPU now
        kv_b[:] = 5
        host_b = list(stub.Alloc(pb.AllocRequest(client_id=b.client_id, num_tokens=64)).host_indices)
        stub.Write(pb.WriteRequest(client_id=b.client_id, host_indices=host_b,
                                   device_indices=list(range(64))), timeout=5)
        kv_b[:] = 0
        steps_b = list(stub.Load(pb.LoadRequest(client_id=b.client_id, host_indices=host_b,
                                                device_indices=list(range(64))), timeout=5))
        assert steps_b[-1].done and (kv_b[:, :, :64] == 5).all()
        assert load_a.is_alive() and [s.events_recorded for s in steps_a] == [True]
        gate.set()
        load_a.join(10)
        assert steps_a[-1].done and steps_a[-1].layers_done == LAYERS


def test_a_launch_failing_mid_job_waits_for_what_was_enqueued(daemon, fake, monkeypatch):
    """If the second layer's launch fails, the first layer's copy may still be on the stream: the
    daemon waits (on a waiter thread, through a marker event recorded behind it) before it
    releases the pages, then answers INTERNAL, and the client stays usable."""
    rt = fake.cuda.runtime
    refs, _, _ = cuda_pool(fake, 2, 64)
    launches = []
    real_call = fake_cupy.RecordingKernel.__call__

    def flaky(self, grid, block, args):
        launches.append(1)
        if len(launches) == 2:
            raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
        real_call(self, grid, block, args)

    monkeypatch.setattr(fake_cupy.RecordingKernel, "__call__", flaky)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64)).host_indices)
        rt.calls.clear()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host,
                                          device_indices=list(range(64))), timeout=10))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "LAUNCH_OUT_OF_RESOURCES" in err.value.details()
        names = [c[0] for c in rt.calls]
        k = names.index("kernel")
        # A marker recorded right behind what was enqueued, and waited on before the answer.
        assert names.count("kernel") == 1 and "eventRecord" in names[k:] and "eventQuery" in names[k:]
        assert len(list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host,
                                                 device_indices=list(range(64))), timeout=10))) > 1
        stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=10)
        assert stub.Stats(pb.StatsRequest()).num_clients == 0


class DescribedPool:
    """What KVClient.register needs of a CUDA pool, around a fake-CuPy description."""
    def __init__(self, refs, heads, head_dim):
        from kvclient import KVLayout

        self.layout, self.dtype, self._refs = KVLayout.mha(heads, head_dim), torch.float16, refs
        self.buffers = [[types.SimpleNamespace(device=0)]]

    def descriptor(self):
        return self._refs


class FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_clients_wait_on_layer_events_after_they_are_recorded(daemon, fake, monkeypatch):
    """The sync and asyncio clients: a stream waits on a layer's event only after the daemon said
    the load's events are recorded, and on the event of the slot the load named."""


    from kvclient import AsyncKVClient, KVClient

    opened = []
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle",
                        staticmethod(lambda device, handle: opened.append(handle) or handle))
    refs, kv, _ = cuda_pool(fake, 2, 64)
    kv[:] = 7
    with KVClient(daemon.address) as client:
        reg = client.register(model="gpu", pool=DescribedPool(refs, 2, 64), start_layer=8, end_layer=12,
                              num_layers=16, host_tokens=64, page_size=16, event_slots=2)
        host = client.alloc(64)
        client.write(host_indices=host, device_indices=range(64))
        handle = client.load(host_indices=host, device_indices=range(64, 128), event_slot=1)
        stream = FakeStream()
        for layer in range(8, 12):
            assert handle.stream_wait_layer(layer, stream)
        assert stream.waited == list(reg.layer_events[LAYERS:])  # slot 1, layers in order
        assert handle.wait() > 0 and (kv[:, :, 64:128] == 7).all()

    async def run_async():
        async with AsyncKVClient(daemon.address) as client:
            await client.register(model="gpu", pool=DescribedPool(refs, 2, 64), start_layer=8, end_layer=12,
                                  num_layers=16, host_tokens=64, page_size=16, event_slots=2)
            host = await client.alloc(64)
            await client.write(host_indices=host, device_indices=range(64))
            handle = client.load(host_indices=host, device_indices=range(128, 192), event_slot=0)
            stream = FakeStream()
            assert await handle.stream_wait_layer(9, stream)
            assert stream.waited == [client.registration.layer_events[1]]
            assert await handle.wait() > 0
            await client.unregister()

    asyncio.run(run_async())
    assert (kv[:, :, 128:192] == 7).all()


class CudaTensorStandIn:
    """What CudaKVPool reads of a torch CUDA tensor, over a CPU tensor; its storage exports an
    allocation of the fake runtime the way ``_share_cuda_()`` does (torch 2.13's handle prefix)."""
    def __init__(self, cpu, handle: bytes, alloc_size: int, offset: int, counter: int) -> None:
        self.cpu, self.is_cuda, self.device = cpu, True, torch.device("cuda", 0)
        self.dtype, self.shape = cpu.dtype, cpu.shape
        self._share = (0, b"\x03c" + handle, alloc_size - offset, offset, b"/torch_4242_7", counter,
                       b"\0" * 64, True)

    def __getitem__(self, i):
        return self.cpu[i]

    def element_size(self) -> int:
        return self.cpu.element_size()

    def stride(self, dim: int) -> int:
        return self.cpu.stride(dim)

    def storage_offset(self) -> int:
        return 0

    def untyped_storage(self):
        return types.SimpleNamespace(_share_cuda_=lambda: self._share)


def standin_cuda_kv_pool(fake, monkeypatch):
    """A real CudaKVPool over stand-in CUDA tensors of one fake allocation; torch's IPC release
    calls are recorded: returns the pool, the released (ref, offset) pairs and ipc_collect calls."""
    from kvclient import CudaKVPool, KVLayout
    from kvclient import cuda_pool as cuda_pool_module

    released: list = []
    collected: list = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda ref, offset: released.append((ref, offset))), raising=False)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(1))
    monkeypatch.setattr(cuda_pool_module, "device_identity", lambda device: (UUID, "0000:3b:00.0"))
    layout = KVLayout.mha(2, 64)
    token_bytes = layout.token_bytes(torch.float16)
    handle, mem = fake.cuda.runtime.export(LAYERS * 2 * TOKENS * token_bytes)
    buffers = [[CudaTensorStandIn(torch.zeros(TOKENS, 2, 64, dtype=torch.float16), handle, mem.size,
                                  (layer * 2 + part) * TOKENS * token_bytes, layer * 2 + part)
                for part in range(2)] for layer in range(LAYERS)]
    return CudaKVPool(layout, torch.float16, buffers), released, collected


def test_cuda_pool_gives_torch_its_memory_back_after_unregister(daemon, fake, monkeypatch):
    """CudaKVPool's exports leave torch holding freed pool memory out of reuse until they are
    released; the client releases them after the daemon confirms an unregister (never on a plain
    close, when the daemon may still map the pool until it reclaims it)."""
    from kvclient import KVClient

    pool, released, collected = standin_cuda_kv_pool(fake, monkeypatch)
    with KVClient(daemon.address) as client:
        client.register(model="gpu", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                        host_tokens=64, page_size=16)
        assert client.write(host_indices=client.alloc(16), device_indices=range(16)) > 0
        assert released == []
        client.unregister()
        assert sorted(released) == [(b"/torch_4242_7", i) for i in range(2 * LAYERS)] and collected
        released.clear()
        client.register(model="gpu", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                        host_tokens=64, page_size=16)
    assert released == []  # closed, not unregistered: the daemon holds the pool until it reclaims it
    assert pool.release_exports() == 2 * LAYERS and len(released) == 2 * LAYERS
    assert pool.release_exports() == 0


def test_exports_kept_while_a_quarantined_copy_may_write_the_pool(daemon_factory, fake, monkeypatch):
    """A write of this pool stalls on an engine event that never fires: the client is reclaimed
    and quarantined, and re-registers by itself. Unregistering the new registration must not give
    torch the pool's memory back while the old copy may still land in it; once the stream drains,
    an Unregister says so again."""
    from kvclient import KVClient

    pool, released, _ = standin_cuda_kv_pool(fake, monkeypatch)
    d = daemon_factory(cuda_wait_seconds=WAIT_S, reclaim_grace=0.1)
    rt = fake.cuda.runtime
    hung = (778).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with KVClient(d.address) as client, grpc.insecure_channel(d.address) as ch:
            client.register(model="gpu", pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                            host_tokens=64, page_size=16)
            old = client.client_id
            host = client.alloc(16).tolist()
            with pytest.raises(grpc.RpcError) as err:  # stalls, then fails the client
                ticketing_stub(ch, d.address).Write(pb.WriteRequest(
                    client_id=old, host_indices=host, device_indices=list(range(16)), ready_event=hung),
                    timeout=20)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_for(lambda: client.connected and client.client_id != old), "no re-registration"
            client.unregister()
            assert released == [], "exports released while a quarantined copy may still write the pool"
            rt.fire(hung)  # the old copy lands at last; the quarantine drains
            assert wait_for(lambda: d.run(lambda: not d.core._quarantined))
        assert pool.release_exports() == 2 * LAYERS
    finally:
        rt.fire(hung)


def test_a_ready_event_handle_that_opens_nothing_is_invalid_argument(daemon, fake):
    """A 64-byte ready_event CUDA cannot open (stale, made up, another process's gone) is the
    caller's error, as a memory handle that opens nothing is: INVALID_ARGUMENT, not INTERNAL, and
    the registration serves on."""
    refs, _, _ = cuda_pool(fake, 2, 64)
    bad = (4242).to_bytes(8, "little") * 8
    fake.cuda.runtime.bad_events.add(bad)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=16)).host_indices)
        for call in (lambda: stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host,
                                                        device_indices=list(range(16)), ready_event=bad),
                                        timeout=10),
                     lambda: list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host,
                                                           device_indices=list(range(16)), ready_event=bad),
                                            timeout=10))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "ready_event" in err.value.details()
        stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host,
                                   device_indices=list(range(16))), timeout=10)


def test_a_quarantined_pool_is_released_once_its_context_has_a_sticky_error(daemon_factory, fake):
    """CuPy's streamQuery and eventQuery return a sticky error's code (700, an illegal address)
    rather than raise, on every call: the quarantine read that as "not drained yet" for ever, and
    the pool's pins, mappings and host region stayed held for the daemon's life. A failed context
    runs nothing more, and every call of it fails: its pool is released as far as it can be, each
    step whatever became of the others, and what waited for the release (a cache Put's pages, given
    up on) is let go; a wait on it gives up at once."""
    from kvclient import KVClient

    refs, _, _ = cuda_pool(fake, 2, 64)
    d = daemon_factory(cuda_wait_seconds=WAIT_S, reclaim_grace=0.1)
    rt = fake.cuda.runtime
    hung = (779).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with grpc.insecure_channel(d.address) as ch, KVClient(d.address):
            stub = ticketing_stub(ch, d.address)
            reg = register(stub, refs, 2, 64, 16)
            with pytest.raises(grpc.RpcError):  # a cache Put behind the hung event: stalls, then fails
                stub.Put(pb.PutRequest(client_id=reg.client_id, keys=bytes(range(16)) * 2, key_bytes=16,
                                       device_pages=[0, 1], ready_event=hung), timeout=20)
            assert wait_for(lambda: d.run(lambda: bool(d.core._quarantined))), "not quarantined"
            rt.sticky = 700  # the context fails: the hung copy will never run
            assert wait_for(lambda: d.run(lambda: not d.core._quarantined), 3.0), "never released"

            def held() -> list:
                return d.run(lambda: [(t.counters.pages, t.counters.bytes) for t in d.core.cache.stats()[1]])

            assert wait_for(lambda: all(t == (0, 0) for t in held()), 3.0), held()
    finally:
        rt.sticky = 0
        rt.fire(hung)


def test_ready_events_opened_once_and_bounded(daemon, fake):
    """An engine that re-records one ready event has it opened once; one that makes a new event
    per step has at most MAX_OPENED_EVENTS open in the daemon, the oldest closed first."""
    from kvserver.media.cuda.pool import MAX_OPENED_EVENTS

    rt = fake.cuda.runtime
    refs, _, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=16)).host_indices)

        def write(event_id: int) -> None:
            stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host,
                                       device_indices=list(range(16)),
                                       ready_event=event_id.to_bytes(8, "little") * 8), timeout=10)

        rt.calls.clear()
        for _ in range(5):
            write(9000)
        assert [c[0] for c in rt.calls].count("ipcOpenEventHandle") == 1
        extra = 6
        for i in range(MAX_OPENED_EVENTS + extra):
            write(10_000 + i)
            if i == MAX_OPENED_EVENTS // 2:
                write(9000)  # used again: now one of the most recent, not the oldest
        opened = [c[1] for c in rt.calls if c[0] == "ipcOpenEventHandle"]
        destroyed = [c[1] for c in rt.calls if c[0] == "eventDestroy"]
        assert len(opened) == 1 + MAX_OPENED_EVENTS + extra
        # The writes' own completion events are destroyed too; opened ones are OPENED + id.
        evicted = sorted(e - fake_cupy.OPENED for e in destroyed if e > fake_cupy.OPENED)
        assert evicted == [10_000 + i for i in range(extra + 1)]  # the least recently used
        rt.calls.clear()
        stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=10)
        opened = [c for c in rt.calls if c[0] == "eventDestroy" and c[1] > fake_cupy.OPENED]
        assert len(opened) == MAX_OPENED_EVENTS


@contextlib.contextmanager
def a_write_held_on_the_gpu(daemon, fake, monkeypatch):
    """A client whose Write deadline passed while its copy stays on the (gated) GPU: yields the
    stub, the registration and the gate that lets the copy complete."""
    refs, _, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64)).host_indices)
        gate = gate_gpu(fake.cuda.runtime, monkeypatch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host,
                                       device_indices=list(range(64))), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        yield stub, reg, gate


def test_a_cancelled_cuda_write_keeps_its_pages_until_the_gpu_is_done(daemon, fake, monkeypatch):
    """An engine whose Write deadline passes while the copy is still on the GPU: the pages stay
    busy and Unregister (so unpinning and IPC close) waits until the copy has completed."""
    rt = fake.cuda.runtime
    with a_write_held_on_the_gpu(daemon, fake, monkeypatch) as (stub, reg, gate):
        unregister = threading.Thread(target=lambda: stub.Unregister(
            pb.UnregisterRequest(client_id=reg.client_id), timeout=20))
        unregister.start()
        time.sleep(0.5)
        assert unregister.is_alive() and "hostUnregister" not in [c[0] for c in rt.calls]
        gate.set()
        unregister.join(10)
        names = [c[0] for c in rt.calls]
        assert names.index("eventQuery") < names.index("hostUnregister")
        assert stub.Stats(pb.StatsRequest()).num_clients == 0


def test_a_second_unregister_answers_only_once_the_release_is_done(daemon, fake, monkeypatch):
    """While one Unregister waits for a copy still on the GPU, another (a client confirming that
    a timed-out copy is dead) must not be told NOT_FOUND: it answers once the release is done."""
    rt = fake.cuda.runtime
    with a_write_held_on_the_gpu(daemon, fake, monkeypatch) as (stub, reg, gate):
        answers: list = []

        def unregister() -> None:
            try:
                resp = stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=20)
                answers.append(("ok", resp.copies_pending, "hostUnregister" in [c[0] for c in rt.calls]))
            except grpc.RpcError as exc:
                answers.append((exc.code().name, None, None))

        first = threading.Thread(target=unregister)
        first.start()
        deadline = time.monotonic() + 10
        while not daemon.run(lambda: daemon.core.clients[reg.client_id].closing):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = threading.Thread(target=unregister)
        second.start()
        time.sleep(0.5)
        assert answers == [], f"answered while the copy was still on the GPU: {answers}"
        gate.set()
        first.join(10)
        second.join(10)
        assert answers == [("ok", False, True), ("ok", False, True)], answers


def test_stream_wait_layer_on_a_missed_load_is_false():
    """A load asked for while the daemon was away has no events: waiting on a layer is a miss,
    never an exception, in both clients."""
    from kvclient.aio_client import AsyncLoadHandle
    from kvclient.load_handle import LoadHandle

    assert LoadHandle.miss([8, 9]).stream_wait_layer(8) is False

    async def aio():
        return await AsyncLoadHandle([8, 9], None).stream_wait_layer(8)

    assert asyncio.run(aio()) is False


def test_a_registration_cancelled_twice_still_gives_back_its_host_region(daemon, fake, monkeypatch):
    """Cancelled while pinning, then cancelled again while its cleanup closes the pool (as at
    shutdown): the pool is closed and the host region released all the same."""
    rt = fake.cuda.runtime
    slow_host_register(rt, monkeypatch, 0.6)
    slow_host_register(rt, monkeypatch, 0.6, "hostUnregister")
    refs, _, _ = cuda_pool(fake, 2, 64)
    req = pb.RegisterRequest(
        model="gpu", start_layer=8, end_layer=8 + LAYERS, num_layers=16,
        layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=64)), dtype=pb.DTYPE_FLOAT16,
        page_size=16, device_pool=refs, host_tokens=TOKENS, event_slots=2)
    reserved_before = daemon.run(lambda: daemon.core.arena.reserved)

    async def cancel_twice():
        task = asyncio.ensure_future(daemon.core.register(req))
        await asyncio.sleep(0.3)  # pinning
        task.cancel()
        await asyncio.sleep(0.5)  # the pin is done; the cleanup is unpinning
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    daemon.call(cancel_twice())
    wait_for(lambda: daemon.run(lambda: daemon.core.arena.reserved) == reserved_before)
    names = [c[0] for c in rt.calls]
    assert names.count("hostRegister") == names.count("hostUnregister") == 1
    assert names.count("ipcOpenMemHandle") == names.count("ipcCloseMemHandle") == 1
    assert daemon.run(lambda: (daemon.core.arena.reserved, len(daemon.core.clients))) == (reserved_before, 0)


def test_an_unregister_cancelled_midway_still_releases_the_client(daemon, fake, monkeypatch):
    """An Unregister whose deadline passes while a copy is still on the GPU: the release goes on
    to the end once the copy is done (nothing is held for good), and shutdown is not blocked."""
    rt = fake.cuda.runtime
    refs, _, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 64, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64)).host_indices)
        gate = gate_gpu(rt, monkeypatch)
        for call in (lambda: stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=host,
                                                        device_indices=list(range(64))), timeout=0.3),
                     lambda: stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=0.3)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "hostUnregister" not in [c[0] for c in rt.calls]  # the copy is still on the GPU
        gate.set()
        assert wait_for(lambda: stub.Stats(pb.StatsRequest()).num_clients == 0)
        # The client leaves the table before its pool is closed in a worker thread: wait for that too.
        assert wait_for(lambda: [c[0] for c in rt.calls].count("hostUnregister") == 1)


@pytest.mark.parametrize("client_kind", ["sync", "asyncio"])
def test_a_registration_given_up_after_a_slow_call_is_not_left_behind(daemon, fake, monkeypatch, cpu_events,
                                                                        client_kind):
    """A load that outlives the client's deadline makes the client give up its registration and
    register again; the old one's session ends with it, so the daemon reclaims it instead of
    keeping two registrations of one engine."""
    from kvclient import AsyncKVClient, KVClient

    refs, _, _ = cuda_pool(fake, 2, 64)
    num_clients = lambda: daemon.run(lambda: len(daemon.core.clients))  # noqa: E731
    gate = gate_gpu(fake.cuda.runtime, monkeypatch)
    kwargs = dict(model="gpu", pool=DescribedPool(refs, 2, 64), start_layer=8, end_layer=12, num_layers=16,
                  host_tokens=64, page_size=16)
    if client_kind == "sync":
        with KVClient(daemon.address, timeout=0.5) as client:
            client.register(**kwargs)
            assert client.load(host_indices=client.alloc(16), device_indices=range(16)).wait() == 0
            gate.set()
            assert wait_for(lambda: client.reconnects == 1 and num_clients() == 1), num_clients()
            assert client.connected
            assert client.write(host_indices=client.alloc(16), device_indices=range(16)) > 0
        return

    async def run_async():
        async with AsyncKVClient(daemon.address, timeout=0.5) as client:
            await client.register(**kwargs)
            handle = client.load(host_indices=await client.alloc(16), device_indices=range(16))
            assert await handle.wait() == 0
            gate.set()
            for _ in range(120):
                if client.reconnects == 1 and num_clients() == 1:
                    break
                await asyncio.sleep(0.05)
            assert client.reconnects == 1 and num_clients() == 1, num_clients()

    asyncio.run(run_async())


def test_asyncio_waiters_of_a_load_missed_from_the_start_are_woken():
    """A load asked for while disconnected: wait_layer and wait_recorded, entered before the
    handle's task has run, return False instead of waiting forever."""
    from kvclient.aio_client import AsyncLoadHandle

    async def run(wait):
        handle = AsyncLoadHandle([8, 9], None)
        watchdog = asyncio.get_running_loop().call_later(2, asyncio.current_task().cancel)
        try:  # awaited directly: the waiter is in before the handle's own task has run
            return await wait(handle)
        finally:
            watchdog.cancel()

    assert asyncio.run(run(lambda h: h.wait_layer(8))) is False
    assert asyncio.run(run(lambda h: h.wait_recorded())) is False


def test_closing_the_asyncio_client_mid_load_is_a_miss(daemon, fake, monkeypatch, cpu_events):
    """The engine closes its client while a load is on the GPU: waiting on that load reports a
    miss; no CancelledError reaches coroutines that nobody cancelled."""
    from kvclient import AsyncKVClient

    refs, _, _ = cuda_pool(fake, 2, 64)
    gate = gate_gpu(fake.cuda.runtime, monkeypatch)

    async def run():
        client = AsyncKVClient(daemon.address)
        await client.register(model="gpu", pool=DescribedPool(refs, 2, 64), start_layer=8, end_layer=12,
                              num_layers=16, host_tokens=64, page_size=16)
        handle = client.load(host_indices=await client.alloc(16), device_indices=range(16))
        assert await handle.wait_recorded()
        await client.close()
        return await handle.wait_layer(11), await handle.wait()

    try:
        assert asyncio.run(run()) == (False, 0)
    finally:
        gate.set()


def interleaved_jobs(stream_ops) -> list[tuple[int, str]]:
    """Calls put on a stream by one thread while another thread's write was still being enqueued
    there (a write's enqueue ends with its completion event's record)."""
    owner: dict[int, int | None] = {}
    bad = []
    for stream, thread, call in stream_ops:
        if owner.get(stream) not in (None, thread):
            bad.append((stream, call))
        owner[stream] = None if call == "eventRecord" else thread
    return bad


def test_two_copy_threads_never_enqueue_on_one_stream_at_once(daemon_factory, fake):
    """With --copy-threads 2, a client's writes and its loads of other pages and slots (which may
    run side by side: kvserver/copies/order.py) are enqueued one after the other on its stream,
    never mixed; all land whole."""
    d = daemon_factory(copy_threads=2)
    rt = fake.cuda.runtime
    refs, kv, _ = cuda_pool(fake, 2, 64)
    with grpc.insecure_channel(d.address) as ch:
        stub = ticketing_stub(ch, d.address)
        reg = register(stub, refs, 2, 64, 16)
        hosts = [list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=32)).host_indices)
                 for _ in range(2)]
        kv[:] = 9
        stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=hosts[1],
                                   device_indices=list(range(32))), timeout=10)
        rt.launch_seconds = 0.03  # slow launches: both threads are inside an enqueue at once
        rt.stream_ops.clear()
        start = threading.Barrier(2)

        def writes() -> None:
            start.wait()
            for _ in range(4):
                stub.Write(pb.WriteRequest(client_id=reg.client_id, host_indices=hosts[0],
                                           device_indices=list(range(32))), timeout=10)

        def loads() -> None:
            start.wait()
            for _ in range(4):
                list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=hosts[1],
                                              device_indices=list(range(32, 64))), timeout=10))

        threads = [threading.Thread(target=writes), threading.Thread(target=loads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        rt.launch_seconds = 0.0
        assert len({thread for _, thread, _ in rt.stream_ops}) == 2  # both copy threads enqueued
        assert interleaved_jobs(rt.stream_ops) == []
        kv[:] = 0
        for host in hosts:
            list(stub.Load(pb.LoadRequest(client_id=reg.client_id, host_indices=host,
                                          device_indices=list(range(32))), timeout=10))
            assert (kv[:, :, :32] == 9).all()


WAIT_S = 1.0  # --cuda-wait-seconds of the daemons below


def copy_call(stub, kind: str, client_id: str, host, dev, ready: bytes):
    if kind == "write":
        return stub.Write(pb.WriteRequest(client_id=client_id, host_indices=host, device_indices=dev,
                                          ready_event=ready), timeout=20)
    return list(stub.Load(pb.LoadRequest(client_id=client_id, host_indices=host, device_indices=dev,
                                         ready_event=ready), timeout=20))


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """Runs ``fn`` in a thread; the dict gets its gRPC error (or result) and how long it took."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except grpc.RpcError as exc:
            out["error"] = exc
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.parametrize("kind", ["write", "load"])
def test_a_ready_event_that_never_fires_fails_only_its_own_client(daemon_factory, fake, kind):
    """A's copy waits (on the GPU) for an engine event that never fires. Past --cuda-wait-seconds
    its call fails with DEADLINE_EXCEEDED and A is reclaimed, while B, on the same GPU, loads all
    along. A's pinned region and IPC mapping stay held (the GPU may still run A's copy) until
    A's stream drains, then a background thread releases them."""
    d = daemon_factory(cuda_wait_seconds=WAIT_S)
    rt = fake.cuda.runtime
    refs_a, _, _ = cuda_pool(fake, 2, 64)
    refs_b, kv_b, _ = cuda_pool(fake, 2, 64)
    hung = (777).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            a = register(stub, refs_a, 2, 64, 16)
            reserved_a = d.run(lambda: d.core.arena.reserved)
            b = register(stub, refs_b, 2, 64, 16)
            host_a = list(stub.Alloc(pb.AllocRequest(client_id=a.client_id, num_tokens=64)).host_indices)
            host_b = list(stub.Alloc(pb.AllocRequest(client_id=b.client_id, num_tokens=64)).host_indices)
            kv_b[:] = 4
            stub.Write(pb.WriteRequest(client_id=b.client_id, host_indices=host_b,
                                       device_indices=list(range(64))), timeout=10)
            t, out = in_thread(lambda: copy_call(stub, kind, a.client_id, host_a, list(range(64)), hung))
            b_loads = 0
            while t.is_alive():
                kv_b[:] = 0
                list(stub.Load(pb.LoadRequest(client_id=b.client_id, host_indices=host_b,
                                              device_indices=list(range(64))), timeout=5))
                assert (kv_b[:, :, :64] == 4).all()
                b_loads += 1
            t.join()
            assert "error" in out, out
            err = out["error"]
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
            assert "--cuda-wait-seconds" in err.details()
            assert WAIT_S - 0.05 <= out["seconds"] < WAIT_S + 1.5, out["seconds"]
            assert b_loads >= 3, b_loads
            clients = lambda: d.run(lambda: set(d.core.clients))  # noqa: E731
            assert wait_for(lambda: clients() == {b.client_id})
            assert d.run(lambda: d.core.reclaimed) == 1
            # The failed call did not claim its job dead, and an Unregister of A says its copies may
            # still run: A's client cannot take the failure as confirmed.
            assert ("kvserver-job", "ended") not in tuple(tuple(m) for m in err.trailing_metadata() or ())
            assert stub.Unregister(pb.UnregisterRequest(client_id=a.client_id), timeout=5).copies_pending
            # Quarantined: still pinned, mapped and reserved, since the GPU may still copy.
            names = [c[0] for c in rt.calls]
            assert names.count("hostUnregister") == names.count("ipcCloseMemHandle") == 0
            reserved = lambda: d.run(lambda: d.core.arena.reserved)  # noqa: E731
            reserved_both = reserved()
            assert reserved_both > reserved_a
            stub.Write(pb.WriteRequest(client_id=b.client_id, host_indices=host_b,
                                       device_indices=list(range(64))), timeout=10)
            rt.fire(hung)  # the engine's event fires at last: A's stream drains
            assert wait_for(lambda: reserved() == reserved_both - reserved_a), reserved()
            names = [c[0] for c in rt.calls]
            assert names.count("hostUnregister") == names.count("ipcCloseMemHandle") == 1
            with pytest.raises(grpc.RpcError) as gone:  # drained: A is simply gone now
                stub.Unregister(pb.UnregisterRequest(client_id=a.client_id), timeout=5)
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            kv_b[:] = 0
            list(stub.Load(pb.LoadRequest(client_id=b.client_id, host_indices=host_b,
                                          device_indices=list(range(64))), timeout=5))
            assert (kv_b[:, :, :64] == 4).all()
    finally:
        rt.fire(hung)


def test_the_unregister_of_a_stalled_client_ends(daemon_factory, fake):
    """An engine unregisters while its write waits on an event that never fires: the write fails
    past --cuda-wait-seconds and the Unregister then returns; the client's GPU resources are
    quarantined until its stream drains."""
    d = daemon_factory(cuda_wait_seconds=WAIT_S)
    rt = fake.cuda.runtime
    refs, _, _ = cuda_pool(fake, 2, 64)
    hung = (778).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            reg = register(stub, refs, 2, 64, 16)
            host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64)).host_indices)
            t, out = in_thread(lambda: copy_call(stub, "write", reg.client_id, host, list(range(64)), hung))
            assert wait_for(lambda: "streamWaitEvent" in [c[0] for c in rt.calls])
            t0 = time.monotonic()
            stub.Unregister(pb.UnregisterRequest(client_id=reg.client_id), timeout=10)
            assert time.monotonic() - t0 < WAIT_S + 1.5
            t.join(5)
            assert out["error"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert stub.Stats(pb.StatsRequest()).num_clients == 0
            assert "hostUnregister" not in [c[0] for c in rt.calls]
            assert d.run(lambda: d.core.arena.reserved) > 0
            rt.fire(hung)
            assert wait_for(lambda: d.run(lambda: d.core.arena.reserved) == 0)
            assert [c[0] for c in rt.calls].count("hostUnregister") == 1
    finally:
        rt.fire(hung)


def test_one_engine_s_stalled_copies_hold_no_other_engine_s_completion(daemon_factory, fake):
    """Engine A sends 64 Writes behind a ready event that never fires (a hung GPU, or a hostile
    engine): its waits take one of the daemon's waiter threads, one after another, not all of them,
    and engine B's load, done on its own stream at once, ends at once, not at A's deadline."""
    d = daemon_factory(cuda_wait_seconds=4.0)
    rt = fake.cuda.runtime
    refs_a, _, _ = cuda_pool(fake, 2, 64)
    refs_b, kv_b, _ = cuda_pool(fake, 2, 64)
    hung = (4242).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            a = register(stub, refs_a, 2, 64, 16)
            b = register(stub, refs_b, 2, 64, 16)
            host_a = list(stub.Alloc(pb.AllocRequest(client_id=a.client_id, num_tokens=16)).host_indices)
            host_b = list(stub.Alloc(pb.AllocRequest(client_id=b.client_id, num_tokens=64)).host_indices)
            kv_b[:] = 4
            stub.Write(pb.WriteRequest(client_id=b.client_id, host_indices=host_b,
                                       device_indices=list(range(64))), timeout=10)

            def a_write():
                with contextlib.suppress(grpc.RpcError):
                    stub.Write(pb.WriteRequest(client_id=a.client_id, host_indices=host_a,
                                               device_indices=list(range(16)), ready_event=hung), timeout=30)

            threads = [threading.Thread(target=a_write) for _ in range(64)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while [c[0] for c in rt.calls].count("streamWaitEvent") < 64 and time.monotonic() < deadline:
                time.sleep(0.01)
            kv_b[:] = 0
            t0 = time.monotonic()
            list(stub.Load(pb.LoadRequest(client_id=b.client_id, host_indices=host_b,
                                          device_indices=list(range(64))), timeout=30))
            took = time.monotonic() - t0
            assert (kv_b[:, :, :64] == 4).all()
            for t in threads:
                t.join(30)
            assert took < 1.0, f"B's load took {took:.2f} s: it waited for A's deadline"
    finally:
        rt.fire_all()


def test_a_handle_that_opens_nothing_is_invalid_argument(daemon, fake, monkeypatch):
    """A stale handle (its engine freed the memory) or bytes that are no handle: the driver refuses
    to open it, and the Register is refused as the caller's error, not an internal one."""
    rt = fake.cuda.runtime
    refs, _, _ = cuda_pool(fake, 2, 64)

    def open_fails(handle, flags=1):
        raise RuntimeError("cudaErrorInvalidValue: invalid argument")  # CuPy's CUDARuntimeError text

    monkeypatch.setattr(rt, "ipcOpenMemHandle", open_fails)
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            register(stub, refs, 2, 64, 16)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "opens no allocation" in err.value.details()


@pytest.mark.parametrize("forms", [(b"", b"\x02c"), (b"\x02c", b"\x03c")])
def test_two_buffers_at_the_same_bytes_overlap_whichever_form_their_handle_takes(forms):
    """The raw 64-byte handle and torch's 66-byte forms name the same allocation: two strided
    buffers at the same bytes under two forms overlap as under one."""
    from kvserver.errors import InvalidArgument
    from kvserver.media.cuda import open_cuda
    from kvserver.protocol.layout import KVLayout

    handle = bytes(range(64))

    def ref(prefix: bytes):
        return pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=prefix + handle, device_uuid=UUID,
                                                    allocation_size=1 << 20),
                            offset=0, token_stride=128, head_stride=2048)

    with pytest.raises(InvalidArgument, match="overlap in the same memory"):
        open_cuda([ref(forms[0]), ref(forms[1])], 16, KVLayout.mha(2, 64), torch.float16, 16, 2)


def _settled(read, seconds: float = 8.0, still: float = 0.4):
    """``read()`` once it has not changed for ``still`` seconds (at most ``seconds`` in all)."""
    deadline = time.monotonic() + seconds
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            break
    return last


@pytest.mark.parametrize(("kind", "page_size", "tokens", "parts"), [
    ("write", 16, False, 2),  # the copy kernel: its four uploads, one launch, the write's record
    ("load", 16, False, 2),  # the copy kernel: its uploads, a launch and a record a layer
    ("write", 64, False, 2),  # DMA: a copy a (layer, part, page), the record
    ("load", 16, True, 1),  # scattered tokens, one part a layer (MLA)
])
def test_a_stalled_stream_never_holds_a_copy_worker(daemon_factory, fake, monkeypatch, kind, page_size,
                                                     tokens, parts):
    """Engine A's copies behind a ready event that never fires fill its stream, and a driver call
    into a full queue waits for room: the copy worker making it, and with it every engine's copies,
    would wait until the event fires, for good if it never does. The daemon puts at most
    ``plan.MAX_QUEUED`` calls on a pool's stream for jobs not ended (counted exactly) and holds A's
    later jobs in its queue: engine B's copies go on at once, and A's held ones go once the event
    fires, each landing whole."""
    from kvserver.media.cuda import plan

    monkeypatch.setattr(plan, "MAX_QUEUED", 40, raising=False)
    d = daemon_factory(cuda_wait_seconds=30.0)  # A is not given up on within the test
    rt = fake.cuda.runtime
    rt.queue_depth = 48  # the stand-in driver's: past the daemon's bound
    heads, head_dim = 2, 128
    refs_a, kv_a, _ = cuda_pool(fake, heads, head_dim, parts=parts)
    refs_b, kv_b, _ = cuda_pool(fake, heads, head_dim, parts=parts)
    hung = (5151).to_bytes(8, "little") * 8
    rng = np.random.default_rng(page_size + parts)
    with grpc.insecure_channel(d.address) as ch:
        stub = ticketing_stub(ch, d.address)
        a = register(stub, refs_a, heads, head_dim, page_size)
        b = register(stub, refs_b, heads, head_dim, page_size)
        n = 2 * page_size
        host_a = list(stub.Alloc(pb.AllocRequest(client_id=a.client_id, num_tokens=n)).host_indices)
        host_b = list(stub.Alloc(pb.AllocRequest(client_id=b.client_id, num_tokens=n)).host_indices)
        dev = rng.permutation(TOKENS)[:n].tolist() if tokens else list(range(n))
        for kv in (kv_a, kv_b):
            kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)
        want_a, want_b = kv_a[:, :, dev].copy(), kv_b[:, :, dev].copy()
        for reg, host in ((a, host_a), (b, host_b)):  # the host pages hold the pools' rows
            copy_call(stub, "write", reg.client_id, host, dev, b"")
        if kind == "load":
            kv_a[:] = 0
        stream = d.run(lambda: d.core.clients[a.client_id].device.stream.ptr)
        rt.hang(hung)
        calls = []
        try:
            calls = [in_thread(lambda: copy_call(stub, kind, a.client_id, host_a, dev, hung))
                     for _ in range(12)]
            queued = _settled(lambda: rt.outstanding(stream))
            assert 0 < queued <= 40, f"{queued} calls on A's stream, past the daemon's bound of 40"
            assert d.run(lambda: d.core.clients[a.client_id].device.queued_calls) == queued
            assert any(t.is_alive() for t, _ in calls)  # A's later jobs are held, not failed
            t0 = time.monotonic()
            kv_b[:] = 0
            copy_call(stub, "load", b.client_id, host_b, dev, b"")
            copy_call(stub, "write", b.client_id, host_b, dev, b"")
            took = time.monotonic() - t0
            assert took < 1.0, f"B's load and write took {took:.2f} s behind A's full stream"
            assert np.array_equal(kv_b[:, :, dev], want_b)
        finally:
            rt.fire(hung)
            for t, _ in calls:
                t.join(20)
        assert [out.get("error") for _, out in calls] == [None] * 12
        assert rt.outstanding(stream) == 0
        assert d.run(lambda: d.core.clients[a.client_id].device.queued_calls) == 0
        kv_a[:] = 0
        copy_call(stub, "load", a.client_id, host_a, dev, b"")
        assert np.array_equal(kv_a[:, :, dev], want_a)


@pytest.mark.parametrize(("kind", "page_size"), [
    ("plain", 64),  # DMA: a copy a (layer, part, page)
    ("plain", 1),  # the copy kernel over token rows
    ("flashinfer", 16),  # blocks, heads side by side: token rows
    ("flashinfer_hnd", 16),  # blocks, heads apart: a row a (token, head)
    ("flashinfer_hnd", 1),
])
def test_a_job_counts_every_call_it_puts_on_the_stream(daemon, fake, monkeypatch, kind, page_size):
    """The calls a job is counted for (``job_calls``, held against ``plan.MAX_QUEUED``) are the
    calls its enqueue puts on the stream, with and without a ready event, for writes and loads of
    every kind of pool and copy."""
    from kvserver.media.cuda.pool import CudaDevicePool

    rt = fake.cuda.runtime
    counted: list[int] = []
    job_calls = CudaDevicePool.job_calls
    monkeypatch.setattr(CudaDevicePool, "job_calls", lambda *a: counted.append(job_calls(*a)) or counted[-1])
    heads, head_dim = 2, 128
    if kind == "plain":
        refs, _, _ = cuda_pool(fake, heads, head_dim)
    else:
        heads, head_dim = 4, 8
        refs, _, _ = vllm_cuda_pool(fake, kind, heads, head_dim)
    ready = (6161).to_bytes(8, "little") * 8
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, heads, head_dim, page_size)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=64)).host_indices)
        stream = daemon.run(lambda: daemon.core.clients[reg.client_id].device.stream.ptr)
        for call, event in (("write", b""), ("write", ready), ("load", b""), ("load", ready)):
            before = sum(s == stream for s, _, _ in rt.stream_ops)
            copy_call(stub, call, reg.client_id, host, list(range(64)), event)
            made = sum(s == stream for s, _, _ in rt.stream_ops) - before
            assert made == counted[-1], (call, bool(event), made, counted)
        assert daemon.run(lambda: daemon.core.clients[reg.client_id].device.queued_calls) == 0


def test_jobs_held_for_a_stalled_stream_end_with_its_pool(daemon_factory, fake, monkeypatch):
    """A stream that never drains: its enqueued writes are given up on at --cuda-wait-seconds and
    the pool fails; the jobs held for room end with them, as given up on, and put nothing more on
    the stream."""
    from kvserver.media.cuda import plan

    monkeypatch.setattr(plan, "MAX_QUEUED", 40)
    d = daemon_factory(cuda_wait_seconds=WAIT_S)
    rt = fake.cuda.runtime
    rt.queue_depth = 48
    refs, _, _ = cuda_pool(fake, 2, 128)
    hung = (7171).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            reg = register(stub, refs, 2, 128, 16)
            host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=32)).host_indices)
            stream = d.run(lambda: d.core.clients[reg.client_id].device.stream.ptr)
            t0 = time.monotonic()
            calls = [in_thread(lambda: copy_call(stub, "write", reg.client_id, host, list(range(32)), hung))
                     for _ in range(12)]
            for t, _ in calls:
                t.join(WAIT_S + 5)
            took = time.monotonic() - t0
            queued = rt.outstanding(stream)
            assert queued <= 40
            assert [out["error"].code() for _, out in calls] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 12
            assert took < WAIT_S + 3, f"the held jobs ended {took:.2f} s after they were sent"
            time.sleep(0.3)
            assert rt.outstanding(stream) == queued  # nothing more went on the stream
    finally:
        rt.fire(hung)


def test_a_job_past_the_bound_goes_beside_jobs_whose_engine_events_fired(daemon, fake):
    """Two jobs of 400 calls (a DMA write of many pages, a load of many layers) do not fit the
    512 calls a stream may hold, but a stream whose engine events have fired drains by itself: a
    call into its full queue waits for the GPU, not for an engine. So the second job goes beside
    the first (a healthy engine's jobs overlap as before the bound), unless an event the stream
    waits on has not fired; a job that fits goes either way."""
    from kvserver.media.cuda.pool import _Room

    rt = fake.cuda.runtime
    refs, _, _ = cuda_pool(fake, 2, 128)
    ready = (8181).to_bytes(8, "little") * 8
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        reg = register(stub, refs, 2, 128, 16)
        host = list(stub.Alloc(pb.AllocRequest(client_id=reg.client_id, num_tokens=16)).host_indices)
        copy_call(stub, "write", reg.client_id, host, list(range(16)), ready)  # the daemon opens the event
        pool = daemon.core.clients[reg.client_id].device
        first, beside = _Room(400, ready), _Room(400)
        assert pool._take_room(first)  # an empty stream
        assert pool._take_room(beside)  # the event the first waits on has fired
        pool._give_room(beside)
        rt.hang(ready)
        try:
            held, small = _Room(400), _Room(100, ready)
            assert not pool._take_room(held)  # the stream may never drain: the bound holds
            assert pool._take_room(small)  # 500 calls: within the bound
            assert pool.queued_calls == 500
        finally:
            rt.fire(ready)
        assert pool._take_room(held)
        for room in (first, small, held):
            pool._give_room(room)
        assert pool.queued_calls == 0 and not pool._on_stream


def _layers_pool(fake, layers: int, heads: int = 1, head_dim: int = 64, tokens: int = 16):
    """A plain CUDA pool of ``layers`` layers of two parts, ``tokens`` tokens each, in one export."""
    tb = heads * head_dim * 2
    buf = tokens * tb
    handle, mem = fake.cuda.runtime.export(layers * 2 * buf + 4096)
    return pb.DevicePool(num_tokens=tokens, layers=[pb.LayerBuffers(parts=[
        pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=b"\x02c" + handle, device_uuid=UUID,
                                             allocation_size=mem.size),
                     offset=4096 + (layer * 2 + p) * buf, token_stride=tb) for p in range(2)])
        for layer in range(layers)])


def _register_layers(stub, refs, layers: int, heads: int = 1, head_dim: int = 64):
    return stub.Register(pb.RegisterRequest(
        model="gpu", start_layer=0, end_layer=layers, num_layers=layers,
        layout=pb.KVLayout(mha=pb.MHALayout(num_heads=heads, head_dim=head_dim)), dtype=pb.DTYPE_FLOAT16,
        page_size=16, device_pool=refs, host_tokens=16, event_slots=1), timeout=30)


def test_a_cuda_pool_of_more_layers_than_one_job_may_call_for_is_refused(daemon, fake):
    """A kernel load makes two calls a layer: a pool of more layers than fit the 512 calls a job
    may make is refused at Register (before, one load of a 600-layer pool behind a ready event
    that never fired put 1209 calls on an empty stream and held its copy worker in a driver call
    for good: the wait that gives a pool up starts only once the enqueue returns)."""
    from kvserver.media.cuda import plan

    too_many = plan.max_layers() + 1
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            _register_layers(stub, _layers_pool(fake, too_many), too_many)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"a CUDA pool has at most {plan.max_layers()} layers" in err.value.details()


@pytest.mark.parametrize(("heads", "head_dim"), [(1, 64), (8, 128)], ids=["kernel", "dma-sized-rows"])
def test_the_largest_job_of_the_most_layers_never_holds_a_copy_worker(daemon_factory, fake, heads,
                                                                       head_dim):
    """Two pools of the most layers a CUDA pool may have, each loading behind a ready event that
    never fires, with the stand-in driver's depth at the bound (512 calls): no job passes it, so
    neither copy worker waits in a driver call, engine B's load goes at once, and both pools are
    given up on at --cuda-wait-seconds."""
    from kvserver.media.cuda import plan

    d = daemon_factory(cuda_wait_seconds=1.0, host_memory=256 << 20)  # two copy workers
    rt = fake.cuda.runtime
    rt.queue_depth = plan.MAX_QUEUED
    layers = plan.max_layers()
    hung = (9191).to_bytes(8, "little") * 8
    with grpc.insecure_channel(d.address) as ch:
        stub = ticketing_stub(ch, d.address)
        regs = [_register_layers(stub, _layers_pool(fake, layers, heads, head_dim), layers, heads, head_dim)
                for _ in range(2)]
        b = _register_layers(stub, _layers_pool(fake, 4, heads, head_dim), 4, heads, head_dim)
        hosts = {r.client_id: list(stub.Alloc(pb.AllocRequest(client_id=r.client_id,
                                                               num_tokens=16)).host_indices)
                 for r in (*regs, b)}
        dev = list(range(16))
        for r in (*regs, b):
            copy_call(stub, "write", r.client_id, hosts[r.client_id], dev, b"")
        rt.hang(hung)
        loads = []
        try:
            loads = [in_thread(lambda r=r: copy_call(stub, "load", r.client_id, hosts[r.client_id], dev,
                                                     hung)) for r in regs]
            time.sleep(0.5)
            for r in regs:
                stream = d.run(lambda r=r: d.core.clients[r.client_id].device.stream.ptr)
                assert 0 < rt.outstanding(stream) <= plan.MAX_QUEUED
            t0 = time.monotonic()
            copy_call(stub, "load", b.client_id, hosts[b.client_id], dev, b"")
            assert time.monotonic() - t0 < 1.0, "B's load waited behind a copy worker held in a driver call"
            for t, _ in loads:
                t.join(10)
            assert [out["error"].code() for _, out in loads] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
        finally:
            rt.fire(hung)


def test_registrations_of_one_tenant_at_once_make_no_room_for_what_its_region_quota_refuses(
        daemon_factory, fake, monkeypatch):
    """Registrations of one tenant under way at once (CUDA pools: no per-uid lock orders their
    openings, which take seconds in life) each passed the region-quota check, each made its room
    (evicting other tenants' cached pages for it), and all but one were then refused by the quota.
    What a registration may take is booked while its room is made: the others are refused before
    they make any."""
    from kvserver.core import rooms

    d = daemon_factory(host_memory=64 << 20, tenant_region_quota="10MiB")
    made: list[int] = []
    real_make = rooms.Rooms.make

    async def make(self, need: int, most: int) -> None:  # a room that takes a while to make
        made.append(most)
        await asyncio.sleep(0.5)
        await real_make(self, need, most)

    monkeypatch.setattr(rooms.Rooms, "make", make)
    pools = [cuda_pool(fake, 2, 128)[0] for _ in range(3)]
    results: list[str] = [""] * 3

    def register_one(i: int) -> None:
        time.sleep(0.2 * i)  # in turn, each while the one before makes its room
        with grpc.insecure_channel(d.address) as ch:
            req = pb.RegisterRequest(model="gpu", start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                                     layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=128)),
                                     dtype=pb.DTYPE_FLOAT16, page_size=16, device_pool=pools[i],
                                     host_tokens=(10 << 20) // (LAYERS * 2 * 2 * 128 * 2), event_slots=2)
            try:
                ticketing_stub(ch, d.address).Register(req, timeout=30)
                results[i] = "OK"
            except grpc.RpcError as exc:
                results[i] = exc.code().name

    threads = [threading.Thread(target=register_one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == ["OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"], results
    assert len(made) == 1, f"{len(made)} rooms made for one registration granted"


def test_a_quarantined_pools_region_counts_in_its_tenants_region_quota_and_the_refusal_says_so(
        daemon_factory, fake):
    """A CUDA pool quarantined at its release (its GPU copy hung) holds its host region until its
    stream drains, and so its tenant's share of --tenant-region-quota: a Register meanwhile is
    refused saying that quarantined pools hold it (not just "unregister one", when there is none
    to unregister), and goes through once the quarantine has drained."""
    d = daemon_factory(host_memory=64 << 20, tenant_region_quota="2MiB", cuda_wait_seconds=WAIT_S)
    rt = fake.cuda.runtime
    hung = (779).to_bytes(8, "little") * 8
    rt.hang(hung)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            reg = register(stub, cuda_pool(fake, 2, 64)[0], 2, 64, 16)
            with pytest.raises(grpc.RpcError):  # a cache Put behind the hung event: stalls, then fails
                stub.Put(pb.PutRequest(client_id=reg.client_id, keys=bytes(range(16)) * 2, key_bytes=16,
                                       device_pages=[0, 1], ready_event=hung), timeout=20)
            assert wait_for(lambda: d.run(lambda: bool(d.core._quarantined) and not d.core.clients))
            again = cuda_pool(fake, 2, 64)[0]
            with pytest.raises(grpc.RpcError) as err:
                register(stub, again, 2, 64, 16)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert f"({2 << 20} of them regions of CUDA pools quarantined until their GPU work drains)" \
                in err.value.details(), err.value.details()
            rt.fire(hung)  # the copy lands at last: the quarantine drains, its share comes back
            assert wait_for(lambda: d.run(lambda: not d.core._quarantined))
            assert wait_for(lambda: d.run(lambda: not d.core._region_bytes_by_tenant))
            register(stub, again, 2, 64, 16)
    finally:
        rt.fire(hung)


def test_a_cuda_put_whose_copy_ends_after_its_deadline_stores_nothing(daemon_factory, fake):
    """A Put already on the GPU cannot be stopped: its copy waits for the engine's ready event,
    which fires after the Put's deadline (within --cuda-wait-seconds, so nothing stalls). The copy
    then reads device pages its engine may have reused by then: it is answered DEADLINE_EXCEEDED,
    job ended, and its pages are not stored (they were, before). A Put whose event fires in time
    stores its pages."""
    d = daemon_factory(cuda_wait_seconds=5.0)  # the late event is held 0.5 s: far from a stall
    rt = fake.cuda.runtime
    late = (780).to_bytes(8, "little") * 8
    rt.hang(late)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            reg = register(stub, cuda_pool(fake, 2, 64)[0], 2, 64, 16)
            keys = bytes(range(32))  # two keys
            put = in_thread(lambda: stub.Put(pb.PutRequest(
                client_id=reg.client_id, keys=keys, key_bytes=16, device_pages=[0, 1], ready_event=late,
                timeout_ms=200), timeout=20))
            assert wait_for(lambda: being_written(d) == 2)
            time.sleep(0.5)  # past the Put's deadline (it came before its pages), within --cuda-wait-seconds
            rt.fire(late)
            put[0].join(20)
            err = put[1].get("error")
            assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, put[1]
            assert "copy ended after its timeout_ms" in err.details(), err.details()
            assert ("kvserver-job", "ended") in tuple(err.trailing_metadata())
            lookup = pb.LookupRequest(client_id=reg.client_id, keys=keys, key_bytes=16)
            assert stub.Lookup(lookup, timeout=10).pages == 0, "a Put ended past its deadline was stored"
            again = pb.PutRequest(client_id=reg.client_id, keys=keys, key_bytes=16, device_pages=[0, 1],
                                  timeout_ms=5000)
            assert stub.Put(again, timeout=20).stored == 2
            assert stub.Lookup(lookup, timeout=10).pages == 2
    finally:
        rt.fire(late)


@pytest.mark.parametrize("own_first", [True, False], ids=["own keys first", "waited keys first"])
def test_a_put_whose_waited_keys_end_late_keeps_and_reports_its_own_pages(daemon_factory, fake, own_first):
    """Put B stores its own two keys in time, then waits for two keys Put A is writing. A's copy
    ends after A's deadline (its engine's event fires late): A keeps nothing, and B stores those
    keys itself, behind its own engine's event, which now fires after B's deadline: that copy
    keeps nothing either. B's own pages stay stored, and B answers its keys' stored prefix (own
    keys first: stored 2, the 2 it could not store dropped, last; A's keys first: none of the
    prefix, all 4 dropped), not DEADLINE_EXCEEDED, which would say nothing of it was kept."""
    d = daemon_factory(cuda_wait_seconds=5.0)  # no hung event here is held that long
    rt = fake.cuda.runtime
    ev_a, ev_b = ((781 + i).to_bytes(8, "little") * 8 for i in range(2))
    theirs, own = bytes(range(32)), bytes(range(100, 132))  # two keys each
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = ticketing_stub(ch, d.address)
            ra = register(stub, cuda_pool(fake, 2, 64)[0], 2, 64, 16)
            rb = register(stub, cuda_pool(fake, 2, 64)[0], 2, 64, 16)

            def put(reg, keys: bytes, pages: list[int], event: bytes, timeout_ms: int):
                return stub.Put(pb.PutRequest(client_id=reg.client_id, keys=keys, key_bytes=16,
                                              device_pages=pages, ready_event=event, timeout_ms=timeout_ms),
                                timeout=20)

            def held(keys: bytes) -> int:
                return stub.Lookup(pb.LookupRequest(client_id=rb.client_id, keys=keys, key_bytes=16),
                                   timeout=10).pages

            put(rb, bytes(range(200, 216)), [9], ev_b, 5000)  # B's event opened (and fired)
            rt.hang(ev_a)
            a = in_thread(lambda: put(ra, theirs, [0, 1], ev_a, 300))
            assert wait_for(lambda: being_written(d) == 2)
            a_seen = time.monotonic()  # A came before: its deadline is at most 300 ms from here
            keys_b = own + theirs if own_first else theirs + own
            b = in_thread(lambda: put(rb, keys_b, [2, 3, 4, 5], ev_b, 1500))
            assert wait_for(lambda: held(own) == 2), "B's own pages were not stored in time"
            b_seen = time.monotonic()  # B came before: its deadline is at most 1.5 s from here
            rt.hang(ev_b)  # B's engine's next event: B's copy of A's keys waits for it
            time.sleep(max(0.0, a_seen + 0.45 - time.monotonic()))  # past A's deadline
            rt.fire(ev_a)  # A's copy ends late: nothing kept; B stores A's keys itself
            time.sleep(max(0.0, b_seen + 1.7 - time.monotonic()))  # past B's deadline
            rt.fire(ev_b)
            for t, _ in (a, b):
                t.join(20)
            assert a[1]["error"].code() == grpc.StatusCode.DEADLINE_EXCEEDED, a[1]
            assert "error" not in b[1], b[1]["error"].details()
            answer = (b[1]["result"].stored, b[1]["result"].dropped)
            assert answer == ((2, 2) if own_first else (0, 4)), b[1]["result"]
            assert held(own) == 2 and held(theirs) == 0
    finally:
        rt.fire_all()
