"""An engine's device pool as the daemon sees it: one strided tensor view per (layer, part).

Views use the widest integer dtype that divides every offset, stride and token size, so copies
move 8-byte words where they can whatever the KV dtype is (fp8 included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvserver.cuda.devices import normalize_pci_bus_id
from kvserver.cuda.handles import check_span, normalize_uuid, raw_ipc_handle
from kvserver.cuda.runtime import require_cuda
from kvserver.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvserver.layout import KVLayout
from kvserver.shm import ShmMapping, map_sealed_fd, open_shm
from kvserver.tickets import PeerCred
from kvserver.transfer import BufferTable
from kvserver.v1 import kvserver_pb2 as pb

WIDE_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
MAX_POOL_TOKENS = 1 << 40


def wide_dtype(*sizes: int) -> torch.dtype:
    """The widest integer dtype whose size divides every one of ``sizes``."""
    g = 0
    for s in sizes:
        g = math.gcd(g, s)
    for width, dtype in WIDE_DTYPES.items():
        if g % width == 0:
            return dtype
    return torch.uint8


@dataclass(frozen=True, slots=True)
class ShmAccess:
    """What a shared-memory pool may be opened from: the descriptors and credentials of the
    Register call's peer ticket (none without one), whether named /dev/shm objects are allowed
    (--allow-named-shm), and whether the daemon has the Unix socket tickets come from."""

    fds: tuple[int, ...] = ()
    peer: PeerCred | None = None
    allow_named: bool = False
    fd_socket: bool = True


@dataclass(slots=True)
class ShmDevicePool:
    """Views into the engine's shared-memory KV buffers, checked against each object's size."""

    num_tokens: int
    page_size: int
    dtype: torch.dtype  # the wide copy dtype
    token_views: list[list[torch.Tensor]]  # [layer][part] -> [num_tokens, elems]
    page_views: list[list[torch.Tensor]] | None  # [layer][part] -> [num_pages, page_size*elems]
    mappings: list[ShmMapping] = field(default_factory=list)
    kind: str = "shm"
    token_table: BufferTable | None = None
    page_table: BufferTable | None = None

    def __post_init__(self) -> None:
        self.token_table = BufferTable.of(self.token_views)
        if self.page_views is not None:
            self.page_table = BufferTable.of(self.page_views)

    @property
    def num_pages(self) -> int:
        return self.num_tokens // self.page_size

    @property
    def paged(self) -> bool:
        """Whole device pages can be copied as rows (the buffers are page-contiguous)."""
        return self.page_views is not None

    def attach_host(self, host_ptr: int, nbytes: int, num_layers: int) -> None:
        """The CPU copies between shared memory and the host region: nothing to set up."""

    def check_sizes(self) -> None:
        """Named objects can shrink under the mapping; sealed fds cannot (their fd is -1)."""
        for m in self.mappings:
            m.check_size()

    def close(self) -> None:
        self.token_views = []
        self.page_views = None
        for m in self.mappings:
            m.close()
        self.mappings = []


def open_pool(
    msg: pb.DevicePool,
    layout: KVLayout,
    kv_dtype: torch.dtype,
    num_layers: int,
    page_size: int,
    event_slots: int = 0,
    access: ShmAccess | None = None,
):
    """Validates the whole description, then opens the pool where it lives. Shared-memory pools
    open only from ``access``: the caller's descriptors, or named objects it owns."""
    refs = _check_refs(msg, layout, num_layers)
    n = msg.num_tokens
    if not 0 < n <= MAX_POOL_TOKENS:
        raise InvalidArgument(f"device_pool.num_tokens must be in [1, {MAX_POOL_TOKENS}], got {n}")
    kinds = {r.WhichOneof("location") for r in refs}
    if kinds == {"cuda"}:
        return open_cuda(refs, n, layout, kv_dtype, page_size, event_slots)
    if kinds not in ({"fd"}, {"shm"}, {"fd", "shm"}):
        raise InvalidArgument(
            "every buffer of a device pool must have a location, all shared memory (fd or shm) or "
            f"all CUDA IPC (cuda); got {sorted(k or 'none' for k in kinds)}"
        )
    return open_shm_pool(refs, n, layout, kv_dtype, num_layers, page_size, access or ShmAccess())


