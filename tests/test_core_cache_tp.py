"""Tensor parallelism and the cache: the MLA latent is the same on every TP rank, so a space of an
MLA model stores it once for all ranks; an MHA rank holds its own heads, so each rank is a part."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from cache_engine import CacheEngine, prompt_keys, scattered
from daemon_proc import DaemonProcess

from kvclient import KVLayout

N = 24  # pages of the shared prefix


@pytest.fixture
def daemon_proc(tmp_path):
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="256MiB")
    yield d
    d.stop()


def the_space(d: DaemonProcess, model: str):
    spaces = [s for s in d.stats().spaces if s.space.model == model]
    assert len(spaces) == 1, spaces
    return spaces[0]


def test_mla_tp4_stores_one_copy_for_every_rank(daemon_proc) -> None:
    layout = KVLayout.mla(32, 8)
    ranks = [CacheEngine(daemon_proc.address, layout=layout, dtype=torch.bfloat16, tp_rank=r, tp_size=4,
                         model="mla") for r in range(4)]
    try:
        page_bytes = ranks[0].page_bytes
        assert page_bytes == 16 * 40 * 2 * 4  # (32 + 8) bf16 values a token, one part, 4 layers
        rng = np.random.default_rng(0)
        keys = prompt_keys(rng.integers(0, 1000, N * 16))
        results = []
        for eng in ranks:
            pages = scattered(rng, N, eng.num_pages)
            eng.fill(keys, pages)
            r = eng.put(keys, pages)
            results.append((r.stored, r.present, r.dropped))
        assert results == [(N, 0, 0)] + [(0, N, 0)] * 3, results
        space = the_space(daemon_proc, "mla")
        assert (space.parts_seen, space.parts) == (1, 1), "an MLA space has one part per PP stage"
        c = space.counters
        assert (c.pages, c.bytes) == (N, N * page_bytes), "one copy of the latent for four ranks"
        assert (c.dedup_pages, c.dedup_bytes) == (3 * N, 3 * N * page_bytes)
        assert space.complete_pages == N

        for eng in ranks:
            assert eng.lookup(keys).pages == N
            eng.wipe()
            pages = scattered(rng, N, eng.num_pages)
            assert eng.get(keys, pages) == N
            assert eng.wrong(keys, pages) == [], f"rank {ranks.index(eng)} got other bytes back"

        # Four ranks Put the same new pages at the same time: each page is stored once.
        more = prompt_keys(rng.integers(1000, 2000, N * 16))
        barrier = threading.Barrier(4)
        outcome: list = [None] * 4

        def put(i: int, eng: CacheEngine) -> None:
            pages = scattered(np.random.default_rng(i), N, eng.num_pages)
            eng.fill(more, pages)
            barrier.wait(10)
            outcome[i] = eng.put(more, pages)

        threads = [threading.Thread(target=put, args=(i, e)) for i, e in enumerate(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sum(r.stored for r in outcome) == N and sum(r.present for r in outcome) == 3 * N, outcome
        c = the_space(daemon_proc, "mla").counters
        assert (c.pages, c.bytes) == (2 * N, 2 * N * page_bytes)
        for eng in ranks:
            eng.wipe()
            pages = scattered(rng, N, eng.num_pages)
            assert eng.get(more, pages) == N and eng.wrong(more, pages) == []
    finally:
        for eng in ranks:
            eng.close()


def test_mha_tp2_keeps_one_copy_per_rank(daemon_proc) -> None:
    ranks = [CacheEngine(daemon_proc.address, tp_rank=r, tp_size=2, model="mha") for r in range(2)]
    try:
        page_bytes = ranks[0].page_bytes
        rng = np.random.default_rng(1)
        keys = prompt_keys(rng.integers(0, 1000, N * 16))
        pages = [scattered(rng, N, e.num_pages) for e in ranks]
        for eng, p in zip(ranks, pages, strict=True):
            eng.fill(keys, p)  # each rank's own heads: other bytes than the other rank's
        assert not np.array_equal(ranks[0].raw[0][0][pages[0]], ranks[1].raw[0][0][pages[1]])

        r0 = ranks[0].put(keys, pages[0])
        assert (r0.stored, r0.present) == (N, 0)
        assert ranks[0].lookup(keys).pages == N
        assert ranks[1].lookup(keys).pages == 0, "rank 1's part holds nothing yet"
        assert ranks[0].lookup(keys, whole_space=True).pages == 0, "a page needs both ranks"
        assert the_space(daemon_proc, "mha").complete_pages == 0

        r1 = ranks[1].put(keys, pages[1])
        assert (r1.stored, r1.present) == (N, 0), "rank 1 stores its own copy"
        space = the_space(daemon_proc, "mha")
        assert (space.parts_seen, space.parts) == (2, 2)
        assert space.counters.bytes == 2 * N * page_bytes
        assert space.counters.dedup_pages == 0
        assert space.complete_pages == N
        assert ranks[1].lookup(keys, whole_space=True).pages == N

        for eng in ranks:
            eng.wipe()
            p = scattered(rng, N, eng.num_pages)
            assert eng.get(keys, p) == N
            assert eng.wrong(keys, p) == [], f"rank {ranks.index(eng)} got the other rank's heads"
    finally:
        for eng in ranks:
            eng.close()
