"""Where a device pool buffer's elements lie (docs/layouts.md), checked the same for every medium.

Element (t, h, d) of a buffer is at ``offset + (t // block_tokens) * block_stride +
(t % block_tokens) * token_stride + h * head_stride + d * itemsize``; ``block_tokens = 0`` means
no blocks and ``head_stride = 0`` means heads contiguous, so a BufferRef of an old client (offset
and token_stride only) keeps its meaning. Every check here runs before any memory is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserver.errors import InvalidArgument

MAX_FIELD = 1 << 48  # every offset and stride: no product of planning overflows int64
MAX_BLOCK_SEGMENTS = 1 << 20  # block_tokens * heads: the exact in-block overlap check's size
# What checking one Register's strided buffers may cost in all, so that no pool description can
# hold the daemon's event loop (each unit is one (token, head) segment sorted, or one pair of
# buffers compared). vLLM's layouts spend a few thousand: one check per distinct buffer shape, one
# pair per layer where K and V interleave in one tensor.
MAX_CHECK_UNITS = 1 << 20


class CheckBudget:
    """The work left for one request's layout checks; refusing past it is INVALID_ARGUMENT."""

    def __init__(self, units: int = MAX_CHECK_UNITS) -> None:
        self.left = units
        self.checked_shapes: set[tuple] = set()  # within-buffer checks already done, by shape

    def spend(self, units: int, what: str) -> None:
        self.left -= units
        if self.left < 0:
            raise InvalidArgument(
                f"{what}: checking this pool's layout would take more than {MAX_CHECK_UNITS} steps "
                "(too many distinct strided buffer shapes, or too many strided buffers sharing memory); "
                "give its buffers one layout and separate memory per layer")


