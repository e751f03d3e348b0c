"""An engine's CUDA KV buffers described for the daemon: IPC handle of each buffer's allocation,
the buffer's byte offset inside it, token stride, and the device's UUID.

Nothing here needs a GPU until ``CudaKVPool`` is built from real CUDA tensors; the conversion
itself (``buffer_ref``) is plain data and is tested on CPU.
"""

from __future__ import annotations

import torch

from kvserver.errors import InvalidArgument
from kvserver.protocol.cuda_ipc import normalize_pci_bus_id, normalize_uuid, raw_ipc_handle
from kvserver.protocol.layout import KVLayout
from kvserver.v1 import kvserver_pb2 as pb


def buffer_ref(share: tuple, tensor_offset_bytes: int, token_stride: int, device_uuid: str,
               pci_bus_id: str = "", *, block_tokens: int = 0, block_stride: int = 0,
               head_stride: int = 0) -> pb.BufferRef:
    """A BufferRef from ``storage._share_cuda_()``'s tuple (device, handle, storage size, storage
    offset in its allocation, ...) plus the tensor's own offset inside its storage. The handle
    goes as the raw 64-byte cudaIpcMemHandle_t, whatever torch's prefix version. ``block_tokens``,
    ``block_stride`` and ``head_stride`` describe vLLM's blocked and HND layouts (docs/layouts.md);
    their defaults are plain token rows.

    Raises ValueError for memory without a legacy IPC handle (expandable segments)."""
    _device, handle, storage_size, storage_offset = share[:4]
    try:
        raw = raw_ipc_handle(bytes(handle))
        pci = normalize_pci_bus_id(pci_bus_id)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return pb.BufferRef(
        cuda=pb.CudaIpcLocation(
            ipc_handle=raw,
            device_uuid=normalize_uuid(device_uuid),
            # The daemon may touch the storage and nothing past it.
            allocation_size=storage_offset + storage_size,
            pci_bus_id=pci,
        ),
        offset=storage_offset + tensor_offset_bytes,
        token_stride=token_stride,
        block_tokens=block_tokens,
        block_stride=block_stride,
        head_stride=head_stride,
    )


def device_identity(device: torch.device) -> tuple[str, str]:
    """(UUID, PCI bus id) of a CUDA device, as the daemon finds it whatever its ordinals."""
    props = torch.cuda.get_device_properties(device)
    pci = ""
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return str(props.uuid), pci


class CudaKVPool:
    """Per layer, K and V (MHA) or the latent (MLA): CUDA tensors of [num_tokens, heads, head_dim].

    The engine keeps these tensors alive while registered: the daemon maps their memory.

    Exporting a buffer (``storage._share_cuda_()``) sets torch's IPC reference counter for its
    block to 1, and torch keeps a freed block whose counter is above 0 out of reuse ("limbo"),
    waiting for a torch consumer to release it. The daemon is not a torch consumer, so the pool
    releases those counters itself (``release_exports``) once no daemon maps the memory: the
    clients do it after a confirmed ``unregister``. Until then, pool memory the engine frees stays
    out of reuse, which is the safe side: the daemon may still copy into it.
    """

    def __init__(self, layout: KVLayout, dtype: torch.dtype, buffers: list[list[torch.Tensor]]) -> None:
        if not buffers or any(len(parts) != layout.num_parts for parts in buffers):
            raise ValueError(f"each layer needs {layout.num_parts} buffer(s) for this layout")
        num_tokens = buffers[0][0].shape[0]
        for parts in buffers:
            for t in parts:
                if not t.is_cuda or t.dtype != dtype or t.shape[0] != num_tokens:
                    raise ValueError("buffers must be CUDA tensors of one dtype and one token count")
                if t[0].numel() * t.element_size() != layout.token_bytes(dtype) or not t[0].is_contiguous():
                    raise ValueError(f"each token must be {layout.token_shape} contiguous values")
        self.layout = layout
        self.dtype = dtype
        self.buffers = buffers
        self.num_layers = len(buffers)
        self.num_tokens = num_tokens
        self._exports: list[tuple[bytes, int]] = []  # torch IPC reference counters (file, offset)

    def descriptor(self) -> pb.DevicePool:
        refs = []
        for parts in self.buffers:
            layer = pb.LayerBuffers()
            for t in parts:
                uuid, pci = device_identity(t.device)
                share = t.untyped_storage()._share_cuda_()
                self._exports.append((share[4], share[5]))
                layer.parts.append(buffer_ref(
                    share,
                    t.storage_offset() * t.element_size(),
                    t.stride(0) * t.element_size(),
                    uuid,
                    pci,
                ))
            refs.append(layer)
        return pb.DevicePool(num_tokens=self.num_tokens, layers=refs)

    def release_exports(self) -> int:
        """Drops torch's IPC reference counts taken by ``descriptor`` (once no daemon maps the
        pool), so memory the engine frees goes back to its allocator; returns how many."""
        exports, self._exports = self._exports, []
        for ref_counter, offset in exports:
            torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, offset)
        if exports:
            torch.cuda.ipc_collect()  # blocks already freed and held back return now
        return len(exports)
