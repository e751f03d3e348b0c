"""The names of the node-wide cache's pages in the cluster store.

A page is one part of one space (``kvserver.store.spaces``) under one key; every daemon of the
cluster must name it alike, and no two different pages alike. A name is
``kvs2/<tenant>/<part digest>/<key>``: the tenant as written (escaped), so that an operator can
list and remove a tenant's objects; a 128-bit BLAKE2b digest of the part's full description (the
space's fields, the weights' identity among them, the TP shard, PP stage, layer range and page
bytes, in one canonical JSON form); and the key as the index keeps it: up to 32 bytes in hex, a
wider key as its 16-byte digest, marked by its length. The names are built in the worker thread
that makes the call, never on the event loop.

Primitives: ``part_prefix`` and ``names``.
"""

from __future__ import annotations

from hashlib import blake2b
from urllib.parse import quote

import numpy as np

from kvserver.store import Keys, Part
from kvserver.store.keep import part_record
from kvserver.store.keys import DIGEST_BYTES, WORD_BYTES

VERSION = "kvs2"  # a new layout of names (or of a page's bytes) takes a new version (2: keys
# of 17 to 32 bytes named by their bytes, not their digest)


def part_prefix(part: Part) -> str:
    """``kvs2/<tenant>/<part digest>/``: what every page name of ``part`` starts with."""
    digest = blake2b(part_record(part).encode(), digest_size=16, person=b"kvserver-part").hexdigest()
    return f"{VERSION}/{quote(part.space.key.tenant, safe='')}/{digest}/"


def names(prefix: str, keys: Keys) -> list[str]:
    """The cluster names of ``keys`` of the part whose prefix is ``prefix``."""
    raw = keys.words.view(np.uint8).reshape(len(keys), WORD_BYTES)
    return [prefix + (row[:n].tobytes().hex() if n <= WORD_BYTES
                      else f"{row[:DIGEST_BYTES].tobytes().hex()}.{n}")
            for row, n in zip(raw, keys.lens.tolist(), strict=True)]
