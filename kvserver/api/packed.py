"""Protobuf wire bytes of large index lists, encoded with numpy instead of per-value Python.

Building a protobuf message from 4 Mi host indices costs ~1 s on this project's 2-core VM
(``tolist`` ~0.4 s, the message ~0.6 s, serialising ~0.4 s), all of it holding the GIL. Encoding the
same bytes with array operations takes tens of milliseconds and releases the GIL in between, so
it can run in a worker thread while the event loop serves other engines.
"""

from __future__ import annotations

import numpy as np

_LEN = 2  # wire type of length-delimited fields, packed repeated scalars included


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length(n: int) -> int:
    return max(1, -(-n.bit_length() // 7))


def packed_int64(field_number: int, values: np.ndarray) -> bytes:
    """The wire bytes of a message whose one set field is ``repeated int64 field_number``
    holding ``values``: what ``SerializeToString`` gives for it."""
    if values.size == 0:
        return b""
    v = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)  # negatives: 10 bytes, as protobuf
    shortest, longest = _length(int(v.min())), _length(int(v.max()))
    if shortest == longest:  # one epoch's host indices always are: epoch << 36 | slot
        # Byte k of every varint in row k: the low 8 bits of v >> 7k, whose top bit is then the
        # "more bytes follow" flag (set in all but the last byte, where it is already zero).
        groups = np.empty((longest, v.size), dtype=np.uint8)
        for k in range(longest):
            np.right_shift(v, np.uint64(7 * k), out=groups[k], casting="unsafe")
            if k < longest - 1:
                np.bitwise_or(groups[k], np.uint8(0x80), out=groups[k])
        payload = groups.T.tobytes()
    else:
        lengths = np.ones(v.size, dtype=np.int64)
        for k in range(1, 10):
            lengths += v >= np.uint64(1 << (7 * k))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        out = np.empty(int(ends[-1]), dtype=np.uint8)
        for k in range(int(lengths.max())):
            has = lengths > k
            group = (v[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
            more = lengths[has] > k + 1
            out[starts[has] + k] = group | (more.astype(np.uint64) << np.uint64(7))
        payload = out.tobytes()
    return _varint(field_number << 3 | _LEN) + _varint(len(payload)) + payload
