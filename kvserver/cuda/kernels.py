"""The GPU copy kernel: scattered rows between device memory and mapped pinned host memory.

One warp per row, 8-byte words, a grid-stride loop over (buffer, row) pairs, and a capped grid
so the copy leaves most SMs to the engine. Built with NVRTC on first use (CuPy RawKernel).
"""

from __future__ import annotations

import functools

SOURCE = r"""
extern "C" __global__ void kv_copy_rows(
    const unsigned long long* __restrict__ dst_bases,
    const unsigned long long* __restrict__ src_bases,
    const int num_buffers,
    const long long* __restrict__ dst_offsets,
    const long long* __restrict__ src_offsets,
    const long long num_rows,
    const long long row_words)
{
    const long long lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long num_warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long total = (long long)num_buffers * num_rows;
    for (long long w = warp; w < total; w += num_warps) {
        const long long b = w / num_rows;
        const long long r = w - b * num_rows;
        const unsigned long long* src =
            (const unsigned long long*)(src_bases[b] + (unsigned long long)src_offsets[r]);
        unsigned long long* dst = (unsigned long long*)(dst_bases[b] + (unsigned long long)dst_offsets[r]);
        for (long long i = lane; i < row_words; i += 32) {
            dst[i] = src[i];
        }
    }
}
"""


@functools.cache
def copy_rows_kernel(cupy):
    return cupy.RawKernel(SOURCE, "kv_copy_rows")
