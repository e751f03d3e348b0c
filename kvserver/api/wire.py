"""Large requests read without protobuf's parse holding the event loop.

grpc.aio runs a method's request deserializer on the event loop, and protobuf's parser holds the
GIL for the whole parse, in a worker thread too: measured on this project's 2-core VM, a loop
timer ran as late as the parse took, ~55 ms for a Free of 4 Mi indices (25 MB) and ~0.6 s for a
62 MiB RegisterRequest of six million buffer references, which any peer could send while the
daemon took messages of up to 64 MiB (it now takes up to the largest valid request, 16 MiB at
its defaults: kvserver/api/message_size.py).

So a request of ``LARGE_REQUEST_BYTES`` or more, of any method, is kept as it came (``Unparsed``)
and read by its handler through ``parse_off_loop``, on threads of its own (a peer that sends many
holds only those, and at most ``MOST_PENDING`` wait at once). The reading never gives protobuf more
than a bounded part:

- its fields are walked in Python (which yields the GIL every few milliseconds), at most
  ``MOST_FIELDS`` of them, tags and lengths read as protobuf reads them; a group (proto3 has
  none) is refused;
- its top-level ``repeated int64`` lists (indices, device pages), packed as every protobuf encoder
  sends them, are decoded in C without the GIL (``_packed``, 26-30 ms for 4 Mi values), or where
  that is not built with numpy, whose array operations release it; an element sent unpacked is
  one more field;
- its top-level ``bytes`` fields (a Put's keys) are taken out and copied once; ``bytes`` inside a
  sub-message without sub-messages of its own (a Get's parts, walked too) cost protobuf a copy;
- everything else (strings, which protobuf checks as UTF-8, numbers, other lists, sub-messages:
  a top-level one without sub-messages of its own counted ``MESSAGE_COST`` bytes more, others by
  their bytes) may take at most ``MOST_OTHER_BYTES``: a request with more is refused
  (RESOURCE_EXHAUSTED) before protobuf sees it;
- the message less its index lists and top-level bytes is then parsed by protobuf, which decides
  what is malformed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from kvserver.errors import InvalidArgument, NoCapacity
from kvserver.protocol import compiled

# The packed lists' decoder in C (csrc/varint.h), without the GIL; None where not built (no
# compiler) or built from other sources: numpy's array operations, slower.
_compiled = compiled.extension("kvserver.api._packed")

# Requests at least this long are read off the loop (FromString of 256 KiB of indices: ~0.5 ms).
LARGE_REQUEST_BYTES = 1 << 18
MOST_FIELDS = 1 << 16  # fields of one large request walked (a Python step each), sub-messages' too
MOST_OTHER_BYTES = 1 << 20  # what protobuf parses beyond index lists and bytes: ~10 ms at most
# (62 MiB of buffer references took 0.6 s)
MESSAGE_COST = 64  # what each sub-message walked counts against MOST_OTHER_BYTES (its object)
MOST_PENDING = 8  # large requests read or waiting to be read at once; more: RESOURCE_EXHAUSTED
PARSE_THREADS = 2

_VARINT, _I64, _LEN, _GROUP, _I32 = 0, 1, 2, 3, 5

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_pending = 0  # on the loop only


class Unparsed:
    """A large request's bytes, to be read in a worker thread (``parse_off_loop``)."""

    __slots__ = ("message_cls", "data")

    def __init__(self, message_cls: Any, data: bytes) -> None:
        self.message_cls = message_cls
        self.data = data


class IndexList(np.ndarray):
    """An int64 index list read from the wire; true when not empty, as a repeated field is."""

    def __bool__(self) -> bool:
        if self.ndim == 0:  # a reduction's result (``(a < 0).any()``) is a 0-d IndexList
            return bool(self.item())
        return self.size > 0


class Indexed:
    """A parsed request whose int64 index lists are ``IndexList`` arrays and whose bytes fields
    were read once: its other fields are read from the message (as ``lane_request.LaneRequest``
    stands for a request)."""

    def __init__(self, message: Any, fields: dict[str, Any]) -> None:
        self._message = message
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)


