"""The GPU copy kernels' source without a GPU: it compiles for Hopper and Ampere with nvcc (where
the CUDA toolkit is installed), and, built for the CPU and run thread by thread
(tests/kernel_host.py), each kernel moves exactly the rows it is given for any grid shape, with
8-byte words and, for rows, bases and offsets of any alignment, 4-, 2- and 1-byte ones."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from kernel_host import HostKernel, compiler

from kvserver.media.cuda import plan
from kvserver.media.cuda.kernels import KERNELS, SOURCE


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_kernel_compiles_for_the_gpu(tmp_path, arch):
    src = tmp_path / "kernel.cu"
    src.write_text(SOURCE)
    res = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-Werror", "all-warnings",
                          str(src), "-o", str(tmp_path / "kernel.cubin")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for name in KERNELS.values():
        assert f"Compiling entry function '{name}'" in res.stderr, res.stderr
    # No register spills in any kernel's copy loop.
    assert res.stderr.count("0 bytes spill stores") == len(KERNELS), res.stderr


pytestmark_cpu = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) to build the kernel")


def run_kernel(dst_bufs, src_bufs, dst_off, src_off, row_bytes, blocks, warps, word_bytes=8):
    kernel = HostKernel(SOURCE, KERNELS[word_bytes])
    dst_bases = np.array([b.ctypes.data for b in dst_bufs], dtype=np.uint64)
    src_bases = np.array([b.ctypes.data for b in src_bufs], dtype=np.uint64)
    kernel((blocks,), (32 * warps,), (dst_bases, src_bases, np.int32(len(dst_bufs)), dst_off, src_off,
                                      np.int64(dst_off.size), np.int64(row_bytes // word_bytes)))


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
@pytest.mark.parametrize(("word_bytes", "row_bytes"), [(4, 4 * 33), (2, 2 * 37), (1, 75), (1, 1)])
def test_narrow_word_kernels_move_unaligned_rows(word_bytes, row_bytes):
    """Rows, bases and offsets aligned only to the kernel's word: every byte of every row lands,
    nothing else is written."""
    rng = np.random.default_rng(row_bytes)
    rows, slots, num_buffers = 41, 97, 3
    # Buffers that start `word_bytes` past an 8-byte boundary (a 1-byte kernel gets odd bases).
    src_mem = [rng.integers(0, 256, slots * row_bytes + 16, dtype=np.uint8) for _ in range(num_buffers)]
    dst_mem = [np.zeros(slots * row_bytes + 16, dtype=np.uint8) for _ in range(num_buffers)]
    src = [m[word_bytes:word_bytes + slots * row_bytes] for m in src_mem]
    dst = [m[word_bytes:word_bytes + slots * row_bytes] for m in dst_mem]
    src_rows = rng.permutation(slots)[:rows]
    dst_rows = rng.permutation(slots)[:rows]
    blocks, threads = plan.kernel_launch(rows * num_buffers, row_bytes, 2, warps_per_block=2,
                                         word_bytes=word_bytes)
    run_kernel(dst, src, (dst_rows * row_bytes).astype(np.int64), (src_rows * row_bytes).astype(np.int64),
               row_bytes, blocks, threads // 32, word_bytes=word_bytes)
    for dm, d, s in zip(dst_mem, dst, src, strict=True):
        want = np.zeros((slots, row_bytes), dtype=np.uint8)
        want[dst_rows] = s.reshape(slots, row_bytes)[src_rows]
        assert np.array_equal(d.reshape(slots, row_bytes), want)
        assert not dm[:word_bytes].any() and not dm[word_bytes + slots * row_bytes:].any()


@pytestmark_cpu
def test_kernel_launcher_refuses_python_ints():
    """CuPy passes a Python int as a 64-bit value: the kernel's `int num_buffers` needs np.int32."""
    kernel = HostKernel(SOURCE, "kv_copy_rows")
    z = np.zeros(1, dtype=np.uint64)
    o = np.zeros(1, dtype=np.int64)
    with pytest.raises(TypeError, match="int32"):
        kernel((1,), (32,), (z, z, 1, o, o, np.int64(1), np.int64(1)))
