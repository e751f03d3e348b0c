"""Page keys: the names of cached KV pages, stable across processes and machines.

Key i of a token sequence is a 16-byte BLAKE2b digest of key i-1 and the token ids of page i (as
little-endian int64), so a key names a page together with everything before it: two sequences
share the keys of their common whole-page prefix, and nothing after the first page that differs.
The chain starts from ``parent`` (the last key of an earlier part of the sequence) or else from a
root derived from ``salt`` (a LoRA adapter's name, a multimodal input's hash; empty by default).
Python's ``hash()`` is never used: it is seeded per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np
import torch

KEY_BYTES = 16
MAX_KEY_BYTES = 64
_ROOT_PERSON = b"kvserver-root"

Keys = bytes | bytearray | memoryview | Sequence[bytes]


def _root(salt: bytes) -> bytes:
    return blake2b(bytes(salt), digest_size=KEY_BYTES, person=_ROOT_PERSON).digest()


def _token_array(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, not of shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, not {arr.dtype}")
    return arr.astype("<i8", copy=False)


def page_keys(token_ids: Sequence[int] | np.ndarray | torch.Tensor, page_size: int, *, salt: bytes = b"",
              parent: bytes = b"") -> bytes:
    """The packed keys (``KEY_BYTES`` each) of the whole pages of ``token_ids``; a trailing partial
    page gets none. ``parent`` continues the chain of an earlier prefix (its last key) and then
    ``salt`` is not used: the parent's chain already carries its own."""
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, not {page_size}")
    tokens = _token_array(token_ids)
    pages = tokens.size // page_size
    data = memoryview(np.ascontiguousarray(tokens[: pages * page_size])).cast("B")
    step = page_size * 8
    prev = bytes(parent) if parent else _root(salt)
    out = []
    for i in range(pages):  # one digest per page; the tokens are hashed as one buffer slice
        h = blake2b(prev, digest_size=KEY_BYTES)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return b"".join(out)


def split_keys(keys: bytes, key_bytes: int = KEY_BYTES) -> list[bytes]:
    """Packed keys as a list of ``key_bytes``-long keys."""
    if not 1 <= key_bytes <= MAX_KEY_BYTES:
        raise ValueError(f"key_bytes must be in [1, {MAX_KEY_BYTES}], not {key_bytes}")
    if len(keys) % key_bytes:
        raise ValueError(f"{len(keys)} bytes of keys are not a whole number of {key_bytes}-byte keys")
    return np.frombuffer(keys, dtype=f"V{key_bytes}").tolist()


def pack_keys(keys: Keys, key_bytes: int = KEY_BYTES) -> tuple[bytes, int, int]:
    """(packed keys, key width, number of keys) of packed bytes or of a sequence of equal-length
    keys; a sequence's width is that of its keys. Raises ValueError for keys of unequal lengths
    or packed bytes that are not a whole number of keys."""
    if isinstance(keys, bytes | bytearray | memoryview):
        packed = bytes(keys)
        if key_bytes < 1 or len(packed) % key_bytes:
            raise ValueError(f"{len(packed)} bytes of keys are not a whole number of {key_bytes}-byte keys")
        return packed, key_bytes, len(packed) // key_bytes
    keys = list(keys)
    if not keys:
        return b"", key_bytes, 0
    width = len(keys[0])
    if any(len(k) != width for k in keys):
        raise ValueError(f"keys of one request must all be {width} bytes long, as the first one")
    return b"".join(keys), width, len(keys)
