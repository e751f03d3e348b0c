"""The addressing rule of docs/layouts.md against real tensors in each vLLM 0.33 layout: the
BufferRef fields a client sends for a layout are accepted, and every (token, head) the rule names is
where torch keeps it."""

from __future__ import annotations

import pytest
import torch

from kvserver import geometry
from kvserver.errors import InvalidArgument
from kvserver.v1 import kvserver_pb2 as pb

NB, BS, H, D = 6, 16, 4, 8  # blocks, block size, heads, head_dim
DT = torch.bfloat16


def _layout(name: str):
    """(tensor, {part: view [tokens, heads, D]} in token order) for one layer of ``name``."""
    if name == "flash_attn":
        t = torch.empty(2, NB, BS, H, D, dtype=DT)
        return t, [t[p].reshape(NB * BS, H, D) for p in range(2)]
    if name == "flashinfer":
        t = torch.empty(NB, 2, BS, H, D, dtype=DT)
        return t, [t[:, p] for p in range(2)]
    if name == "mla":
        t = torch.empty(NB, BS, 1, D * H, dtype=DT)
        return t, [t]
    if name == "flash_attn_hnd":
        t = torch.empty(2, NB, H, BS, D, dtype=DT)
        return t, [t[p].transpose(1, 2) for p in range(2)]
    if name == "flashinfer_hnd":
        t = torch.empty(NB, 2, H, BS, D, dtype=DT)
        return t, [t[:, p].transpose(1, 2) for p in range(2)]
    raise AssertionError(name)


def _ref(base: int, view: torch.Tensor) -> pb.BufferRef:
    """What a client sends for a [blocks, block, heads, D] (or [tokens, heads, D]) view."""
    w = view.element_size()
    if view.dim() == 3:  # no blocks
        return pb.BufferRef(offset=view.data_ptr() - base, token_stride=view.stride(0) * w,
                            head_stride=view.stride(1) * w)
    return pb.BufferRef(offset=view.data_ptr() - base, block_tokens=view.shape[1],
                        block_stride=view.stride(0) * w, token_stride=view.stride(1) * w,
                        head_stride=view.stride(2) * w)


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer", "mla", "flash_attn_hnd", "flashinfer_hnd"])
def test_each_vllm_layout_is_described_exactly(name):
    t, views = _layout(name)
    base, n = t.data_ptr(), NB * BS
    heads = views[0].shape[-2]
    head_bytes = views[0].shape[-1] * t.element_size()
    refs = [_ref(base, v) for v in views]
    geoms = [geometry.of_ref(r, n, heads, head_bytes, f"buffer {i}") for i, r in enumerate(refs)]
    geometry.check_no_overlap(geoms, ["one"] * len(geoms), n, lambda i: f"buffer {i}")
    assert max(g.span(n)[1] for g in geoms) <= t.numel() * t.element_size()
    assert geoms[0].plain == (name in ("flash_attn", "mla"))
    tokens = torch.arange(n)
    for g, v in zip(geoms, views, strict=True):
        per_token = torch.from_numpy(g.token_offsets(tokens.numpy()))
        want = torch.tensor([v[t // BS, t % BS].data_ptr() if v.dim() == 4 else v[t].data_ptr()
                             for t in range(n)]) - base
        assert (per_token + g.offset == want).all()
        head_step = v.stride(-2) * t.element_size()
        assert g.head_stride == head_step or (heads == 1 and g.head_stride == head_bytes)


def test_interleaved_buffers_that_do_overlap_are_refused():
    """Two FlashInfer parts at the same offset within a block share bytes even though their spans
    interleave like K's and V's do."""
    r = pb.BufferRef(offset=0, block_tokens=BS, block_stride=2 * BS * 64, token_stride=64)
    g = geometry.of_ref(r, NB * BS, H, 16, "k")
    r2 = pb.BufferRef(offset=BS * 64 - 64, block_tokens=BS, block_stride=2 * BS * 64, token_stride=64)
    g2 = geometry.of_ref(r2, NB * BS, H, 16, "v")
    with pytest.raises(InvalidArgument, match="buffer 0 and buffer 1 overlap"):
        geometry.check_no_overlap([g, g2], ["x", "x"], NB * BS, lambda i: f"buffer {i}")
    geometry.check_no_overlap([g, g2], ["x", "y"], NB * BS, lambda i: f"buffer {i}")  # other objects


def test_blocks_that_follow_like_tokens_are_the_plain_rule():
    r = pb.BufferRef(offset=128, block_tokens=BS, block_stride=BS * 64, token_stride=64)
    g = geometry.of_ref(r, NB * BS, H, 16, "k")
    assert g.plain and g.span(NB * BS) == (128, 128 + NB * BS * 64)
