"""How the GPU path moves pages, decided without a GPU.

Small copies are where plain DMA collapses: batched cudaMemcpy stays at ~5-7 GB/s below ~28 KiB
per copy on H100 and reaches 40-52 GB/s from there up (vLLM PR #42212). Below that size a
gather/scatter kernel reading and writing mapped pinned host memory wins; at and above it, one
DMA per page chunk. The crossover depends on the device, so it is a parameter that the
GPU check measures.
"""

from __future__ import annotations

import os

import numpy as np

MAX_EVENT_SLOTS = 16  # event slots a CUDA pool may ask for (its events: slots x layers)

DMA_MIN_CHUNK_BYTES = 28 << 10
# Each DMA is one cudaMemcpyAsync issued from Python (a few microseconds each; not yet measured
# here): past this many per job the issue cost is taken to outweigh DMA's edge, and the kernel
# (one launch per layer) is used instead. The GPU check's figures are what should set it.
DMA_MAX_COPIES = 512


# The compiled data plane puts a CUDA pool's lane Writes and Loads on the GPU's stream itself
# (kvserver/lane/csrc/cuda_jobs.h): one cuMemcpyAsync a run for jobs of at most
# PLANE_DMA_MAX_COPIES copies whose runs are all DMA_MIN_CHUNK_BYTES or more, or of at most
# PLANE_SMALL_COPIES copies of any size (a call whose cost is its overhead, not the GPU's copy);
# the others by launches of the copy kernel. Pools with blocks or strided heads are the loop's. Off
# unless KVSERVER_PLANE_CUDA=1 until scripts/gpu_check.py has proven it on a GPU (docs/gpu-check.md).
PLANE = os.environ.get("KVSERVER_PLANE_CUDA", "0") == "1"
PLANE_SMALL_COPIES = 64
# Driver calls the plane may have on one pool's stream for calls not ended. A stream stalled
# behind an engine's ready event that never fires fills the driver's queue, and a call into a full
# queue waits for room: bounded so, the plane's one thread never waits there (the loop's copy
# workers take what is past it). A stream is reported to take about 1000 kernel launches before
# the next waits (Stack Overflow question 53970187; not measured here): half of that, until the GPU
# check's probe (queue_depth_probe) measures the depth for each kind of call the plane makes.
PLANE_MAX_QUEUED = 512
# The same bound for the loop's copy workers (kvserver/media/cuda/pool.py): the driver calls one
# pool's stream may hold for its jobs not ended while an engine event they wait on has not fired.
# A job past it waits in the copy queue, not in a driver call on a worker that every engine's
# copies need. The plane and the loop never have calls on one stream at once (a loop's copy of a
# plane client waits for the plane's: plane_turn; a pool the loop gave up on keeps a turn).
MAX_QUEUED = 512
# Host arrays the copy kernel's launches read, uploaded for each job (CuPy's asarray: a copy on the
# stream and an event recorded behind it, each).
KERNEL_UPLOADS = 4


def max_layers() -> int:
    """The most layers a CUDA pool may have: a load by the copy kernel makes two calls a layer
    (the launch, the record) besides its uploads and its wait, and no one job may make more than
    ``MAX_QUEUED`` (a job past the driver's depth would wait in a driver call on its own stream,
    before its wait could give up on it)."""
    return (MAX_QUEUED - 2 * KERNEL_UPLOADS - 1) // 2


def dma_max_copies(num_layers: int, to_device: bool) -> int:
    """The most DMA copies of a job of ``num_layers`` layers: ``DMA_MAX_COPIES``, and with its
    wait and its records (a load's, one a layer; a write's one) no more calls than ``MAX_QUEUED``."""
    return min(DMA_MAX_COPIES, MAX_QUEUED - 1 - (num_layers if to_device else 1))
# The plane's DMA jobs are fewer copies than the loop's: their calls are made on the plane's one
# thread, a few microseconds each, while every other lane waits, and they count against
# PLANE_MAX_QUEUED; past this many, one launch of the copy kernel does the job.
PLANE_DMA_MAX_COPIES = 128
# A job past the DMA limits above is the copy kernel's, launched by the plane too: one launch a layer
# (a load) or one (a write), token rows, its bases and offsets written into this much pinned host
# memory of the pool, mapped for the device and handed out as a ring (a job that finds no room is
# the loop's): 16 bytes a token and a (layer, part).
PLANE_ARGS_BYTES = 2 << 20


def choose_method(chunk_bytes: int, num_copies: int = 1,
                  dma_min_chunk_bytes: int = DMA_MIN_CHUNK_BYTES, max_copies: int = DMA_MAX_COPIES) -> str:
    """'dma' for large per-(layer, part) page chunks when there are few of them (``max_copies``
    at most), else 'kernel'."""
    if chunk_bytes >= dma_min_chunk_bytes and num_copies <= max_copies:
        return "dma"
    return "kernel"


def word_bytes(row_bytes: int, *addresses: np.ndarray) -> int:
    """The copy kernel's word: the widest of 8, 4, 2, 1 bytes dividing the row size and every base
    and offset in ``addresses``."""
    for word in (8, 4, 2):
        if row_bytes % word == 0 and not any((np.asarray(a) % word).any() for a in addresses):
            return word
    return 1


def kernel_launch(num_rows: int, row_bytes: int, max_blocks: int,
                  warps_per_block: int = 4, word_bytes: int = 8) -> tuple[int, int]:
    """(blocks, threads) for the copy kernel: one warp per row, capped in blocks so the copy
    leaves most SMs to the engine's compute."""
    if row_bytes % word_bytes:
        raise ValueError(f"rows must be a multiple of {word_bytes} bytes for this copy kernel, "
                         f"got {row_bytes}")
    blocks = max(1, min(max_blocks, -(-num_rows // warps_per_block)))
    return blocks, 32 * warps_per_block
