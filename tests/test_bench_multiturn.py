"""The multi-turn serving benchmark's smoke run (benchmarks/suites/multiturn.py --quick) in a
subprocess, as a user runs it: its JSON has every figure of every configuration, the host tiers
reuse at least what recompute alone does, every page a host tier loaded was checked against the
bytes stored for it, and the plots are written."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "suites" / "multiturn.py"
CONFIGS = ["recompute", "host-inprocess", "kvserver-index", "dp2-recompute", "dp2-kvserver-cache",
           "dp2-cache-restart", "dp2-cache-restart-kept", "dp2-small-host", "dp2-small-host-disk",
           "dp2-small-host-disk-restart", "nodes2-own-cache", "nodes2-router", "nodes2-cluster"]
POSITIVE = ["prompt_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "throughput_rps",
            "throughput_prompt_tps", "makespan_s", "busy_s"]


def test_quick_run_reports_every_configuration(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "multiturn.json").read_text())
    assert result["suite"] == "multiturn" and result["quick"] is True and "--quick" in result["command"]
    assert "| config |" in proc.stdout, proc.stdout

    cfgs = result["configs"]
    assert list(cfgs) == CONFIGS
    requests = result["workload"]["requests"]
    for name, r in cfgs.items():
        assert r["requests"] == requests == len(r["ttft_s"]), name
        for key in POSITIVE:
            assert r[key] > 0, (name, key, r[key])
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"], name
        assert 0 <= r["hit_rate"] <= 1, name
        assert abs(r["hit_rate"] - r["device_hit_rate"] - r["host_hit_rate"]) < 1e-9, name
        assert r["computed_tokens"] == round(r["prompt_tokens"] * (1 - r["hit_rate"])), name

    # Host tiers only add hits; the two single-engine tiers hold the same pages under the same policy.
    hit = {name: r["hit_rate"] for name, r in cfgs.items()}
    assert hit["recompute"] <= min(hit["host-inprocess"], hit["kvserver-index"], hit["dp2-kvserver-cache"])
    assert cfgs["recompute"]["host_hit_rate"] == 0 and cfgs["dp2-recompute"]["host_hit_rate"] == 0
    assert hit["host-inprocess"] == hit["kvserver-index"] > hit["recompute"]
    assert hit["dp2-kvserver-cache"] > hit["dp2-recompute"]
    for name in ("host-inprocess", "kvserver-index", "dp2-kvserver-cache"):
        r = cfgs[name]
        assert r["loaded_bytes"] > 0 and r["written_bytes"] > 0 and r["load_s_total"] > 0, name
        host_hit = round(r["host_hit_rate"] * r["prompt_tokens"])
        assert r["loaded_bytes"] == host_hit * result["geometry"]["token_bytes"], name
        check = result["checks"][name]
        assert check["pages_checked"] > 0 and check["pages_wrong"] == 0, (name, check)
    assert result["checks"]["dp2-kvserver-cache"]["pages_dropped"] == 0

    # A kill -9 of the daemon halfway: with a kept cache (--host-memory-dir) the second half hits as
    # if nothing had happened; without, it loses what was stored before; no loaded page is wrong.
    second = {name: cfgs[name]["hit_rate_second_half"] for name in CONFIGS}
    assert second["dp2-cache-restart-kept"] == second["dp2-kvserver-cache"] > second["dp2-cache-restart"]
    assert result["checks"]["dp2-cache-restart-kept"]["adopted_pages"] > 0

    # The disk rows: the disk tier wrote what the replicas stored, and after a kill -9 halfway the
    # restarted daemon found it on disk (its host memory was not kept): the second half hits more
    # than a daemon with neither; pages whose write behind had not ended at the kill are the ones lost.
    disk, again = result["checks"]["dp2-small-host-disk"], result["checks"]["dp2-small-host-disk-restart"]
    assert disk["disk_written_pages"] > 0 and disk["disk_bad_checks"] == again["disk_bad_checks"] == 0
    assert again["disk_adopted_pages"] > 0
    assert second["dp2-small-host-disk-restart"] > second["dp2-cache-restart"]
    assert hit["dp2-small-host-disk"] >= hit["dp2-small-host"]
    assert result["checks"]["dp2-cache-restart"]["adopted_pages"] == 0
    for name in ("dp2-cache-restart", "dp2-cache-restart-kept", "dp2-small-host", "dp2-small-host-disk",
                 "dp2-small-host-disk-restart"):
        assert result["checks"][name]["pages_wrong"] == 0 and result["checks"][name]["pages_checked"] > 0

    # Two nodes, requests at random: with the cluster tier a history computed on either node is a
    # hit on both; each node alone finds only its own (the CI run installs Mooncake Store).
    assert hit["nodes2-cluster"] > hit["nodes2-own-cache"]
    # As one node-wide cache would, but for the write-through's lag: a page reaches the cluster a
    # moment after its Put, and a request on the other node meanwhile misses it (a request or two
    # of a quick run).
    assert hit["dp2-kvserver-cache"] - 0.1 <= hit["nodes2-cluster"] <= hit["dp2-kvserver-cache"]
    nodes = result["checks"]["nodes2-cluster"]
    assert nodes["cluster_published_pages"] > 0 and nodes["cluster_pulled_pages"] > 0
    assert nodes["cluster_get_errors"] == 0
    # A router that follows the nodes' KV events sends a returning client where its history is.
    assert hit["nodes2-router"] > hit["nodes2-own-cache"]
    assert result["checks"]["nodes2-router"]["router_events"] > 0
    assert result["checks"]["nodes2-router"]["placed_off_the_trace"] > 0
    for name in ("nodes2-own-cache", "nodes2-router", "nodes2-cluster"):
        assert result["checks"][name]["pages_wrong"] == 0 and result["checks"][name]["pages_checked"] > 0

    model = result["model"]
    assert len(model["points"]) >= 4 and all(p["seconds"] > 0 for p in model["points"])
    assert model["fit"]["a_s"] >= 0 and model["fit"]["b_s_per_token"] >= 0 and result["rate_rps"] > 0

    for png in ("multiturn_ttft_cdf.png", "multiturn_hit_rate.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) <= 150_000, (png, len(data))
