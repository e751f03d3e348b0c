"""The daemon never loads torch: it moves bytes (numpy views of mapped memory, the C kernels, CUDA
through CuPy), and torch's import was most of its start (1.2 of 1.5 s here) and of its idle memory.
Only a daemon built without its copy kernel takes torch, for the slow copy path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from cache_engine import CacheEngine
from daemon_proc import DaemonProcess

from kvserver.copies import transfer


def test_importing_the_daemon_and_its_command_line_loads_no_torch() -> None:
    code = ("import sys, kvserver.__main__, kvserver.server, kvserver.media, kvserver.copies.transfer\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


def test_a_daemon_serving_engines_has_no_torch_mapped(tmp_path) -> None:
    assert transfer.copy_rows is not None, "the _kvcopy extension is not built"
    d = DaemonProcess(str(tmp_path / "kv.sock"), host_memory="64MiB")
    try:
        a = CacheEngine(d.address)
        b = CacheEngine(d.address)
        keys = [f"no-torch-{i}".encode() for i in range(8)]
        pages = np.arange(8)
        a.fill(keys, pages)
        assert a.put(keys, pages).stored == 8
        assert b.get(keys, pages) == 8 and b.wrong(keys, pages) == []
        with open(f"/proc/{d.pid}/maps") as f:
            torch_libs = {line.split()[-1] for line in f if "torch" in line}
        assert torch_libs == set(), sorted(torch_libs)
        a.close()
        b.close()
    finally:
        d.kill()


def test_a_daemon_opening_a_cuda_pool_imports_torch_before_cupy(tmp_path) -> None:
    """Where the GPU check proved the CUDA path, torch was in the daemon and had loaded its nvidia
    packages' CUDA libraries before CuPy looked for them: the first CUDA registration keeps that."""
    fake = tmp_path / "cupy"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import sys\nTORCH_FIRST = 'torch' in sys.modules\n\n\nclass cuda:\n    class runtime:\n"
        "        @staticmethod\n        def getDeviceCount():\n            return 1\n")
    code = ("import sys\nfrom kvserver.media.cuda.runtime import require_cuda\n"
            "assert 'torch' not in sys.modules\nprint(require_cuda().TORCH_FIRST)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr[-2000:]
