"""Pools laid out as vLLM 0.33's attention backends (docs/layouts.md) over one memfd, through the
real daemon: Write then Load, and cache Put then Get (across layouts too), bit for bit, and no byte
outside the named tokens touched."""

from __future__ import annotations

import pytest
import torch
from checks import Described

from kvclient import KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys

LAYERS, TOKENS, BLOCK = 4, 256, 16
MHA, MLA = KVLayout.mha(4, 16), KVLayout.mla(16, 8)
DTYPE = torch.bfloat16
KINDS = ["flash_attn", "flashinfer", "flash_attn_hnd", "flashinfer_hnd", "mla"]


def pool_of(kind: str | None, mla: bool = False) -> ShmKVPool:
    return ShmKVPool(MLA if mla or kind == "mla" else MHA, DTYPE, LAYERS, TOKENS, vllm_layout=kind,
                     block_size=BLOCK)


def tokens_of(buf: torch.Tensor) -> torch.Tensor:
    """A buffer's bytes in token order: [tokens, heads, head bytes] (a copy)."""
    n = buf.shape[0] * buf.shape[1] if buf.dim() == 4 else buf.shape[0]
    return buf.reshape(n, buf.shape[-2], buf.shape[-1]).contiguous().view(torch.uint8)


def fill(pool: ShmKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for buf in layer:
            b = buf.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def wipe(pool: ShmKVPool) -> None:
    pool._shm.mm[:] = bytes(len(pool._shm.mm))


def snapshot(pool: ShmKVPool) -> list[list[torch.Tensor]]:
    return [[tokens_of(b) for b in layer] for layer in pool.buffers]


def register(client: KVClient, pool: ShmKVPool, page_size: int, host_tokens: int = 128):
    return client.register(model=f"vllm-{pool.layout.is_mla}", pool=pool, start_layer=0, end_layer=LAYERS,
                           num_layers=LAYERS, host_tokens=host_tokens, page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 4, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_write_then_load_is_exact_in_each_vllm_layout(daemon, kind, page_size):
    with pool_of(kind) as pool, KVClient(daemon.address) as client:
        fill(pool, seed=1)
        original = snapshot(pool)
        register(client, pool, page_size)
        host = client.alloc(64)
        g = torch.Generator().manual_seed(2)
        if page_size == 1:
            dev = torch.randperm(TOKENS, generator=g)[:64]
        else:
            pages = torch.randperm(TOKENS // page_size, generator=g)[: 64 // page_size]
            dev = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        client.write(host_indices=host, device_indices=dev)
        wipe(pool)
        client.load(host_indices=host, device_indices=dev).wait()
        others = torch.ones(TOKENS, dtype=torch.bool)
        others[dev] = False
        for layer, bufs in enumerate(pool.buffers):
            for part, buf in enumerate(bufs):
                got = tokens_of(buf)
                assert torch.equal(got[dev], original[layer][part][dev]), (layer, part)
                assert not got[others].any(), "the load wrote tokens it was not given"


@pytest.mark.parametrize(("src", "dst"), [("flashinfer", "flashinfer"), ("flashinfer_hnd", None),
                                          (None, "flash_attn_hnd"), ("flash_attn", "flashinfer_hnd"),
                                          ("mla", None)])
def test_cache_put_then_get_across_layouts(daemon, src, dst):
    """The cache holds pages in one layout whatever the pool's: a page put from one layout comes
    back the same in another."""
    mla = "mla" in (src, dst)
    page = 16
    keys = page_keys(range(4 * page), page)
    with pool_of(src, mla) as a, pool_of(dst, mla) as b, KVClient(daemon.address) as ca, \
            KVClient(daemon.address) as cb:
        register(ca, a, page, 0)
        register(cb, b, page, 0)
        fill(a, seed=3)
        original = snapshot(a)
        assert ca.put(keys, [3, 0, 9, 5]).stored == 4
        handle = cb.get(keys, [1, 2, 7, 15])
        assert handle.pages() == 4
        handle.wait()
        for layer in range(LAYERS):
            for part, buf in enumerate(b.buffers[layer]):
                got = tokens_of(buf)
                for p_src, p_dst in zip([3, 0, 9, 5], [1, 2, 7, 15], strict=True):
                    assert torch.equal(got[p_dst * page:(p_dst + 1) * page],
                                       original[layer][part][p_src * page:(p_src + 1) * page])


def test_buffers_of_one_pool_with_different_geometries_are_refused(daemon):
    with pool_of("flashinfer") as pool, KVClient(daemon.address) as client:
        desc = pool.descriptor()
        desc.layers[1].parts[0].block_stride *= 2  # now past the object, so: the size check
        desc.layers[1].parts[0].offset = 0
        with pytest.raises(Exception, match="overlap|bytes but the buffer"):
            client.register(model="bad", pool=Described(pool, desc), start_layer=0, end_layer=LAYERS,
                            num_layers=LAYERS, host_tokens=0, page_size=16)
