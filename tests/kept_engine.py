"""An engine process for the kill -9 storm (test_e2e_kept): Puts and Gets through a daemon that is
SIGKILLed and restarted under it, saying which keys each Put confirmed and checking every page a
Get returns. Spawned: importable on its own."""

from __future__ import annotations

import time
import traceback

import numpy as np
from cache_engine import CacheEngine, scattered

BATCH = 8  # keys per Put


def storm_engine(address: str, idx: int, stop, out, page_size: int, pause: float) -> None:
    """Until ``stop``: Puts BATCH new keys of its own, reports ("confirmed", idx, keys) for those a
    Put confirmed, and Gets a random run of keys confirmed before, checking every byte loaded.
    Reports ("result", idx, counts) at the end, ("error", idx, traceback) on a failure."""
    counts = {"puts": 0, "confirmed": 0, "gets": 0, "hit_pages": 0, "wrong": 0, "max_call_s": 0.0,
              "missed_loads": 0}
    try:
        rng = np.random.default_rng(idx)
        confirmed: list[bytes] = []
        with CacheEngine(address, pages=64, page_size=page_size, resilient=True) as eng:
            out.put(("ready", idx, None))
            n = 0
            while not stop.is_set():
                keys = [f"storm-{idx:02d}-{n + i:010d}".encode() for i in range(BATCH)]
                n += BATCH
                pages = scattered(rng, BATCH, eng.num_pages)
                eng.fill(keys, pages)
                t0 = time.monotonic()
                r = eng.put(keys, pages)
                counts["puts"] += 1
                ok = r.stored + r.present
                if ok and ok + r.dropped == BATCH:
                    confirmed += keys[:ok]
                    counts["confirmed"] += ok
                    out.put(("confirmed", idx, keys[:ok]))
                if confirmed:
                    start = int(rng.integers(0, len(confirmed)))
                    want = confirmed[start : start + BATCH]
                    pages = scattered(rng, len(want), eng.num_pages)
                    eng.wipe(pages)
                    handle = eng.client.get(want, pages)
                    got = handle.pages(timeout=30)
                    handle.wait(timeout=30)
                    counts["gets"] += 1
                    if handle.missed:  # the daemon was killed during the load: a miss, nothing to check
                        counts["missed_loads"] += 1
                        got = 0
                    counts["hit_pages"] += got
                    counts["wrong"] += len(eng.wrong(want[:got], pages[:got]))
                counts["max_call_s"] = max(counts["max_call_s"], time.monotonic() - t0)
                time.sleep(pause)
        out.put(("result", idx, counts))
    except BaseException:
        out.put(("error", idx, traceback.format_exc()))
