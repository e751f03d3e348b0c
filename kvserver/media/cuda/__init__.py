"""The CUDA medium: an engine's KV buffers opened through CUDA IPC, copied by the GPU between
them and pinned host memory.

Owns: ``open_cuda`` (here), ``pool``, ``slabs``, ``devices``, ``plan``, ``kernels``, ``waits``,
``quarantine``, ``runtime`` and ``driver``.

Nothing here imports CuPy or touches a GPU at import time: ``runtime.require_cuda()`` does, the
first time a CUDA client registers. The pool itself lives in ``pool`` (imported only once a CUDA
pool is opened, so that a daemon without CuPy never loads it); cache slabs are pinned by
``slabs.SlabPinner``; ``devices`` finds devices by UUID, ``plan`` and ``kernels`` decide and build
the copies, ``waits`` polls with deadlines, ``quarantine`` holds what a stalled GPU may still touch
and ``driver`` is the one driver call made through ctypes.

May import: what ``kvserver.media`` may (``copies``, ``protocol``, ``errors``, ``v1``), and CuPy lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserver.copies import geometry
from kvserver.errors import InvalidArgument, Unimplemented
from kvserver.media.cuda.plan import MAX_EVENT_SLOTS
from kvserver.media.cuda.runtime import require_cuda
from kvserver.media.cuda.slabs import SlabPinner
from kvserver.protocol.cuda_ipc import check_span, normalize_pci_bus_id, normalize_uuid, raw_ipc_handle
from kvserver.protocol.layout import KVDType, KVLayout
from kvserver.v1 import kvserver_pb2 as pb

if TYPE_CHECKING:
    from kvserver.media.cuda.pool import CudaDevicePool

__all__ = ["SlabPinner", "open_cuda"]


def open_cuda(refs: list[pb.BufferRef], num_tokens: int, layout: KVLayout, kv_dtype: KVDType,
              page_size: int, event_slots: int, slabs: SlabPinner | None = None) -> CudaDevicePool:
    """Checks every handle, UUID and span first (bad input is INVALID_ARGUMENT on any daemon),
    then needs a usable GPU (FAILED_PRECONDITION without one), then opens the allocations.
    ``slabs``: the daemon's cache slabs, pinned for this pool's device once it attaches."""
    token_bytes = layout.token_bytes(kv_dtype)
    heads, head_bytes = layout.num_heads, layout.head_dim * kv_dtype.itemsize
    if not 0 <= event_slots <= MAX_EVENT_SLOTS:
        raise InvalidArgument(f"event_slots must be at most {MAX_EVENT_SLOTS}, got {event_slots}")
    if len({r.token_stride for r in refs}) > 1:
        raise InvalidArgument("every buffer of a CUDA pool must have the same token_stride")
    if len({normalize_uuid(r.cuda.device_uuid) for r in refs if r.cuda.device_uuid}) > 1:
        raise InvalidArgument("every buffer of a CUDA pool must live on one device")
    geoms = []
    budget = geometry.CheckBudget()
    for i, r in enumerate(refs):
        what = f"device_pool buffer {i}"
        raw_ipc_handle(r.cuda.ipc_handle)
        normalize_uuid(r.cuda.device_uuid)
        normalize_pci_bus_id(r.cuda.pci_bus_id)
        g = geometry.of_ref(r, num_tokens, heads, head_bytes, what, budget)
        geoms.append(g)
        if g.plain:
            check_span(r.offset, r.token_stride, num_tokens, token_bytes, r.cuda.allocation_size, what)
        elif g.span(num_tokens)[1] > r.cuda.allocation_size:
            raise InvalidArgument(
                f"{what}: buffer at {geometry.describe(r)} needs {g.span(num_tokens)[1]} bytes for "
                f"{num_tokens} tokens, but the allocation is {r.cuda.allocation_size} bytes")
    # Grouped by allocation: the handle as CUDA gives it, whichever of its forms the engine sent.
    geometry.check_no_overlap(geoms, [raw_ipc_handle(r.cuda.ipc_handle).hex() for r in refs], num_tokens,
                              lambda i: f"device_pool buffer {i}", budget)
    strided = not all(g.plain for g in geoms)
    if strided and len({g.shape_key() for g in geoms}) != 1:
        raise Unimplemented(
            "every buffer of a CUDA pool with blocks or strided heads must have the same token_stride, "
            "block_tokens, block_stride and head_stride")
    cupy = require_cuda()
    from kvserver.media.cuda.pool import open_cuda_pool  # needs CuPy's runtime: imported only now

    return open_cuda_pool(cupy, refs, num_tokens, token_bytes, layout.num_parts, page_size, event_slots,
                          slabs, geoms if strided else None)
