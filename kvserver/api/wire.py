"""Large requests parsed in a worker thread, not on the event loop.

grpc.aio runs a method's request deserializer on the event loop. A Free, Write or Load naming
4 Mi indices is ~25 MB of protobuf, ~40-50 ms to parse on this project's 2-core VM: time in which
the loop serves no other engine. protobuf's parser does not hold the GIL meanwhile (a thread
parsing 4 Mi indices delays another thread by ~3 ms), so such a request's bytes are kept as they
came (``Unparsed``) and parsed by the handler in a worker thread (``parse_large``). The same
protobuf call parses it either way: what is malformed stays malformed, with the same error.
"""

from __future__ import annotations

from typing import Any

# Requests at least this long are parsed off the loop (FromString of 256 KiB costs ~0.5 ms).
LARGE_REQUEST_BYTES = 1 << 18


class Unparsed:
    """A large request's bytes, to be parsed in a worker thread (``parse_large``)."""

    __slots__ = ("message_cls", "data")

    def __init__(self, message_cls: Any, data: bytes) -> None:
        self.message_cls = message_cls
        self.data = data


def parse_large(request: Unparsed) -> Any:
    """``request`` parsed; raises protobuf's DecodeError where ``FromString`` does."""
    return request.message_cls.FromString(request.data)
