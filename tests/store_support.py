"""Shared pieces of the cache index tests: a small real arena, an injected clock, and short ways to
name keys, spaces and parts and to put pages."""

from __future__ import annotations

import numpy as np

from kvserver.host.arena import HostArena
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys, KVCache, Part, PartKey, PutPlan, Space, SpaceKey

MiB = 1 << 20
PAGE = MiB  # page bytes of the default part: two pages to a 2 MiB slab


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cache(capacity: int = 8 * MiB, **kwargs) -> tuple[KVCache, HostArena, Clock]:
    """A cache over a real arena of ``capacity`` bytes, 2 MiB slabs (two default pages each)."""
    arena = HostArena(capacity)
    clock = Clock()
    kwargs.setdefault("slab_bytes", 2 * MiB)
    return KVCache(arena, clock=clock, **kwargs), arena, clock


def K(names: str) -> list[bytes]:
    """Keys named by letters: K("abc") -> [b"a", b"b", b"c"]."""
    return [c.encode() for c in names]


def space_key(tenant: str = "t", *, mla: bool = False, tp: int = 1, pp: int = 1, layers: int = 4,
              model: str = "m") -> SpaceKey:
    layout = KVLayout.mla(8, 0) if mla else KVLayout.mha(2, 4)
    return SpaceKey(tenant, model, layout, dtype_named("float16"), 16, layers, tp, pp)


def part_of(cache: KVCache, space: Space, tp_shard: int = 0, pp_rank: int = 0,
            page_bytes: int = PAGE) -> Part:
    per_stage = space.key.num_layers // space.key.pp_size
    start = pp_rank * per_stage
    return cache.part(space, PartKey(tp_shard, pp_rank, start, start + per_stage, page_bytes))


def one_part(cache: KVCache, tenant: str = "t", page_bytes: int = PAGE) -> Part:
    return part_of(cache, cache.space(space_key(tenant)), page_bytes=page_bytes)


def put(cache: KVCache, part: Part, keys: list[bytes], ok: bool = True) -> PutPlan:
    plan = cache.prepare_put(part, keys)
    cache.complete_put(plan, ok)
    return plan


def ids_of(cache: KVCache, part: Part, names: str) -> list[int]:
    """Page ids of the named keys in the part (-1 for a key it does not hold)."""
    return cache.pages.find(part.gid, Keys.of(K(names))).tolist()


def stored(cache: KVCache, part: Part, names: str) -> str:
    """Which of the named keys the part holds committed, without touching anything."""
    ids = ids_of(cache, part, names)
    state = cache.pages.state
    return "".join(n for n, i in zip(names, ids, strict=True) if i >= 0 and state[i] == 3)


def offsets_ok(cache: KVCache, offsets: np.ndarray, page_bytes: int) -> bool:
    """Every offset lies inside one slab of the class, on a page boundary of it."""
    for off in offsets.tolist():
        hits = [s for s in cache.slabs.slabs.values()
                if s.page_bytes == page_bytes and s.offset <= off < s.offset + len(s.pages) * page_bytes
                and (off - s.offset) % page_bytes == 0]
        if len(hits) != 1:
            return False
    return True