class _Shape:
    """What the reader needs of a message type: its fields by kind."""

    def __init__(self, descriptor: Any, top: bool = True) -> None:
        self.index: dict[int, str] = {}  # repeated int64, top level: decoded in C
        self.blobs: dict[int, str] = {}  # singular bytes, top level: taken out, read once
        self.copied: set[int] = set()  # other bytes fields: copies, not parsed
        self.flat: dict[int, _Shape] = {}  # sub-messages without sub-messages: walked
        self.nested = False  # has message-typed fields
        for f in descriptor.fields:
            if top and f.type == f.TYPE_INT64 and _repeated(f):
                self.index[f.number] = f.name
            elif top and f.type == f.TYPE_BYTES and not _repeated(f) and f.containing_oneof is None:
                self.blobs[f.number] = f.name  # (a oneof's member stays protobuf's: it clears others)
            elif f.type == f.TYPE_BYTES:
                self.copied.add(f.number)
            elif f.type == f.TYPE_MESSAGE:
                self.nested = True
                if top:
                    inner = _Shape(f.message_type, top=False)
                    if not inner.nested:
                        self.flat[f.number] = inner


_shapes: dict[Any, _Shape] = {}


def _repeated(field: Any) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6.31, where ``label`` is deprecated
        return bool(field.is_repeated)
    return field.label == field.LABEL_REPEATED


def _varint(data: bytes, at: int, most: int = 10) -> tuple[int, int]:
    """The varint at ``at`` (at most ``most`` bytes: protobuf takes tags and lengths of five) and
    the offset past it."""
    value = shift = 0
    for i in range(at, min(at + most, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise DecodeError("a varint is cut short or longer than protobuf takes")


class _Walk:
    """One request's walk: fields seen and bytes protobuf will parse, against their bounds."""

    def __init__(self, cls: Any, size: int) -> None:
        self.cls, self.size = cls, size
        self.fields = self.other = 0

    def field(self) -> None:
        self.fields += 1
        if self.fields > MOST_FIELDS:
            raise InvalidArgument(
                f"a request of {self.size} bytes with more than {MOST_FIELDS} fields: protobuf's "
                "encoders send lists of numbers packed")

    def parsed(self, n: int) -> None:
        self.other += n
        if self.other > MOST_OTHER_BYTES:
            raise NoCapacity(
                f"a {self.cls.DESCRIPTOR.name} of {self.size} bytes whose fields other than its index "
                f"lists and bytes take more than {MOST_OTHER_BYTES} bytes to parse: split it")

    def next(self, data: bytes, at: int, end: int) -> tuple[int, int, int, int]:
        """The field at ``at``: (number, wire type, its payload's start, the offset past it)."""
        self.field()
        tag, at = _varint(data, at, 5)
        number, kind = tag >> 3, tag & 7
        if kind == _VARINT:
            _, past = _varint(data, at)
        elif kind in (_I64, _I32):
            past = at + (8 if kind == _I64 else 4)
        elif kind == _LEN:
            size, at = _varint(data, at, 5)
            past = at + size
        elif kind == _GROUP:  # proto3 has none, and no encoder of ours sends one
            raise InvalidArgument(f"a request of {self.size} bytes with a group (field {number}): "
                                  "a large request's fields are proto3's")
        else:
            raise DecodeError(f"field {number} has wire type {kind}")
        if past > end:
            raise DecodeError(f"field {number} runs past the end of its message")
        return number, kind, at, past

    def flat(self, data: bytes, at: int, end: int, shape: _Shape) -> None:
        """Counts a flat sub-message: its bytes fields are copies, the rest is parsed."""
        self.parsed(MESSAGE_COST)
        while at < end:
            start = at
            number, kind, body, at = self.next(data, at, end)
            if kind == _LEN and number in shape.copied:
                self.parsed(body - start)
            else:
                self.parsed(at - start)


def parse_large(request: Unparsed) -> Any:
    """``request`` read as described above: an ``Indexed`` request. Raises DecodeError where the
    bytes are not a valid message, InvalidArgument or NoCapacity where they are one this reader
    refuses."""
    cls, data = request.message_cls, request.data
    shape = _shapes.get(cls)
    if shape is None:
        shape = _shapes[cls] = _Shape(cls.DESCRIPTOR)
    walk = _Walk(cls, len(data))
    view = memoryview(data)
    rest: list[memoryview] = []
    lists: dict[str, list] = {name: [] for name in shape.index.values()}
    blobs: dict[str, memoryview] = {}
    at = 0
    while at < len(data):
        start = at
        number, kind, body, at = walk.next(data, at, len(data))
        if number in shape.index and kind == _VARINT:  # one element of a list sent unpacked
            value, _ = _varint(data, body)
            lists[shape.index[number]].append(
                np.array([value & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64).view(np.int64))
            continue
        if kind == _LEN and number in shape.index:
            lists[shape.index[number]].append(_packed(view[body:at]))
            continue
        if kind == _LEN and number in shape.blobs:
            blobs[shape.blobs[number]] = view[body:at]  # the last one counts, as in protobuf
            continue
        if kind == _LEN and number in shape.flat:
            walk.flat(data, body, at, shape.flat[number])
        elif kind == _LEN and number in shape.copied:
            walk.parsed(body - start)
        else:
            walk.parsed(at - start)
        rest.append(view[start:at])
    message = cls.FromString(b"".join(rest))
    fields: dict[str, Any] = {name: _joined(parts) for name, parts in lists.items()}
    for name in shape.blobs.values():
        fields[name] = bytes(blobs[name]) if name in blobs else getattr(message, name)
    return Indexed(message, fields)


def _joined(parts: list) -> IndexList:
    if not parts:
        return np.empty(0, dtype=np.int64).view(IndexList)
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)).view(IndexList)


# Masks of a word's first k bytes, and the three steps that press a word's 7-bit groups together:
# pairs of bytes into 14 bits, pairs of those into 28, pairs of those into 56.
_KEEP = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)
_PRESS = [(np.uint64(keep), np.uint64(high), np.uint64(by)) for keep, high, by in (
    (0x007F007F007F007F, 0x7F007F007F007F00, 1),
    (0x00003FFF00003FFF, 0x3FFF00003FFF0000, 2),
    (0x000000000FFFFFFF, 0x0FFFFFFF00000000, 4),
)]