@dataclass(frozen=True, slots=True)
class Geometry:
    """One buffer's addressing, normalised: ``block_tokens`` is 0 where blocks follow each other
    like tokens do, ``head_stride`` is ``head_bytes`` where heads are contiguous."""

    offset: int
    token_stride: int
    block_tokens: int
    block_stride: int
    head_stride: int
    heads: int
    head_bytes: int
    strided: bool = False  # the client set block_tokens, block_stride or head_stride


    @property
    def token_bytes(self) -> int:
        return self.heads * self.head_bytes

    @property
    def heads_contiguous(self) -> bool:
        return self.heads == 1 or self.head_stride == self.head_bytes

    @property
    def plain(self) -> bool:
        """Today's rule: token t is one contiguous row at offset + t * token_stride."""
        return self.block_tokens == 0 and self.heads_contiguous

    def shape_key(self) -> tuple:
        """Everything but the offset: buffers with the same key share one offset plan."""
        return (self.token_stride, self.block_tokens, self.block_stride, self.head_stride, self.heads,
                self.head_bytes)

    def segment_starts(self, tokens: int) -> np.ndarray:
        """Start of every (token, head) segment of the first ``tokens`` tokens of one block (or
        of the buffer, without blocks), relative to ``offset``: int64 [tokens * heads]."""
        t = np.arange(tokens, dtype=np.int64)[:, None] * self.token_stride
        h = np.arange(self.heads, dtype=np.int64)[None, :] * self.head_stride
        return (t + h).reshape(-1)

    def token_offsets(self, tokens: np.ndarray) -> np.ndarray:
        """Byte offset of each token's first head, relative to ``offset``."""
        if self.block_tokens == 0:
            return tokens * self.token_stride
        bt = self.block_tokens
        return (tokens // bt) * self.block_stride + (tokens % bt) * self.token_stride

    def in_block_extent(self, tokens: int) -> int:
        """Bytes from the first segment's start to the last one's end, over ``tokens`` tokens."""
        return (tokens - 1) * self.token_stride + (self.heads - 1) * self.head_stride + self.head_bytes

    def span(self, num_tokens: int) -> tuple[int, int]:
        """[lo, hi) of the bytes the buffer's ``num_tokens`` tokens touch (absolute)."""
        if self.block_tokens == 0:
            return self.offset, self.offset + self.in_block_extent(num_tokens)
        blocks = num_tokens // self.block_tokens
        return (self.offset,
                self.offset + (blocks - 1) * self.block_stride + self.in_block_extent(self.block_tokens))


def describe(r) -> str:
    """A BufferRef's addressing fields, for messages."""
    parts = [f"offset {r.offset}", f"token_stride {r.token_stride}"]
    if r.block_tokens or r.block_stride:
        parts += [f"block_tokens {r.block_tokens}", f"block_stride {r.block_stride}"]
    if r.head_stride:
        parts.append(f"head_stride {r.head_stride}")
    return ", ".join(parts)


def of_ref(r, num_tokens: int, heads: int, head_bytes: int, what: str,
           budget: CheckBudget | None = None) -> Geometry:
    """Checks one BufferRef's fields (rules 1 and 2 of docs/layouts.md) and returns its
    normalised geometry. Raises InvalidArgument with ``what`` (e.g. 'device_pool buffer 3').
    ``budget``: the request's, shared by all its buffers (a fresh one if None)."""
    budget = budget if budget is not None else CheckBudget()
    token_bytes = heads * head_bytes
    for name in ("offset", "token_stride", "block_tokens", "block_stride", "head_stride"):
        if getattr(r, name) >= MAX_FIELD:
            raise InvalidArgument(f"{what}: {name} {getattr(r, name)} is too large (at most 2**48 - 1)")
    bt, bs = r.block_tokens, r.block_stride
    if bt == 0 and bs:
        raise InvalidArgument(f"{what}: block_stride {bs} is set but block_tokens is 0 (no blocks)")
    if bt and not bs:
        raise InvalidArgument(f"{what}: block_tokens {bt} needs a block_stride > 0")
    if bt and num_tokens % bt:
        raise InvalidArgument(
            f"{what}: num_tokens {num_tokens} is not a whole number of blocks of {bt} tokens")
    hs = r.head_stride or head_bytes
    if heads == 1:
        hs = head_bytes
    if hs < head_bytes:
        raise InvalidArgument(
            f"{what}: head_stride {hs} is smaller than one head ({head_bytes} bytes); heads overlap")
    if hs == head_bytes and r.token_stride < token_bytes:
        raise InvalidArgument(
            f"{what}: token_stride {r.token_stride} is smaller than one token ({token_bytes} bytes)")
    strided = bool(bt or bs or r.head_stride)
    g = Geometry(r.offset, r.token_stride, bt, bs, hs, heads, head_bytes, strided)
    if bt and bs == bt * r.token_stride and g.heads_contiguous:  # blocks follow like tokens do
        g = Geometry(r.offset, r.token_stride, 0, 0, hs, heads, head_bytes, strided)
    if not g.heads_contiguous:
        tokens = g.block_tokens or num_tokens
        if tokens * heads > MAX_BLOCK_SEGMENTS:
            raise InvalidArgument(
                f"{what}: {tokens} tokens x {heads} heads per block is more than {MAX_BLOCK_SEGMENTS} "
                f"head segments; use blocks (block_tokens) or contiguous heads")
        shape = (g.shape_key(), tokens)
        if shape not in budget.checked_shapes:  # the same strides overlap the same way anywhere
            budget.spend(tokens * heads, what)
            starts = np.sort(g.segment_starts(tokens))
            if (np.diff(starts) < head_bytes).any():
                raise InvalidArgument(
                    f"{what}: token rows overlap ({describe(r)}, heads {heads} x {head_bytes} bytes)")
            budget.checked_shapes.add(shape)
    if g.block_tokens and bs < g.in_block_extent(bt) and not tiles(g, num_tokens):
        raise InvalidArgument(
            f"{what}: blocks overlap: block_stride {bs} is smaller than one block's "
            f"{g.in_block_extent(bt)} bytes, and the (block, head, token) strides do not nest "
            f"either ({describe(r)}, {num_tokens // bt} blocks, heads {heads} x {head_bytes} bytes)")
    return g


def tiles(g: Geometry, num_tokens: int, head_bytes: int | None = None) -> bool:
    """Whether the buffer's (block, head, token) segments of ``head_bytes`` (default: its own)
    are pairwise disjoint because its strides nest: sorted by stride, each dimension's stride is
    at least the extent of all smaller ones together (``head_bytes`` plus (count - 1) * stride of
    each). This is how a layout whose heads each run over every block (vLLM 0.33's LHBNC: head
    stride = blocks * block stride) is seen to tile memory although a block's extent exceeds its
    block stride. Sufficient, not necessary; O(1)."""
    hb = g.head_bytes if head_bytes is None else head_bytes
    dims = [(g.token_stride, g.block_tokens or num_tokens), (g.head_stride, g.heads)]
    if g.block_tokens:
        dims.append((g.block_stride, num_tokens // g.block_tokens))
    extent = hb
    for stride, count in sorted(d for d in dims if d[1] > 1):
        if stride < extent:
            return False
        extent += (count - 1) * stride
    return True


def _period_segments(g: Geometry) -> np.ndarray:
    """A block layout's in-block segments reduced modulo its block_stride: int64 [k, 2] of
    [start, end), split where they wrap, sorted."""
    p = g.block_stride
    starts = (g.offset + g.segment_starts(g.block_tokens)) % p
    ends = starts + g.head_bytes
    wrap = ends > p
    segs = np.concatenate([
        np.stack([starts, np.minimum(ends, p)], axis=1),
        np.stack([np.zeros(int(wrap.sum()), dtype=np.int64), ends[wrap] - p], axis=1),
    ])
    return segs[np.argsort(segs[:, 0], kind="stable")]


def _disjoint(a: np.ndarray, b: np.ndarray) -> bool:
    both = np.concatenate([a, b])
    both = both[np.argsort(both[:, 0], kind="stable")]
    return bool((both[1:, 0] >= both[:-1, 1]).all())


def _nest_apart(ga: Geometry, gb: Geometry, num_tokens: int) -> bool:
    """Two buffers of one shape, ``delta`` bytes apart (delta >= head_bytes), are disjoint if the
    shape's segments widened to ``delta + head_bytes`` still nest (``tiles``): each segment of
    one then lies in its own widened segment, the other's segment at the same place right after
    it. This is vLLM 0.33's K and V of one row (V = K + head_bytes) in every layout. O(1)."""
    delta = abs(ga.offset - gb.offset)
    return delta >= ga.head_bytes and tiles(ga, num_tokens, delta + ga.head_bytes)


def check_no_overlap(geoms: list[Geometry], keys: list[str], num_tokens: int, label,
                     budget: CheckBudget | None = None) -> None:
    """Rule 4: no two buffers of one object share a byte, where either uses the strided fields
    (old clients' plain buffers keep today's rule: not checked). ``keys`` names each buffer's
    object; ``label(i)`` names buffer i in the message. Every pair compared spends ``budget``."""
    if not any(g.strided for g in geoms):
        return  # old clients: nothing to compare, and no pair loop over their buffers
    budget = budget if budget is not None else CheckBudget()
    by_key: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    for idx in by_key.values():
        spans = sorted((geoms[i].span(num_tokens), i) for i in idx)
        for j in range(len(spans)):
            (lo_a, hi_a), a = spans[j]
            for k in range(j + 1, len(spans)):
                (lo_b, hi_b), b = spans[k]
                if lo_b >= hi_a:
                    break
                ga, gb = geoms[a], geoms[b]
                budget.spend(16, label(min(a, b)))  # a pair: a Python loop step or more
                if not (ga.strided or gb.strided):
                    continue
                if ga.shape_key() == gb.shape_key() and _nest_apart(ga, gb, num_tokens):
                    continue
                if ga.block_tokens and gb.block_tokens and ga.block_stride == gb.block_stride:
                    budget.spend(2 * ga.block_tokens * ga.heads, label(min(a, b)))
                    if _disjoint(_period_segments(ga), _period_segments(gb)):
                        continue
                first, second = sorted((a, b))
                raise InvalidArgument(f"{label(first)} and {label(second)} overlap in the same memory")
