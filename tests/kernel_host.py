"""The GPU copy kernels' own source (kvserver/media/cuda/kernels.py), built for the CPU and run thread by
thread, so tests without a GPU check the real kernels' indexing, not a re-implementation of it.

The kernel's threads share nothing (no shared memory, no barriers), so running every (block,
thread) of the grid one after another gives what the GPU gives. What this cannot show (speed,
real mapped memory) is for scripts/gpu_check.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

KERNELS = ("kv_copy_rows", "kv_copy_rows_w4", "kv_copy_rows_w2", "kv_copy_rows_w1")
_SHIM = r"""
struct kv_dim3 { unsigned int x, y, z; };
static kv_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
"""
_LAUNCHER = r"""
extern "C" void launch_NAME(unsigned int grid, unsigned int block,
    const unsigned long long* dst_bases, const unsigned long long* src_bases, int num_buffers,
    const long long* dst_offsets, const long long* src_offsets, long long num_rows, long long row_words)
{
    gridDim.x = grid; blockDim.x = block; gridDim.y = gridDim.z = blockDim.y = blockDim.z = 1;
    for (unsigned int b = 0; b < grid; ++b) {
        for (unsigned int t = 0; t < block; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            NAME(dst_bases, src_bases, num_buffers, dst_offsets, src_offsets, num_rows, row_words);
        }
    }
}
"""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.cache
def build(source: str) -> ctypes.CDLL:
    """The kernel source as a shared library exporting ``launch_<kernel>(grid, block, *kernel args)``
    for each kernel it defines."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) to build the copy kernel for the CPU")
    text = _SHIM + source + "".join(_LAUNCHER.replace("NAME", name) for name in KERNELS if name in source)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"kvserver-kernel-{digest}.so")
    if not os.path.exists(out):
        tmp = f"{out}.{os.getpid()}"
        subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-x", "c++", "-", "-o", tmp], input=text.encode(),
                       check=True, capture_output=True)
        os.replace(tmp, out)
    lib = ctypes.CDLL(out)
    for name in KERNELS:
        if name in source:
            fn = getattr(lib, f"launch_{name}")
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong]
            fn.restype = None
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class HostKernel:
    """Called like a CuPy RawKernel: ``kernel((blocks,), (threads,), args)``, args as numpy."""

    def __init__(self, source: str, name: str) -> None:
        if name not in KERNELS or name not in source:
            raise ValueError(f"only {KERNELS} have CPU launchers, and the source must define {name}")
        self.name = name
        self.launch = getattr(build(source), f"launch_{name}")

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        dst_bases, src_bases, count, dst_off, src_off, n, words = args
        arrays = ((dst_bases, np.uint64), (src_bases, np.uint64), (dst_off, np.int64), (src_off, np.int64))
        for a, dtype in arrays:
            if a.dtype != dtype or not a.flags.c_contiguous:
                raise TypeError(f"kernel arrays must be contiguous {dtype.__name__}, got {a.dtype}")
        # CuPy passes a Python int as a 64-bit long long: the kernel's `int` needs an np.int32.
        for a, dtype in ((count, np.int32), (n, np.int64), (words, np.int64)):
            if not isinstance(a, np.generic) or a.dtype != dtype:
                raise TypeError(f"kernel scalars must be {dtype.__name__}, got {type(a).__name__}")
        self.launch(grid[0], block[0], _ptr(dst_bases), _ptr(src_bases), int(count), _ptr(dst_off),
                    _ptr(src_off), int(n), int(words))
