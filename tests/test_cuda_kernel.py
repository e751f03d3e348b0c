"""The GPU copy kernel's source without a GPU: it compiles for Hopper and Ampere with nvcc (where
the CUDA toolkit is installed), and, built for the CPU and run thread by thread
(tests/kernel_host.py), it moves exactly the rows it is given for any grid shape."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from kernel_host import HostKernel, compiler

from kvserver.cuda import plan
from kvserver.cuda.kernels import SOURCE


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_kernel_compiles_for_the_gpu(tmp_path, arch):
    src = tmp_path / "kernel.cu"
    src.write_text(SOURCE)
    res = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-Werror", "all-warnings",
                          str(src), "-o", str(tmp_path / "kernel.cubin")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "0 bytes spill stores" in res.stderr, res.stderr  # no register spills in the copy loop


pytestmark_cpu = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) to build the kernel")


def run_kernel(dst_bufs, src_bufs, dst_off, src_off, row_bytes, blocks, warps):
    kernel = HostKernel(SOURCE, "kv_copy_rows")
    dst_bases = np.array([b.ctypes.data for b in dst_bufs], dtype=np.uint64)
    src_bases = np.array([b.ctypes.data for b in src_bufs], dtype=np.uint64)
    kernel((blocks,), (32 * warps,), (dst_bases, src_bases, np.int32(len(dst_bufs)), dst_off, src_off,
                                      np.int64(dst_off.size), np.int64(row_bytes // 8)))


@pytestmark_cpu
@pytest.mark.parametrize(("num_buffers", "rows", "row_bytes", "blocks", "warps"), [
    (4, 37, 2048, 3, 2),  # fewer warps than rows: the grid-stride loop
    (1, 5, 8, 128, 8),  # more warps than rows, one word per row
    (6, 64, 264, 1, 1),  # one warp for everything; rows not a multiple of 32 words
    (2, 300, 32768, *plan.kernel_launch(300 * 2, 32768, 128, warps_per_block=8)[:1], 8),  # as launched
])
def test_kernel_moves_exactly_the_given_rows(num_buffers, rows, row_bytes, blocks, warps):
    rng = np.random.default_rng(rows)
    slots = rows * 2 + 3
    src = [rng.integers(0, 256, slots * row_bytes, dtype=np.uint8) for _ in range(num_buffers)]
    dst = [np.zeros(slots * row_bytes + 8, dtype=np.uint8) for _ in range(num_buffers)]
    src_rows = rng.permutation(slots)[:rows]
    dst_rows = rng.permutation(slots)[:rows]
    run_kernel(dst, src, (dst_rows * row_bytes).astype(np.int64), (src_rows * row_bytes).astype(np.int64),
               row_bytes, blocks, warps)
    for d, s in zip(dst, src, strict=True):
        got = d[:-8].reshape(slots, row_bytes)
        want = np.zeros_like(got)
        want[dst_rows] = s.reshape(slots, row_bytes)[src_rows]
        assert np.array_equal(got, want)
        assert not d[-8:].any()  # nothing past the last row


@pytestmark_cpu
def test_kernel_launcher_refuses_python_ints():
    """CuPy passes a Python int as a 64-bit value: the kernel's `int num_buffers` needs np.int32."""
    kernel = HostKernel(SOURCE, "kv_copy_rows")
    z = np.zeros(1, dtype=np.uint64)
    o = np.zeros(1, dtype=np.int64)
    with pytest.raises(TypeError, match="int32"):
        kernel((1,), (32,), (z, z, 1, o, o, np.int64(1), np.int64(1)))
