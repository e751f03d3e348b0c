"""The addressing rule of docs/layouts.md against real tensors in each vLLM 0.33 layout: the
BufferRef fields a client sends for a layout are accepted, and every (token, head) the rule names is
where torch keeps it."""

from __future__ import annotations

import pytest
import torch

from kvserver.copies import geometry
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


def test_one_check_per_buffer_shape_and_a_bounded_cost_for_any_description():
    """A hostile pool description must not hold the daemon's event loop: the within-buffer check
    runs once per distinct shape (a real pool's layers share one), and the whole request's checks
    have a budget, past which it is refused with INVALID_ARGUMENT."""
    head_bytes = D * 2
    hnd = dict(block_tokens=BS, block_stride=2 * H * BS * head_bytes, token_stride=head_bytes,
               head_stride=BS * head_bytes)
    budget = geometry.CheckBudget()
    for layer in range(200):  # 200 layers of one HND shape: checked once
        geometry.of_ref(pb.BufferRef(offset=layer * NB * hnd["block_stride"], **hnd), NB * BS, H,
                        head_bytes, f"buffer {layer}", budget)
    assert geometry.MAX_CHECK_UNITS - budget.left == BS * H

    # Distinct shapes, each as dear as the budget allows a few of: refused, not checked forever.
    big_tokens = geometry.MAX_BLOCK_SEGMENTS // H  # one block of the most segments allowed
    budget = geometry.CheckBudget()
    with pytest.raises(InvalidArgument, match="would take more than"):
        for i in range(64):
            stride = head_bytes * (1 + i)  # another token stride each time: another shape
            geometry.of_ref(pb.BufferRef(block_tokens=big_tokens, block_stride=big_tokens * H * stride * 4,
                                         token_stride=stride, head_stride=big_tokens * stride * 2),
                            big_tokens, H, head_bytes, f"buffer {i}", budget)

    # Thousands of strided buffers interleaved in one memory (disjoint, but every pair's spans
    # overlap, so every pair would be compared): refused once the budget is spent.
    n, block = 4096, BS * H * head_bytes
    flat = dict(block_tokens=BS, block_stride=n * block, token_stride=H * head_bytes)
    geoms = [geometry.of_ref(pb.BufferRef(offset=i * block, **flat), NB * BS, H, head_bytes, f"buffer {i}")
             for i in range(n)]
    with pytest.raises(InvalidArgument, match="would take more than"):
        geometry.check_no_overlap(geoms, ["one"] * len(geoms), NB * BS, lambda i: f"buffer {i}")


def test_plain_buffers_of_old_clients_are_not_compared_at_all():
    geoms = [geometry.of_ref(pb.BufferRef(offset=0, token_stride=H * D * 2), NB * BS, H, D * 2, f"b{i}")
             for i in range(100_000)]  # overlapping, as old clients may send: today's rule
    budget = geometry.CheckBudget()
    geometry.check_no_overlap(geoms, ["one"] * len(geoms), NB * BS, lambda i: f"b{i}", budget)
    assert budget.left == geometry.MAX_CHECK_UNITS


# vLLM 0.33: every layer is a [B, H, N, C] view of a logical [L, B, H, N, C] cache in one of six
# physical orders; K = view[..., :D], V = view[..., D:] (docs/layouts.md, "vLLM 0.33's per-layer views").
LAYOUTS_033 = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
LAYERS_033 = 3


def views_033(order: str, mla: bool = False):
    """(raw tensor, per layer the parts' [B, H, N, D] views) in physical ``order``."""
    heads, c = (1, 2 * D) if mla else (H, 2 * D)
    sizes = dict(L=LAYERS_033, B=NB, H=heads, N=BS, C=c)
    raw = torch.empty([sizes[a] for a in order], dtype=DT)
    five = raw.permute([order.index(a) for a in "LBHNC"])
    if mla:
        return raw, [[five[layer]] for layer in range(LAYERS_033)]
    return raw, [[five[layer][..., :D], five[layer][..., D:]] for layer in range(LAYERS_033)]


def _ref_033(base: int, v: torch.Tensor) -> pb.BufferRef:
    w = v.element_size()
    return pb.BufferRef(offset=v.data_ptr() - base, block_tokens=v.shape[2], block_stride=v.stride(0) * w,
                        head_stride=v.stride(1) * w, token_stride=v.stride(2) * w)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("order", LAYOUTS_033)
