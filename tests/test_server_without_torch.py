"""The daemon loads no torch: it moves bytes (numpy views of mapped memory, the C kernels, CUDA
through CuPy), and torch's import was most of its start (1.2 of 1.5 s here) and of its idle memory.
Only a daemon where CuPy is installed (its CUDA path finds the CUDA libraries torch loads) or one
built without its copy kernel (the slow copy path) loads torch, at its start."""

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


FAKE_CUPY = ("import sys\nTORCH_FIRST = 'torch' in sys.modules\n\n\nclass cuda:\n    class runtime:\n"
             "        @staticmethod\n        def getDeviceCount():\n            return 1\n")


def _child(tmp_path, code: str, *fakes: tuple[str, str],
           args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``code`` run in a new interpreter that finds the stand-in packages ``fakes`` (name, source)."""
    for name, source in fakes:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_a_daemon_opening_a_cuda_pool_imports_torch_before_cupy(tmp_path) -> None:
    """Where the GPU check proved the CUDA path, torch was in the daemon and had loaded its nvidia
    packages' CUDA libraries before CuPy looked for them: the first CUDA registration keeps that."""
    code = ("import sys\nfrom kvserver.media.cuda.runtime import require_cuda\n"
            "assert 'torch' not in sys.modules\nprint(require_cuda().TORCH_FIRST)")
    out = _child(tmp_path, code, ("cupy", FAKE_CUPY))
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr[-2000:]


# A daemon as `python -m kvserver` serves; once it listens: whether torch is loaded, what was frozen,
# a full collection's CPU time, and the first CUDA registration's look at CuPy (or "refused").
SERVING_CHILD = """
import asyncio, gc, os, sys, time
import uvloop
from kvserver.config import ServerConfig
from kvserver.server import serve

async def main():
    task = asyncio.ensure_future(serve(ServerConfig(socket=sys.argv[1], host_memory=64 << 20)))
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]):
        assert not task.done() and time.monotonic() < deadline, "the daemon did not start"
        await asyncio.sleep(0.01)
    from kvserver.errors import FailedPrecondition
    from kvserver.media.cuda.runtime import require_cuda
    loaded = "torch" in sys.modules
    try:
        torch_first = (await asyncio.get_running_loop().run_in_executor(None, require_cuda)).TORCH_FIRST
    except FailedPrecondition:
        torch_first = "refused"
    took = []
    for _ in range(3):  # this thread's CPU (not a busy machine's waits); the first also clears, once
        t0 = time.thread_time()
        gc.collect()
        took.append(time.thread_time() - t0)
    print(loaded, gc.get_freeze_count(), min(took), torch_first, flush=True)
    # The socket is there from its bind, before serve() takes SIGTERM: no signal, the child just ends.
    os._exit(0)

uvloop.run(main())
"""


def _serve_with(tmp_path, *fakes: tuple[str, str]) -> list[str]:
    out = _child(tmp_path, SERVING_CHILD, *fakes, args=(str(tmp_path / "kv.sock"),))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_what_the_start_made_is_kept_out_of_the_collector(tmp_path) -> None:
    """A full collection over the daemon's modules (torch's and grpc's then: some 180k objects) took
    75 ms of the event loop, every engine's calls stalled behind it: what the imports made (grpc's
    and numpy's, some 40k objects, without CuPy no torch) is frozen before the daemon starts, and a
    collection then walks only the daemon's own objects."""
    loaded, frozen, took, torch_first = _serve_with(tmp_path)
    assert (loaded, torch_first) == ("False", "refused")
    assert int(frozen) > 20_000, f"only {frozen} objects were frozen once the daemon listened"
    assert float(took) < 0.01, f"a full collection took {float(took) * 1e3:.1f} ms"


def test_a_daemon_where_cupy_is_installed_loads_torch_before_it_freezes_what_its_start_made(tmp_path) -> None:
    """torch loaded at a first CUDA registration, after the start's objects were frozen, would stay
    in every full collection of the daemon's life (60 ms of the loop each); and its import would
    hold the GIL for up to a second while other engines' calls wait."""
    loaded, frozen, took, torch_first = _serve_with(tmp_path, ("cupy", FAKE_CUPY))
    assert loaded == "True" and torch_first == "True"
    assert int(frozen) > 100_000, f"only {frozen} objects were frozen: torch came after the freeze"
    assert float(took) < 0.01, f"a full collection took {float(took) * 1e3:.1f} ms"


def test_a_torch_that_fails_to_load_leaves_cuda_to_cupy_and_the_daemon_serving(tmp_path) -> None:
    broken = "raise OSError('libcudnn.so.9: cannot open shared object file')\n"
    loaded, _, _, torch_first = _serve_with(tmp_path, ("cupy", FAKE_CUPY), ("torch", broken))
    assert (loaded, torch_first) == ("False", "False")


def test_a_cuda_registration_without_cupy_is_refused_without_loading_torch(tmp_path) -> None:
    """Else any engine could make a daemon without CuPy load torch after its start's freeze (180 MiB,
    a second of the GIL, and 40-60 ms of the loop in every full collection after)."""
    code = ("import sys\nfrom kvserver.errors import FailedPrecondition\n"
            "from kvserver.media.cuda.runtime import require_cuda\n"
            "try:\n    require_cuda()\nexcept FailedPrecondition as exc:\n    print(exc)\n"
            "print('torch' in sys.modules)")
    out = _child(tmp_path, code)
    assert out.returncode == 0, out.stderr[-2000:]
    said, loaded = out.stdout.strip().splitlines()
    assert "CuPy is not installed" in said and loaded == "False", out.stdout


BROKEN_TORCH = "raise ImportError('libcudnn.so.9: cannot open shared object file')\n"


def test_a_torch_that_fails_to_load_is_logged_and_copies_without_the_kernel_say_why(tmp_path) -> None:
    code = """
import logging, numpy as np
logging.basicConfig(level=logging.WARNING)
from kvserver.copies import transfer
from kvserver.errors import KVError
transfer.copy_rows = None  # as a daemon built without its copy kernel
print(transfer.load_torch())
plan = transfer.make_plan(np.array([0]), np.arange(4), 4, 4)
host, dev = np.zeros((1, 8), np.int64), np.zeros((4, 2), np.int64)
for _ in range(2):
    try:
        transfer.copy_part(plan, host, dev.reshape(1, 8), dev, True)
    except KVError as exc:
        print(type(exc).__name__, exc)
"""
    out = _child(tmp_path, code, ("torch", BROKEN_TORCH))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "False" and len(lines) == 3, out.stdout
    assert all(line.startswith("Unimplemented ") and "torch" in line for line in lines[1:]), out.stdout
    assert out.stderr.count("torch could not be loaded (ImportError: libcudnn.so.9") == 1, out.stderr
