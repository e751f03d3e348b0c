"""The GPU copy kernels: scattered rows between device memory and mapped pinned host memory.

One warp per row, a grid-stride loop over (buffer, row) pairs, and a capped grid so the copy
leaves most SMs to the engine. The word is the widest of 8, 4, 2 or 1 bytes that divides every
row size, base and offset of the job, so rows of any alignment are one launch per layer, never a
copy call per row. Built with NVRTC on first use (CuPy RawKernel), one kernel per word size.
"""

from __future__ import annotations

import functools

# Word size in bytes -> kernel name.
KERNELS = {8: "kv_copy_rows", 4: "kv_copy_rows_w4", 2: "kv_copy_rows_w2", 1: "kv_copy_rows_w1"}

SOURCE = r"""
template <typename Word>
__device__ __forceinline__ void copy_rows(
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
        const Word* src = (const Word*)(src_bases[b] + (unsigned long long)src_offsets[r]);
        Word* dst = (Word*)(dst_bases[b] + (unsigned long long)dst_offsets[r]);
        for (long long i = lane; i < row_words; i += 32) {
            dst[i] = src[i];
        }
    }
}

#define KV_COPY_ROWS(name, Word)                                                              \
extern "C" __global__ void name(                                                              \
    const unsigned long long* __restrict__ dst_bases,                                         \
    const unsigned long long* __restrict__ src_bases,                                         \
    const int num_buffers,                                                                    \
    const long long* __restrict__ dst_offsets,                                                \
    const long long* __restrict__ src_offsets,                                                \
    const long long num_rows,                                                                 \
    const long long row_words)                                                                \
{                                                                                             \
    copy_rows<Word>(dst_bases, src_bases, num_buffers, dst_offsets, src_offsets, num_rows,    \
                    row_words);                                                               \
}

KV_COPY_ROWS(kv_copy_rows, unsigned long long)
KV_COPY_ROWS(kv_copy_rows_w4, unsigned int)
KV_COPY_ROWS(kv_copy_rows_w2, unsigned short)
KV_COPY_ROWS(kv_copy_rows_w1, unsigned char)
"""


@functools.cache
def copy_rows_kernel(cupy, word_bytes: int = 8):
    return cupy.RawKernel(SOURCE, KERNELS[word_bytes])
