"""The GPU check, as a test: runs scripts/gpu_check.py --quick where a CUDA GPU and CuPy exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvserver.media.cuda.runtime import _probe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (torch sees none)"),
    pytest.mark.skipif(_probe()[0] is None, reason=f"the daemon cannot use CUDA here: {_probe()[1]}"),
]


def test_gpu_check_passes():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["ok"], json.dumps(report, indent=1)