def _packed(payload: memoryview) -> np.ndarray:
    """The int64 values of a packed varint payload, as protobuf reads them."""
    if _compiled is None:
        return _packed_numpy(payload)
    out = np.empty(_compiled.count(payload), dtype=np.int64)
    try:
        got = _compiled.decode(payload, out)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    return out[:got]


def _packed_numpy(payload: memoryview) -> np.ndarray:
    """``_packed`` with numpy."""
    b = np.frombuffer(payload, dtype=np.uint8)
    if b.size == 0:
        return np.empty(0, dtype=np.int64)
    last = b < 0x80
    if not last[-1]:
        raise DecodeError("a packed list ends inside a varint")
    ends = np.flatnonzero(last)
    del last
    n = ends.size
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    lengths = np.subtract(ends, starts, out=ends)
    lengths += 1
    longest = int(lengths.max())
    if longest > 10:
        raise DecodeError("a varint of a packed list is longer than ten bytes")
    # Each varint read as the eight bytes from its start (a little-endian word), the bytes past
    # its end masked off, and its 7-bit groups pressed together.
    padded = np.zeros(b.size + 8, dtype=np.uint8)
    padded[: b.size] = b
    words = np.ndarray((b.size,), dtype="<u8", buffer=padded, strides=(1,))
    x = words[starts]
    x &= _KEEP[np.minimum(lengths, 8)]
    x &= np.uint64(0x7F7F7F7F7F7F7F7F)
    t = np.empty_like(x)
    for keep, high, by in _PRESS:
        np.bitwise_and(x, high, out=t)
        t >>= by
        x &= keep
        x |= t
    if longest > 8:  # values of 2^56 and up: bits 56-62 in byte 8, bit 63 in byte 9
        long = np.flatnonzero(lengths > 8)
        x[long] |= (padded[starts[long] + 8].astype(np.uint64) & np.uint64(0x7F)) << np.uint64(56)
        ten = long[lengths[long] == 10]
        x[ten] |= (padded[starts[ten] + 9].astype(np.uint64) & np.uint64(1)) << np.uint64(63)
    return x.view(np.int64)


async def parse_off_loop(request: Unparsed) -> Any:
    """``parse_large(request)`` on the parse threads; NoCapacity if ``MOST_PENDING`` large
    requests are being read already (each holds up to the largest message the daemon takes)."""
    # The module's parse_large, looked up now (a test may wrap it).
    return await off_loop(parse_large, request)


async def off_loop(read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, the reading of one large request, on the parse threads; NoCapacity if
    ``MOST_PENDING`` large requests are being read already."""
    global _executor, _pending
    if _pending >= MOST_PENDING:
        raise NoCapacity(f"{_pending} large requests are being read; send this one again later")
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kvserver-parse")
    _pending += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_executor, read, *args)
    finally:
        _pending -= 1
