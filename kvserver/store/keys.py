"""Cache keys: splitting a packed key field, and mapping keys to page ids at C speed.

Primitives: ``split_keys`` (packed bytes -> list of keys), ``page_ids`` (a part's key index ->
int64 page ids, -1 for a key it does not hold) and ``leading`` (length of a mask's leading run).
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from kvserver.errors import InvalidArgument, NoCapacity

MAX_KEY_BYTES = 64


def split_keys(packed: bytes, key_bytes: int, max_keys: int) -> list[bytes]:
    """The keys packed in ``packed``, ``key_bytes`` bytes each, in order."""
    if not 1 <= key_bytes <= MAX_KEY_BYTES:
        raise InvalidArgument(f"key_bytes must be between 1 and {MAX_KEY_BYTES}, got {key_bytes}")
    if len(packed) % key_bytes:
        raise InvalidArgument(
            f"keys are {len(packed)} bytes, not a whole number of {key_bytes}-byte keys"
        )
    n = len(packed) // key_bytes
    if n > max_keys:
        raise NoCapacity(f"{n} keys in one request; at most {max_keys} are allowed")
    return np.frombuffer(packed, dtype=f"V{key_bytes}").tolist()


def page_ids(index: dict[bytes, int], keys: list[bytes]) -> np.ndarray:
    """Page id of each key in ``index`` (int64), -1 where the index does not hold it."""
    return np.fromiter(map(index.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))


def leading(mask: np.ndarray) -> int:
    """How many leading entries of a boolean mask are true."""
    if mask.all():
        return len(mask)
    return int(mask.argmin())
