"""Two DP replicas of one model, each its own engine process, share a long system prompt through
the node-wide cache: the second finds every whole page the first stored, loads it bit for bit, and
the daemon holds one copy (its own Put of the same prompt is counted as dedup, not stored)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue

import numpy as np
import pytest
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE, prompt_keys, replica
from daemon_proc import DaemonProcess

SYSTEM_PAGES = 40
PAGE_BYTES = PAGE * LAYOUT.token_bytes(DTYPE) * 2 * 4  # K and V of 4 layers


def space_of(stats, model: str = MODEL):
    spaces = [s for s in stats.spaces if s.space.model == model]
    assert len(spaces) == 1, f"spaces of {model}: {spaces}"
    return spaces[0]


class Replica:
    def __init__(self, ctx, address: str, tokens: np.ndarray, seed: int) -> None:
        self.steps, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=replica, args=(address, tokens, seed, self.steps, self.out),
                                daemon=True)
        self.proc.start()
        self.keys = self.ask(None)

    def ask(self, *cmd):
        if cmd != (None,):
            self.steps.put(cmd)
        try:
            kind, payload = self.out.get(timeout=60)
        except queue.Empty:
            pytest.fail(f"replica {self.proc.pid} answered nothing to {cmd}")
        assert kind != "error", payload
        return payload


@pytest.fixture
def daemon_proc(tmp_path):
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="256MiB")
    yield d
    d.stop()


def test_second_replica_hits_every_page_of_the_shared_prompt(daemon_proc) -> None:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, SYSTEM_PAGES * PAGE + 5)  # a partial page at the end gets no key
    a_tokens = np.concatenate([system, rng.integers(0, 32000, 3 * PAGE)])
    b_tokens = np.concatenate([system, rng.integers(0, 32000, 10 * PAGE - 5)])
    assert prompt_keys(a_tokens)[:SYSTEM_PAGES] == prompt_keys(b_tokens)[:SYSTEM_PAGES]
    assert prompt_keys(a_tokens)[SYSTEM_PAGES] != prompt_keys(b_tokens)[SYSTEM_PAGES]

    ctx = mp.get_context("spawn")
    a = Replica(ctx, daemon_proc.address, system, seed=1)
    b = Replica(ctx, daemon_proc.address, b_tokens, seed=2)
    try:
        assert a.keys == SYSTEM_PAGES and b.keys == SYSTEM_PAGES + 10
        assert b.ask("lookup") == 0, "a miss before anything was stored"
        stored, present, dropped, nbytes = a.ask("put")
        assert (stored, present, dropped) == (SYSTEM_PAGES, 0, 0)
        assert nbytes == SYSTEM_PAGES * PAGE_BYTES
        space = space_of(daemon_proc.stats())
        assert space.tenant == f"uid:{os.getuid()}"
        assert (space.counters.pages, space.counters.bytes) == (SYSTEM_PAGES, SYSTEM_PAGES * PAGE_BYTES)

        assert b.ask("lookup") == SYSTEM_PAGES, "the second replica must hit every page of the prompt"
        got, wrong, rest_zero = b.ask("get")
        assert got == SYSTEM_PAGES
        assert wrong == [], f"pages {wrong} came back with other bytes than replica A stored"
        assert rest_zero, "the Get wrote device pages outside the stored prefix"

        stored, present, dropped, _ = b.ask("put")
        assert (stored, present, dropped) == (10, SYSTEM_PAGES, 0)
        stats = daemon_proc.stats()
        space = space_of(stats)
        c = space.counters
        assert (c.pages, c.bytes) == (SYSTEM_PAGES + 10, (SYSTEM_PAGES + 10) * PAGE_BYTES), "one copy"
        assert (c.dedup_pages, c.dedup_bytes) == (SYSTEM_PAGES, SYSTEM_PAGES * PAGE_BYTES)
        # Hits: B's Lookup after A's Put. Misses: B's Lookup before it (all 50 keys), B's Lookup
        # after it (its own 10 pages), and the 10 keys B's Get asked for that were not stored.
        assert (c.hits, c.misses) == (SYSTEM_PAGES, 50 + 10 + 10)
        assert space.complete_pages == SYSTEM_PAGES + 10 and (space.parts_seen, space.parts) == (1, 1)
        assert stats.cache_bytes >= c.bytes
        assert b.ask("lookup") == SYSTEM_PAGES + 10, "B's own Put made its whole prompt a hit"
        for r in (a, b):
            assert r.ask("stop") is None
    finally:
        for r in (a, b):
            r.proc.join(30)
            if r.proc.is_alive():
                r.proc.kill()
    assert [a.proc.exitcode, b.proc.exitcode] == [0, 0]
