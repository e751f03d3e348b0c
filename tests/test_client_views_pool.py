"""vLLM 0.33's own per-layer KV cache views (create_kv_cache_views over a SharedKVMemory), in each
of its six layouts, registered with a real daemon as they lie (kvclient.views_pool.KVViewsPool):
cache Put from one engine's layout and Get into another's, Write then Load, bit for bit; bad views
refused by the client, a tampered description by the daemon; the CUDA BufferRef fields computed
on CPU tensors."""

from __future__ import annotations

import os
import tempfile

import grpc
import pytest
import torch
import vllm_env
from checks import Described
from conftest import DaemonThread

from kvclient import KVClient, KVLayout
from kvclient.errors import KVClientError
from kvclient.keys import page_keys
from kvclient.views_pool import KVViewsPool, SharedKVMemory, shared_memory_of, view_fields
from kvserver.config import ServerConfig

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)

LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
# Each layout once as the source and once as the destination of a cache round trip.
PAIRS = list(zip(LAYOUTS, LAYOUTS[2:] + LAYOUTS[:2], strict=True))
LAYERS, BLOCKS, BLOCK = 3, 24, 16
HEADS, HEAD_SIZE = 2, 16
RANK, ROPE = 32, 16  # MLA latent: kv_lora_rank + rope dim


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory(prefix="kvs-") as d:
        dt = DaemonThread(ServerConfig(socket=os.path.join(d, "kv.sock"), host_memory=256 << 20))
        try:
            yield dt
        finally:
            dt.stop()


def spec_of(mla: bool, dtype: torch.dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if mla:
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=RANK + ROPE, dtype=dtype)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)


def layout_of(mla: bool) -> KVLayout:
    return KVLayout.mla(RANK, ROPE) if mla else KVLayout.mha(HEADS, HEAD_SIZE)


class Engine:
    """One engine's KV cache as vLLM 0.33 builds it: one raw buffer (a SharedKVMemory) carved by
    create_kv_cache_views into per-layer [B, H, N, C] views in ``layout``."""

    def __init__(self, layout: str, mla: bool, dtype: torch.dtype, blocks: int = BLOCKS) -> None:
        from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        spec = spec_of(mla, dtype)
        lay = KVCacheLayout[layout]
        strides = compute_layout_strides(spec, blocks, LAYERS, lay)
        tensor = KVCacheTensor(size=spec.page_size_bytes * blocks * LAYERS,
                               layers=[f"layer.{i}" for i in range(LAYERS)],
                               layer_stride=strides[0], block_stride=strides[1])
        self.mem = SharedKVMemory(tensor.size)
        self.views = create_kv_cache_views(self.mem.tensor, spec, blocks, lay, tensor)
        parts = [[v] if mla else [v[..., :HEAD_SIZE], v[..., HEAD_SIZE:]] for v in self.views]
        self.pool = KVViewsPool(layout_of(mla), dtype, parts)
        self.mla, self.dtype = mla, dtype

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for v in self.views:
            b = v.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))

    def block(self, layer: int, part: int, b: int) -> torch.Tensor:
        """Block ``b`` of (layer, part) as bytes [H, N, head bytes] (a copy)."""
        return self.pool.buffers[layer][part][b].contiguous().view(torch.uint8)

    def close(self) -> None:
        self.views = []
        self.pool = None
        self.mem.close()


def register(client: KVClient, pool: KVViewsPool, model: str, host_tokens: int = 0, page_size: int = BLOCK):
    return client.register(model=model, pool=pool, start_layer=0, end_layer=LAYERS, num_layers=LAYERS,
                           host_tokens=host_tokens, page_size=page_size)


CASES = [pytest.param(a, b, False, torch.float16, id=f"mha-fp16-{a}-{b}") for a, b in PAIRS] + \
    [pytest.param(a, b, False, torch.bfloat16, id=f"mha-bf16-{a}-{b}") for a, b in PAIRS] + \
    [pytest.param(a, b, True, torch.bfloat16, id=f"mla-bf16-{a}-{b}") for a, b in PAIRS]


