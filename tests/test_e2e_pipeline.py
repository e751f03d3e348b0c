"""Two pipeline stages of one model, in separate engine processes, each with its own layer range."""

from __future__ import annotations

import multiprocessing as mp

from engine_procs import pipeline_stage


def test_two_stages_in_separate_processes(daemon):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stages = [(0, 16), (16, 32)]
    procs = [
        ctx.Process(target=pipeline_stage, args=(daemon.address, s, e, 32, i, out))
        for i, (s, e) in enumerate(stages)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        r = out.get(timeout=120)
        results[r["range"]] = r
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for start, end in stages:
        r = results[(start, end)]
        assert "traceback" not in r, r.get("traceback")
        assert r["exact"], f"stage {start}..{end} did not load back its own bytes"
        assert r["stats"] == (start, end)
        assert len(r["errors"]) == 2, "an out-of-range layer was accepted"
        for is_out_of_range, message in r["errors"]:
            assert is_out_of_range
            assert f"[{start}, {end})" in message
    assert daemon.run(lambda: len(daemon.core.clients)) == 0
