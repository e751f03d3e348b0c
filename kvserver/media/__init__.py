"""Device pools, one module per medium: shared memory (``shm``) and CUDA IPC (``cuda``), all
behind one interface (``base.DevicePool``). ``open_pool`` checks a Register request's pool
description and opens it with the medium its buffers name.

Owns: the media and how each runs a ``kvserver.copies.job.Job``. A new medium is a module here (and
a pool class in the client).
May import: ``copies``, ``peers`` (the caller's credentials for named objects), ``protocol``,
``errors`` and ``v1``; nothing above it (no client state, no cache, no gRPC).
"""

from __future__ import annotations

from kvserver.errors import InvalidArgument
from kvserver.media import cuda, shm
from kvserver.media.base import DevicePool, wide_dtype
from kvserver.media.cuda import SlabPinner
from kvserver.media.shm import ShmAccess, ShmDevicePool, pool_descriptors
from kvserver.protocol.layout import KVDType, KVLayout
from kvserver.v1 import kvserver_pb2 as pb

__all__ = ["MAX_POOL_TOKENS", "DevicePool", "ShmAccess", "ShmDevicePool", "SlabPinner", "open_pool",
           "pool_descriptors", "wide_dtype"]

MAX_POOL_TOKENS = 1 << 40


def open_pool(
    msg: pb.DevicePool,
    layout: KVLayout,
    kv_dtype: KVDType,
    num_layers: int,
    page_size: int,
    event_slots: int = 0,
    access: ShmAccess | None = None,
    *,
    slabs: SlabPinner | None = None,
) -> DevicePool:
    """Validates the whole description, then opens the pool where it lives. Shared-memory pools
    open only from ``access``: the caller's descriptors, or named objects it owns. CUDA pools
    pin ``slabs`` (the daemon's cache slabs) for their device."""
    refs = _check_refs(msg, layout, num_layers)
    n = msg.num_tokens
    if not 0 < n <= MAX_POOL_TOKENS:
        raise InvalidArgument(f"device_pool.num_tokens must be in [1, {MAX_POOL_TOKENS}], got {n}")
    kinds = {r.WhichOneof("location") for r in refs}
    if kinds == {"cuda"}:
        return cuda.open_cuda(refs, n, layout, kv_dtype, page_size, event_slots, slabs)
    if kinds not in ({"fd"}, {"shm"}, {"fd", "shm"}):
        raise InvalidArgument(
            "every buffer of a device pool must have a location, all shared memory (fd or shm) or "
            f"all CUDA IPC (cuda); got {sorted(k or 'none' for k in kinds)}"
        )
    return shm.open_shm_pool(refs, n, layout, kv_dtype, num_layers, page_size, access or ShmAccess())


def _check_refs(msg: pb.DevicePool, layout: KVLayout, num_layers: int) -> list[pb.BufferRef]:
    if len(msg.layers) != num_layers:
        raise InvalidArgument(
            f"device_pool lists {len(msg.layers)} layers but the layer range holds {num_layers}"
        )
    refs: list[pb.BufferRef] = []
    kind = "MLA (one latent)" if layout.is_mla else "MHA (K and V)"
    for i, layer in enumerate(msg.layers):
        if len(layer.parts) != layout.num_parts:
            raise InvalidArgument(
                f"device_pool layer {i} has {len(layer.parts)} buffers; {kind} needs "
                f"{layout.num_parts}"
            )
        refs.extend(layer.parts)
    return refs
