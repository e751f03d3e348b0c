"""A model split into three pipeline stages, with the layer ranges SGLang gives them: a page of the
space counts for the scheduler only once every stage holds it, and stops counting when one stage's
copy is evicted. A stage's Get names its own global layers; any other layer id is refused."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from cache_engine import DTYPE, LAYOUT, PAGE, CacheEngine, prompt_keys, scattered, sglang_pp_indices
from checks import error_of
from daemon_proc import DaemonProcess

from kvclient import CacheView, KVClientError

NUM_LAYERS, STAGES = 10, 3
N = 8


def test_sglang_layer_ranges() -> None:
    assert [sglang_pp_indices(NUM_LAYERS, r, STAGES) for r in range(STAGES)] == [(0, 3), (3, 7), (7, 10)]
    assert [sglang_pp_indices(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [sglang_pp_indices(11, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 11)]


@pytest.fixture
def daemon_proc(tmp_path):
    # Three 2 MiB regions and one 8 MiB slab for each page size (stages of 3 and of 4 layers);
    # no room for a third slab, so more pages of one size evict that size's own pages.
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="26MiB")
    yield d
    d.stop()


def stage(address: str, rank: int, **kw) -> CacheEngine:
    start, end = sglang_pp_indices(NUM_LAYERS, rank, STAGES)
    return CacheEngine(address, start=start, end=end, num_layers=NUM_LAYERS, pp_rank=rank,
                       pp_size=STAGES, pages=320, **kw)


def test_scheduler_sees_a_page_only_when_every_stage_holds_it(daemon_proc) -> None:
    stages = [stage(daemon_proc.address, r) for r in range(STAGES)]
    view = CacheView(daemon_proc.address, model="cache-model", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                     num_layers=NUM_LAYERS, pp_size=STAGES)
    try:
        assert [e.page_bytes for e in stages] == [PAGE * 512 * n for n in (3, 4, 3)]
        rng = np.random.default_rng(0)
        keys = prompt_keys(rng.integers(0, 1000, N * PAGE))
        assert view.lookup(keys).pages == 0
        for i, eng in enumerate(stages):
            pages = scattered(rng, N, eng.num_pages)
            eng.fill(keys, pages)
            assert eng.put(keys, pages).stored == N
            want = N if i == STAGES - 1 else 0
            assert view.lookup(keys).pages == want, f"after {i + 1} of {STAGES} stages stored the pages"
        assert view.tenant.startswith("uid:")
        spaces = [s for s in daemon_proc.stats().spaces if s.space.pp_size == STAGES]
        assert [(s.parts_seen, s.parts, s.complete_pages) for s in spaces] == [(3, 3, N)]

        # A Get of the middle stage names some of its own layers: only those land.
        mid = stages[1]
        mid.wipe()
        pages = scattered(rng, N, mid.num_pages)
        assert mid.get(keys, pages, layers=[4, 5]) == N
        assert mid.wrong(keys, pages, layers=[4, 5]) == []
        assert mid.zero(pages, layers=[3, 6]), "layers not asked for were written"
        for bad in ([7], [2], [3, 7]):
            code, message = error_of(lambda bad=bad: mid.get(keys, pages, layers=bad))
            assert code == grpc.StatusCode.OUT_OF_RANGE, (bad, code, message)
            assert "[3, 7)" in message, message

        # A fourth engine naming another layer range for stage 1 would not be interchangeable.
        # It is refused at its Register, or at the latest at its first cache call.
        def odd_stage() -> None:
            with CacheEngine(daemon_proc.address, start=3, end=6, num_layers=NUM_LAYERS, pp_rank=1,
                             pp_size=STAGES) as odd:
                odd.lookup(keys)

        with pytest.raises(KVClientError) as err:
            odd_stage()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert "[3, 7)" in err.value.message and "[3, 6)" in err.value.message, err.value.message

        # Stage 1 stores many other pages: no room for another slab of its page size, so its own
        # least recently used pages (the shared prefix) go, while the other stages keep theirs.
        for round_ in range(6):
            other = prompt_keys(rng.integers(2000 + 1000 * round_, 2999 + 1000 * round_, 64 * PAGE))
            pages = scattered(rng, 64, mid.num_pages)
            mid.fill(other, pages)
            assert mid.put(other, pages).stored > 0
        assert mid.lookup(keys).pages < N, "the middle stage's prefix should have been evicted"
        assert stages[0].lookup(keys).pages == N and stages[2].lookup(keys).pages == N
        assert view.lookup(keys).pages == mid.lookup(keys).pages, "a page needs every stage"
        space = next(s for s in daemon_proc.stats().spaces if s.space.pp_size == STAGES)
        assert space.counters.evictions > 0
        assert space.complete_pages == mid.lookup(keys).pages
        stats = daemon_proc.stats()
        assert 0 < stats.cache_bytes <= stats.capacity_bytes
    finally:
        view.close()
        for eng in stages:
            eng.close()