def open_cuda(refs: list[pb.BufferRef], num_tokens: int, layout: KVLayout, kv_dtype: torch.dtype,
              page_size: int, event_slots: int):
    """Checks every handle, UUID and span first (bad input is INVALID_ARGUMENT on any daemon),
    then needs a usable GPU (FAILED_PRECONDITION without one), then opens the allocations."""
    token_bytes = layout.token_bytes(kv_dtype)
    for i, r in enumerate(refs):
        what = f"device_pool buffer {i}"
        raw_ipc_handle(r.cuda.ipc_handle)
        normalize_uuid(r.cuda.device_uuid)
        normalize_pci_bus_id(r.cuda.pci_bus_id)
        check_span(r.offset, r.token_stride, num_tokens, token_bytes, r.cuda.allocation_size, what)
    cupy = require_cuda()
    from kvserver.cuda.pool import open_cuda_pool  # needs CuPy's runtime: imported only now

    return open_cuda_pool(cupy, refs, num_tokens, token_bytes, layout.num_parts, page_size, event_slots)


def open_shm_pool(
    refs: list[pb.BufferRef],
    n: int,
    layout: KVLayout,
    kv_dtype: torch.dtype,
    num_layers: int,
    page_size: int,
    access: ShmAccess,
) -> ShmDevicePool:
    """Maps each descriptor or named object once, checks each buffer against its size, and
    builds views. Every reference is checked before anything is mapped."""
    token_bytes = layout.token_bytes(kv_dtype)
    _check_access(refs, access)
    for r in refs:
        if r.token_stride < token_bytes:
            raise InvalidArgument(
                f"token_stride {r.token_stride} is smaller than one token ({token_bytes} bytes "
                f"for {layout} in {kv_dtype})"
            )
    mappings: dict[str, ShmMapping] = {}
    try:
        for r in refs:
            key = _key(r)
            if key not in mappings:
                if r.HasField("fd"):
                    mappings[key] = map_sealed_fd(access.fds[r.fd.index], f"fd {r.fd.index}")
                else:
                    mappings[key] = open_shm(r.shm.name, access.peer.uid)
            m = mappings[key]
            end = r.offset + (n - 1) * r.token_stride + token_bytes
            if end > m.size:
                what = f"shm object {r.shm.name!r}" if r.HasField("shm") else f"fd {r.fd.index}"
                raise InvalidArgument(
                    f"{what} is {m.size} bytes but the buffer at offset {r.offset} "
                    f"with token_stride {r.token_stride} needs {end} bytes for {n} tokens"
                )
        wide = wide_dtype(token_bytes, *(r.offset for r in refs), *(r.token_stride for r in refs))
        w = wide.itemsize
        flat = {key: torch.frombuffer(m.mm, dtype=wide, count=m.size // w) for key, m in mappings.items()}
        elems = token_bytes // w
        parts = layout.num_parts
        token_views = [
            [
                torch.as_strided(flat[_key(r)], (n, elems), (r.token_stride // w, 1), r.offset // w)
                for r in refs[layer * parts : (layer + 1) * parts]
            ]
            for layer in range(num_layers)
        ]
        page_views = None
        if all(r.token_stride == token_bytes for r in refs) and n >= page_size:
            pages = n // page_size
            page_views = [
                [
                    torch.as_strided(
                        flat[_key(r)], (pages, page_size * elems), (page_size * elems, 1), r.offset // w
                    )
                    for r in refs[layer * parts : (layer + 1) * parts]
                ]
                for layer in range(num_layers)
            ]
        return ShmDevicePool(n, page_size, wide, token_views, page_views, list(mappings.values()))
    except BaseException:
        for m in mappings.values():
            m.close()
        raise


def _key(r: pb.BufferRef) -> str:
    return f"fd:{r.fd.index}" if r.HasField("fd") else f"shm:{r.shm.name}"


def _check_access(refs: list[pb.BufferRef], access: ShmAccess) -> None:
    """The pool names only descriptors its caller sent, and named objects only where allowed."""
    if not access.fd_socket:
        raise FailedPrecondition(
            "shared-memory pools need the daemon's Unix socket (descriptors come over its fd "
            "socket); this daemon listens on TCP only"
        )
    named = any(r.HasField("shm") for r in refs)
    if named and not access.allow_named:
        raise PermissionDenied(
            "named shm objects (ShmLocation) are refused unless the daemon runs with "
            "--allow-named-shm; send the pool's memfd over the fd socket (FdLocation) instead"
        )
    if access.peer is None:
        raise InvalidArgument(
            "a shared-memory pool needs a peer_ticket from the daemon's fd socket (the gRPC socket's "
            "path + '.fd'): it carries the pool's descriptors and the caller's credentials"
        )
    for i, r in enumerate(refs):
        if r.HasField("fd") and r.fd.index >= len(access.fds):
            raise InvalidArgument(
                f"device_pool buffer {i} names fd {r.fd.index} but the peer ticket carries "
                f"{len(access.fds)} descriptor(s)"
            )


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
