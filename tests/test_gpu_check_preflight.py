"""scripts/gpu_check.py's first stage, on CPU, as a lent GPU machine runs it: from a bare copy of
the tree (the project not installed, only its dependencies), the daemon starts and answers health,
every module the engines import resolves to this tree (kvclient's sources are in client/), and
the vLLM worker side imports over the script's vLLM stand-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_preflight_runs_from_a_bare_source_tree(tmp_path):
    # The base interpreter with the venv's site-packages on PYTHONPATH: the dependencies import,
    # but the editable install's .pth hooks are not processed, so kvserver and kvclient come only
    # from what the script itself puts on sys.path.
    base = getattr(sys, "_base_executable", sys.executable)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": sysconfig.get_paths()["purelib"],
           "HOME": str(tmp_path)}
    res = subprocess.run([base, "-s", os.path.join(ROOT, "scripts", "gpu_check.py"), "--preflight"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["ok"], res.stdout + res.stderr[-3000:]
    pre = report["preflight"]
    assert pre["daemon_health"] == "SERVING"
    assert os.path.realpath(pre["kvclient"]) == os.path.realpath(os.path.join(ROOT, "client"))
    assert os.path.realpath(pre["kvserver"]) == os.path.realpath(os.path.join(ROOT, "kvserver"))
    assert pre["cuda"]  # "usable", or why not
    assert pre["vllm_worker"] == "imports (vLLM stand-in)"  # the worker side, as the vLLM round runs it
    assert report["daemon_exit"] == 0  # SIGTERM drains and exits cleanly
