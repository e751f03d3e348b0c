"""CUDA IPC handles and device identities (UUID, PCI bus id) as they arrive on the wire, checked
without a GPU: the client builds them with these functions and the daemon checks them with the same.

An engine exports each KV buffer as the IPC handle of the cudaMalloc allocation that contains it,
plus the buffer's byte offset inside that allocation (PyTorch's caching allocator hands out
blocks carved from larger segments), and the device's UUID: ordinals differ between processes
with different CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import re

from kvserver.errors import InvalidArgument

IPC_HANDLE_BYTES = 64
# torch >= 2.5 prefixes its handles with a version byte and a kind byte: b"c" for cudaMalloc memory
# (the 64-byte cudaIpcMemHandle_t follows), b"e" for expandable segments. The version is 2 up to
# torch 2.12 (1 in allocators forked from earlier releases) and 3 from 2.13; the b"c" payload is
# the same in all of them.
TORCH_HANDLE_VERSIONS = frozenset({1, 2, 3})
EXPANDABLE_HINT = (
    "the KV pool was allocated from PyTorch expandable segments (VMM memory), which has no CUDA IPC "
    "handle: allocate the pool with expandable segments off, e.g. "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or "
    "torch.cuda.memory._set_allocator_settings('expandable_segments:False') around the allocation"
)
_UUID = re.compile(r"(?:GPU-)?([0-9a-fA-F]{8})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?"
                   r"([0-9a-fA-F]{12})")
_PCI = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


def raw_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside a raw or torch-prefixed handle."""
    if len(handle) == IPC_HANDLE_BYTES:
        return handle
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise InvalidArgument(EXPANDABLE_HINT)
    if len(handle) == IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        if handle[0] not in TORCH_HANDLE_VERSIONS:
            raise InvalidArgument(
                f"ipc_handle has torch handle version {handle[0]}, which this daemon does not know: "
                f"send the raw 64-byte cudaIpcMemHandle_t (versions {sorted(TORCH_HANDLE_VERSIONS)} "
                "are read)"
            )
        return handle[2:]
    raise InvalidArgument(
        f"ipc_handle must be a 64-byte cudaIpcMemHandle_t (or torch's 66-byte form), got {len(handle)} bytes"
    )


def normalize_uuid(text: str) -> str:
    """'GPU-1a2b3c4d-...' in any of its spellings (with or without 'GPU-' and dashes), lowercased."""
    m = _UUID.fullmatch(text.strip())
    if not m:
        raise InvalidArgument(f"device_uuid {text[:80]!r} is not a GPU UUID like GPU-xxxxxxxx-xxxx-xxxx-xxxx-"
                              "xxxxxxxxxxxx")
    return "GPU-" + "-".join(g.lower() for g in m.groups())


def uuid_from_bytes(raw: bytes) -> str:
    """A cudaUUID_t's 16 bytes as 'GPU-...' (what nvidia-smi and torch print)."""
    h = raw.hex()
    return normalize_uuid(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")


def check_span(offset: int, token_stride: int, num_tokens: int, token_bytes: int, allocation_size: int,
               what: str, real_size: int | None = None) -> None:
    """The buffer's last token must end inside the allocation the handle opens: inside the size
    the client declares and, once the allocation is open, inside its real size (``real_size``,
    from the driver), whichever is smaller."""
    if token_stride < token_bytes:
        raise InvalidArgument(
            f"{what}: token_stride {token_stride} is smaller than one token ({token_bytes} B)"
        )
    end = offset + (num_tokens - 1) * token_stride + token_bytes
    if real_size is not None and end > real_size:
        raise InvalidArgument(
            f"{what}: buffer at offset {offset} with token_stride {token_stride} needs {end} bytes for "
            f"{num_tokens} tokens, but the allocation the handle opens is {real_size} bytes "
            f"(allocation_size {allocation_size} was declared)"
        )
    if end > allocation_size:
        raise InvalidArgument(
            f"{what}: buffer at offset {offset} with token_stride {token_stride} needs {end} bytes for "
            f"{num_tokens} tokens, but the allocation is {allocation_size} bytes"
        )


def normalize_pci_bus_id(text: str) -> str:
    """'0000:3B:00.0' (domain:bus:device.function) lowercased, domain as 8 hex digits as CUDA
    prints it; empty stays empty."""
    if not text:
        return ""
    m = _PCI.fullmatch(text.strip())
    if not m:
        raise InvalidArgument(f"pci_bus_id {text[:40]!r} is not a PCI bus id like 0000:3b:00.0")
    domain, bus, device, function = m.groups()
    return f"{int(domain, 16):08x}:{bus.lower()}:{device.lower()}.{function}"