@pytest.mark.parametrize(("src", "dst", "mla", "dtype"), CASES)
def test_cache_put_then_get_between_engines_in_other_layouts(daemon, src, dst, mla, dtype):
    """Two engines of one model space (same model, layout, dtype, page_size = block), each with
    vLLM's own views in its layout: blocks put by A come back bit for bit in other blocks of B,
    and B's other blocks are untouched."""
    a, b = Engine(src, mla, dtype), Engine(dst, mla, dtype, blocks=BLOCKS + 8)
    model = f"views-{mla}-{dtype}-{src}-{dst}"
    src_blocks, dst_blocks = [3, 0, 17, 9, 23], [30, 2, 11, 4, 19]
    keys = page_keys(range(len(src_blocks) * BLOCK), BLOCK)
    try:
        with KVClient(daemon.address) as ca, KVClient(daemon.address) as cb:
            register(ca, a.pool, model)
            register(cb, b.pool, model)
            a.fill(seed=LAYOUTS.index(src) * 8 + LAYOUTS.index(dst))
            want = [[[a.block(layer, part, s) for s in src_blocks] for part in range(len(a.pool.buffers[0]))]
                    for layer in range(LAYERS)]
            assert ca.put(keys, src_blocks).stored == len(src_blocks)
            handle = cb.get(keys, dst_blocks)
            assert handle.pages() == len(src_blocks)
            handle.wait()
            for layer in range(LAYERS):
                for part in range(len(b.pool.buffers[0])):
                    for i, d in enumerate(dst_blocks):
                        assert torch.equal(b.block(layer, part, d), want[layer][part][i]), (layer, part, d)
            others = [x for x in range(BLOCKS + 8) if x not in dst_blocks]
            for v in b.views:
                assert not v.view(torch.uint8)[others].any(), "the Get wrote blocks it was not given"
            ca.unregister()
            cb.unregister()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_then_load_through_the_views(daemon, layout, mla):
    e = Engine(layout, mla, torch.bfloat16)
    try:
        with KVClient(daemon.address) as client:
            register(client, e.pool, f"views-wl-{mla}-{layout}", host_tokens=128, page_size=4)
            e.fill(seed=5)
            original = e.mem.tensor.clone()
            host = client.alloc(64)
            g = torch.Generator().manual_seed(6)
            pages = torch.randperm(BLOCKS * BLOCK // 4, generator=g)[:16]
            dev = (pages[:, None] * 4 + torch.arange(4)).reshape(-1)
            client.write(host_indices=host, device_indices=dev)
            e.mem.tensor.zero_()
            client.load(host_indices=host, device_indices=dev).wait()
            picked = torch.zeros(BLOCKS * BLOCK, dtype=torch.bool)
            picked[dev] = True
            bt = picked.view(BLOCKS, BLOCK)
            for layer, parts in enumerate(e.pool.buffers):
                for part, v in enumerate(parts):
                    got = v.view(torch.uint8).transpose(1, 2)[bt]  # [tokens, H, bytes]
                    was = torch.as_strided(original, v.view(torch.uint8).shape, v.view(torch.uint8).stride(),
                                           v.data_ptr() - e.mem.base).transpose(1, 2)[bt]
                    assert torch.equal(got, was), (layer, part)
                    assert not v.view(torch.uint8).transpose(1, 2)[~bt].any(), "the Load wrote other tokens"
            client.unregister()
    finally:
        e.close()


def test_descriptor_of_each_layout_is_the_views_addressing():
    """Every (block, head, slot) the BufferRef rule names is where the view keeps it."""
    for layout in LAYOUTS:
        e = Engine(layout, False, torch.float16, blocks=4)
        try:
            desc = e.pool.descriptor()
            assert desc.num_tokens == 4 * BLOCK and e.pool.num_tokens == 4 * BLOCK
            assert e.pool.block_tokens == BLOCK and e.pool.num_layers == LAYERS
            assert e.pool.fds == e.mem.fds and len(e.pool.fds) == 1
            for layer, lb in enumerate(desc.layers):
                for part, r in enumerate(lb.parts):
                    v = e.pool.buffers[layer][part]
                    assert r.WhichOneof("location") == "fd" and r.block_tokens == BLOCK
                    for blk, h, t in [(0, 0, 0), (3, 1, 15), (2, 0, 7), (1, 1, 0)]:
                        addr = r.offset + blk * r.block_stride + t * r.token_stride + h * r.head_stride
                        assert addr == v[blk, h, t].data_ptr() - e.mem.base, (layout, layer, part)
        finally:
            e.close()


def test_bad_views_are_value_errors():
    e = Engine("LBNHC", False, torch.float16, blocks=4)
    other = Engine("BLHNC", False, torch.float16, blocks=4)
    lay = layout_of(False)
    try:
        parts = e.pool.buffers
        outside = torch.zeros(4, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.float16)
        with pytest.raises(ValueError, match="SharedKVMemory"):
            KVViewsPool(lay, torch.float16, [[outside[..., :HEAD_SIZE], outside[..., HEAD_SIZE:]]])
        assert shared_memory_of(outside) is None and shared_memory_of(parts[1][0]) is e.mem
        with pytest.raises(ValueError, match="shape .* strides"):  # another layout's strides
            KVViewsPool(lay, torch.float16, [parts[0], other.pool.buffers[1]])
        # same strides, but in another SharedKVMemory
        twin = Engine("LBNHC", False, torch.float16, blocks=4)
        try:
            with pytest.raises(ValueError, match="not in the SharedKVMemory"):
                KVViewsPool(lay, torch.float16, [parts[0], twin.pool.buffers[0]])
        finally:
            twin.close()
        with pytest.raises(ValueError, match="dtype"):
            KVViewsPool(lay, torch.bfloat16, parts)
        with pytest.raises(ValueError, match="does not match the layout"):
            KVViewsPool(KVLayout.mha(HEADS, HEAD_SIZE * 2), torch.float16, parts)
        with pytest.raises(ValueError, match="does not match the layout"):
            KVViewsPool(KVLayout.mha(1, HEAD_SIZE), torch.float16, parts)
        with pytest.raises(ValueError, match="needs 2 view"):
            KVViewsPool(lay, torch.float16, [[parts[0][0]]])
        flat = e.mem.tensor.view(torch.float16)
        k = parts[0][0]
        skipping = torch.as_strided(flat, k.shape, (*k.stride()[:3], 2), k.storage_offset())
        with pytest.raises(ValueError, match="element stride 1"):
            KVViewsPool(lay, torch.float16, [[skipping, skipping]])
        meta = torch.empty(k.shape, dtype=torch.float16, device="meta")
        with pytest.raises(ValueError, match="one device"):
            KVViewsPool(lay, torch.float16, [parts[0], [meta, meta]])
        with pytest.raises(ValueError, match="4D"):
            KVViewsPool(lay, torch.float16, [[k[0], k[0]]])
    finally:
        e.close()
        other.close()
    assert shared_memory_of(e.mem.tensor) is None  # closed: not live any more


@pytest.mark.parametrize("tamper", ["heads-into-blocks", "v-into-k"])
def test_a_tampered_description_is_refused_by_the_daemon(daemon, tamper):
    e = Engine("LHBNC", False, torch.float16, blocks=8)
    try:
        desc = e.pool.descriptor()
        for lb in desc.layers:
            for r in lb.parts:
                if tamper == "heads-into-blocks":  # head 1 starts inside head 0's last block
                    r.head_stride -= r.block_stride
        if tamper == "v-into-k":  # V half a head after K: they share bytes
            desc.layers[1].parts[1].offset = desc.layers[1].parts[0].offset + HEAD_SIZE
        with KVClient(daemon.address) as client:
            before = client.stats(all_clients=True).num_clients
            with pytest.raises(KVClientError) as err:
                register(client, Described(e.pool, desc), f"views-bad-{tamper}")
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "overlap" in err.value.message
            assert client.stats(all_clients=True).num_clients == before, "nothing registered"
    finally:
        e.close()


def test_register_with_the_asyncio_client(daemon):
    import asyncio

    from kvclient import AsyncKVClient

    e = Engine("BHLNC", True, torch.bfloat16, blocks=4)

    async def go():
        async with AsyncKVClient(daemon.address) as client:
            reg = await client.register(model="views-aio", pool=e.pool, start_layer=0, end_layer=LAYERS,
                                        num_layers=LAYERS, host_tokens=32, page_size=BLOCK)
            assert reg.host_tokens == 32
            await client.unregister()

    try:
        asyncio.run(go())
    finally:
        e.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_cuda_ref_fields_computed_on_cpu_tensors(mla):
    """What a CUDA pool sends per view (``view_fields``: offset inside the storage and the byte
    strides), checked on CPU tensors of each layout: [B, H, N, C] view strides in elements times
    the item size, offsets of the layers and of V, formulas of docs/layouts.md."""
    B, L, w = 5, LAYERS, 2
    H, C = (1, RANK + ROPE) if mla else (HEADS, 2 * HEAD_SIZE)
    N, hb = BLOCK, (C if mla else HEAD_SIZE) * w
    page = H * N * C * w
    want = {  # layout: (block_stride, head_stride, token_stride, layer offset step)
        "LBHNC": (page, N * C * w, C * w, B * page),
        "LBNHC": (page, C * w, H * C * w, B * page),
        "LHBNC": (N * C * w, B * N * C * w, C * w, B * page),
        "BLHNC": (L * page, N * C * w, C * w, page),
        "BLNHC": (L * page, C * w, H * C * w, page),
        "BHLNC": (L * page, L * N * C * w, C * w, N * C * w),
    }
    for layout, (bs, hs, ts, step) in want.items():
        e = Engine(layout, mla, torch.bfloat16, blocks=B)
        try:
            for layer, parts in enumerate(e.pool.buffers):
                for part, v in enumerate(parts):
                    f = view_fields(v)
                    assert f == {"offset": layer * step + part * hb, "block_tokens": N, "block_stride": bs,
                                 "head_stride": hs, "token_stride": ts}, (layout, layer, part)
        finally:
            e.close()