def test_each_vllm_033_layout_is_accepted_and_described_exactly(order, mla):
    """LHBNC runs each head over every block (head_stride = blocks * block_stride), so a block's
    extent exceeds its block_stride, yet the views tile memory: accepted, K and V of a row and the
    layers found disjoint, and every (token, head) the rule names is where torch keeps it."""
    raw, layers = views_033(order, mla)
    base, n = raw.data_ptr(), NB * BS
    heads, head_bytes = layers[0][0].shape[1], layers[0][0].shape[3] * raw.element_size()
    refs = [_ref_033(base, v) for parts in layers for v in parts]
    budget = geometry.CheckBudget()
    geoms = [geometry.of_ref(r, n, heads, head_bytes, f"buffer {i}", budget) for i, r in enumerate(refs)]
    geometry.check_no_overlap(geoms, ["one"] * len(geoms), n, lambda i: f"buffer {i}", budget)
    assert geometry.MAX_CHECK_UNITS - budget.left < 4096
    tokens = torch.arange(n)
    views = [v for parts in layers for v in parts]
    for g, v in zip(geoms, views, strict=True):
        per_token = torch.from_numpy(g.token_offsets(tokens.numpy())) + g.offset
        for h in range(heads):
            want = torch.tensor([v[t // BS, h, t % BS].data_ptr() for t in range(n)]) - base
            assert (per_token + h * g.head_stride == want).all(), (order, h)
    # the highest byte touched is the raw tensor's last
    hi = max(g.span(n)[1] for g in geoms)
    assert hi == raw.numel() * raw.element_size()


def _lhbnc(head_stride: int) -> pb.BufferRef:
    hb = D * 2
    return pb.BufferRef(offset=0, block_tokens=BS, block_stride=BS * 2 * hb, token_stride=2 * hb,
                        head_stride=head_stride)


def test_heads_running_over_blocks_that_do_overlap_are_refused():
    """A head/block layout as LHBNC's, but the next head starts before the last block of the
    previous one ends: refused (INVALID_ARGUMENT), as are K/V pairs of it that really overlap."""
    hb, n = D * 2, NB * BS
    ok = _lhbnc(NB * BS * 2 * hb)
    geometry.of_ref(ok, n, H, hb, "k")
    with pytest.raises(InvalidArgument, match="blocks overlap: block_stride 512 is smaller than one block's"):
        geometry.of_ref(_lhbnc((NB - 1) * BS * 2 * hb), n, H, hb, "k")
    with pytest.raises(InvalidArgument, match="blocks overlap"):
        geometry.of_ref(_lhbnc(NB * BS * 2 * hb - hb - hb // 2), n, H, hb, "k")  # half a head
    geometry.of_ref(_lhbnc(NB * BS * 2 * hb - hb), n, H, hb, "k")  # just fits: the last token's gap
    # K and V of one row (V = K + head_bytes): disjoint; V half a head into K: refused
    k = geometry.of_ref(ok, n, H, hb, "k")
    for delta, fine in [(hb, True), (hb // 2, False), (0, False)]:
        vr = pb.BufferRef()
        vr.CopyFrom(ok)
        vr.offset = delta
        v = geometry.of_ref(vr, n, H, hb, "v")
        if fine:
            geometry.check_no_overlap([k, v], ["x", "x"], n, lambda i: f"buffer {i}")
        else:
            with pytest.raises(InvalidArgument, match="buffer 0 and buffer 1 overlap"):
                geometry.check_no_overlap([k, v], ["x", "x"], n, lambda i: f"buffer {i}")
    # a second layer placed inside the first one's head runs: refused
    other = pb.BufferRef()
    other.CopyFrom(ok)
    other.offset = BS * 2 * hb * 3
    with pytest.raises(InvalidArgument, match="overlap"):
        geometry.check_no_overlap([k, geometry.of_ref(other, n, H, hb, "l1")], ["x", "x"], n,
                                  lambda i: f"buffer {i}")


def test_nesting_check_is_constant_cost():
    """The (block, head, token) nesting check costs nothing from the budget, whatever the counts."""
    hb = 16
    r = pb.BufferRef(offset=0, block_tokens=1, block_stride=2 * hb, token_stride=2 * hb,
                     head_stride=(1 << 20) * 2 * hb)
    budget = geometry.CheckBudget()
    geometry.of_ref(r, 1 << 20, 1, hb, "k", budget)  # one head: contiguous, nothing sorted
    assert budget.left == geometry.MAX_CHECK_UNITS
