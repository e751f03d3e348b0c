"""The most gRPC reads of one request: what the largest valid request needs, and no more.

grpc.aio takes a request message in from its transport on the event loop's thread, outside any
code of the daemon's: about 1.1 ms a MiB on this project's 2-core VM with the machine otherwise
idle, several times that on cores shared with busy peers (docs/performance.md, "A request's
bytes, read on the loop"). Every engine's call waits meanwhile, so the cap is the largest request
a valid engine sends under the daemon's own limits, not a round number: a message over it is
refused by gRPC's transport (RESOURCE_EXHAUSTED), which reads it off the loop.
"""

from __future__ import annotations

from kvserver.core.cache_ops import MAX_CACHE_KEYS
from kvserver.store.keys import MAX_KEY_BYTES

# A Write or Load of n indices: a host index carries its registration's epoch above bit 36 (at
# most 9 bytes as a varint), a device slot is below 2^40 (the most tokens a pool has: 6 bytes).
BYTES_PER_INDEX = 9 + 6
# A Put, Get or Lookup of the most keys: each key and its device page (at most 10 bytes).
BYTES_PER_KEY = MAX_KEY_BYTES + 10
# Everything else a valid request holds (ids, layer lists, events, a Register's buffers).
REST_BYTES = 1 << 20
# Answers are the daemon's own, built off the loop where large: their cap stays where it was.
SEND_BYTES = 64 << 20


def request_message_bytes(max_request_indices: int) -> int:
    """The largest valid request under ``--max-request-indices``: 16 MiB at its default (1 Mi)."""
    keys = min(MAX_CACHE_KEYS, max_request_indices)
    return max(BYTES_PER_INDEX * max_request_indices, BYTES_PER_KEY * keys) + REST_BYTES
