"""The vLLM connector's event feed (client/vllm/_events.py) reading a real daemon: events that wait
past MAX_PENDING_KEYS for the engine's take_events are dropped, counted, and logged once a burst
of drops is over, every burst, with its counts and the totals. Skipped where
scripts/install_vllm.sh has not run."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
import vllm_env
from cache_engine import DTYPE, LAYOUT, MODEL, PAGE, CacheEngine

from kvclient import CacheView

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


def wide(prefix: int, n: int) -> list[bytes]:
    return [prefix.to_bytes(2, "big") + i.to_bytes(4, "big") + bytes(26) for i in range(n)]


def burst(eng: CacheEngine, prefix: int) -> None:
    """Eight Puts of five pages, each read by the feed as an event of its own."""
    keys = wide(prefix, 40)
    for i in range(0, 40, 5):
        eng.fill(keys[i : i + 5], np.arange(5))
        assert eng.put(keys[i : i + 5], np.arange(5)).stored == 5
        time.sleep(0.12)


def test_every_burst_of_dropped_events_is_logged_with_its_counts(daemon_factory, monkeypatch, caplog):
    """Before: only the engine's first drop ever was logged; later ones only bumped an attribute."""
    from kvclient.vllm import _events

    caplog.set_level(logging.WARNING, logger="kvclient.vllm")
    monkeypatch.setattr(_events, "MAX_PENDING_KEYS", 10)
    monkeypatch.setattr(_events, "WARN_QUIET_SECONDS", 0.4, raising=False)
    d = daemon_factory(host_memory=24 << 20)
    view = CacheView(d.address, model=MODEL, layout=LAYOUT, dtype=DTYPE, page_size=PAGE, num_layers=4)
    feed = _events.EventFeed([view], [0], PAGE, interval=0.05)

    def warnings(n: int) -> list[str]:
        """The feed's warnings of dropped events, once there are ``n`` (10 s at most)."""
        deadline = time.monotonic() + 10
        while True:
            got = [r.getMessage() for r in caplog.records if r.name == "kvclient.vllm"
                   and r.levelno == logging.WARNING and "dropped" in r.getMessage()]
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def counts(messages: list[str]) -> tuple[int, int]:
        """Events and keys the messages say were dropped, in all."""
        found = [re.search(r"(\d+) KV events \((\d+) block hashes\) dropped", m) for m in messages]
        assert all(found), messages
        return sum(int(m[1]) for m in found), sum(int(m[2]) for m in found)

    try:
        with CacheEngine(d.address, pages=128) as eng:
            time.sleep(0.3)  # the feed's first read starts the daemon's log of the space
            burst(eng, 1)  # 40 keys in events of 5 or more: those waiting past 10 keys go
            first = warnings(1)
            assert first and feed.dropped_keys > 0, (first, feed.dropped_keys)
            feed.take()
            time.sleep(1.0)  # the engine steps again, later
            burst(eng, 2)
            both = warnings(len(first) + 1)
            assert len(both) > len(first), f"the second burst of drops was not logged: {both}"
            time.sleep(1.0)  # every burst logged by now
            said = warnings(0)
            assert counts(said) == (feed.dropped, feed.dropped_keys), said
            assert f"({feed.dropped} events, {feed.dropped_keys} block hashes dropped since the start)" \
                in said[-1], said
    finally:
        feed.close()
