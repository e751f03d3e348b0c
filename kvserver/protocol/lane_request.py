"""The lane's binary Write and Load request, format 1 (torch-free: the client library imports it).

A fixed little-endian layout, exactly ``len`` bytes, every count bounded by that length before
anything past the header is read (``kvserver/lane/csrc/request.h`` is the compiled reader)::

    0  magic u32 = b"KVR1"   4 version u16 = 1   6 kind u16 (1 Write, 2 Load)   8 flags u32
    12 n_pages u32   16 n_dev u32   20 n_layers u32   24 timeout_ms u32   28 event_slot u32
    32 ready_len u32   36 reserved u32 = 0
    40 host page starts i64[n_pages], device entries i64[n_dev], layer ids u32[n_layers], ready_event

Host indices travel as pages: each entry is the host index of a page's token 0, the page's
``page_size`` tokens following it (host indices always name whole pages). With ``DEV_RUNS`` each
device entry is likewise the first of ``page_size`` consecutive device tokens; without it, each
is one device token. It carries what ``WriteRequest`` and ``LoadRequest`` carry but the client id
(a lane belongs to one registration), in 16 bytes a page where device pages are runs: a slot's
64 KiB hold 4 Ki pages. Indices that are not whole pages are sent as protobuf requests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvserver.protocol import compiled

MAGIC = b"KVR1"
VERSION = 1
KIND_WRITE, KIND_LOAD = 1, 2
DEV_RUNS = 1
HEADER = struct.Struct("<4sHHIIIIIIII")  # 40 bytes
_I64 = np.dtype("<i8")
_U32 = np.dtype("<u4")
_SLOT_MASK = (1 << 36) - 1  # kvserver.core.epochs: the token slot under the epoch bits

# The compiled pack (csrc/wire.c); None where not built or built from other sources: pack() below,
# in numpy.
_wire = compiled.extension("kvserver.protocol._wire")


@dataclass(frozen=True, slots=True)
class LaneRequest:
    """A parsed request, with the attributes of the protobuf request the daemon's code reads."""

    client_id: str
    host_indices: np.ndarray
    device_indices: np.ndarray
    layers: list[int]
    timeout_ms: int
    event_slot: int
    ready_event: bytes


def pack(kind: int, host: np.ndarray, device: np.ndarray, layers: list[int], page_size: int,
         timeout_ms: int = 0, event_slot: int = 0, ready_event: bytes = b"") -> bytes | None:
    """The request's bytes; None when ``host`` (int64) is not whole pages of ``page_size`` tokens
    in order (the protobuf request carries it, and the daemon says what is wrong)."""
    n = host.size
    if n == 0 or n % page_size or len(layers) and (min(layers) < 0 or max(layers) >= 1 << 32):
        return None
    if page_size == 1:
        starts, flags, dev = host, DEV_RUNS, device
    else:
        rows = host.reshape(-1, page_size)
        starts = rows[:, 0]
        if ((starts & _SLOT_MASK) % page_size).any():
            return None
        if n > 1 and (np.diff(rows, axis=1) != 1).any():
            return None
        flags, dev = 0, device
        if device.size == n:
            drows = device.reshape(-1, page_size)
            if not (np.diff(drows, axis=1) != 1).any():
                flags, dev = DEV_RUNS, drows[:, 0]
    head = HEADER.pack(MAGIC, VERSION, kind, flags, starts.size, dev.size, len(layers), timeout_ms,
                       event_slot, len(ready_event), 0)
    return b"".join((head, starts.astype(_I64, copy=False).tobytes(), dev.astype(_I64, copy=False).tobytes(),
                     np.asarray(layers, dtype=_U32).tobytes(), bytes(ready_event)))


def pack_at(kind: int, host: tuple, device: tuple, layers: list[int], page_size: int, timeout_ms: int = 0,
            event_slot: int = 0, ready_event: bytes = b"") -> bytes | None:
    """``pack`` for index sources ``(owner, address, count)`` of contiguous int64 memory (see
    ``index_source``), in compiled code where it is built."""
    if _wire is not None:
        return _wire.pack(kind, host[1], host[2], device[1], device[2], layers, page_size, timeout_ms,
                          event_slot, ready_event)
    return pack(kind, _as_array(host), _as_array(device), layers, page_size, timeout_ms, event_slot,
                ready_event)


def index_source(values: np.ndarray) -> tuple:
    """(owner, address, count) of a flat int64 numpy array (made contiguous): what ``pack_at``
    reads; the owner keeps the memory alive."""
    arr = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    return arr, arr.ctypes.data, arr.size


def _as_array(source: tuple) -> np.ndarray:
    owner = source[0]
    return owner if isinstance(owner, np.ndarray) else owner.numpy()


def _header(data: bytes, kind: int) -> tuple:
    """The header's fields, checked against ``kind`` and the request's length; raises ValueError
    (a malformed request) naming what is wrong."""
    if len(data) < HEADER.size:
        raise ValueError(f"a {len(data)}-byte lane request is shorter than its {HEADER.size}-byte header")
    fields = HEADER.unpack_from(data)
    magic, version, got, flags, n_pages, n_dev, n_layers, _, _, ready_len, reserved = fields
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"magic {magic!r} version {version}; expected {MAGIC!r} version {VERSION}")
    if got != kind:
        raise ValueError(f"a request of kind {got} sent as kind {kind}")
    if flags & ~DEV_RUNS or reserved:
        raise ValueError(f"unknown flags {flags:#x} or reserved word {reserved:#x}")
    need = HEADER.size + 8 * n_pages + 8 * n_dev + 4 * n_layers + ready_len
    if need != len(data):
        raise ValueError(f"its counts take {need} bytes; {len(data)} were sent")
    return fields


def expanded_size(data: bytes, kind: int, page_size: int) -> int:
    """How many indices the larger of the request's two lists names once expanded (a page's
    start stands for ``page_size`` of them), read from its header alone: what the daemon bounds
    before ``parse`` makes them. Raises ValueError as ``parse`` does."""
    _, _, _, flags, n_pages, n_dev, *_ = _header(data, kind)
    return max(n_pages * page_size, n_dev * page_size if flags & DEV_RUNS else n_dev)


def parse(data: bytes, kind: int, client_id: str, page_size: int) -> LaneRequest:
    """The request in ``data``, indices expanded; raises ValueError (a malformed request) naming
    what is wrong. The caller bounds ``expanded_size`` first: a slot's bytes can name 16 M."""
    (_, _, _, flags, n_pages, n_dev, n_layers, timeout_ms, event_slot, ready_len,
     _) = _header(data, kind)
    at = HEADER.size
    starts = np.frombuffer(data, dtype=_I64, count=n_pages, offset=at).astype(np.int64)
    at += 8 * n_pages
    dev = np.frombuffer(data, dtype=_I64, count=n_dev, offset=at).astype(np.int64)
    at += 8 * n_dev
    layers = np.frombuffer(data, dtype=_U32, count=n_layers, offset=at).tolist()
    at += 4 * n_layers
    steps = np.arange(page_size, dtype=np.int64)
    with np.errstate(over="ignore"):  # a start near 2^63 wraps, as its page's indices would: refused later
        host = (starts[:, None] + steps).reshape(-1)
        if flags & DEV_RUNS:
            dev = (dev[:, None] + steps).reshape(-1)
    return LaneRequest(client_id, host, dev, layers, timeout_ms, event_slot, bytes(data[at:at + ready_len]))
