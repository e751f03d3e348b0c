"""Domain errors raised by the daemon (and by the shared protocol checks), each with its status code.

The codes are the canonical RPC status codes, by the numbers gRPC uses; ``kvserver.api.status``
turns them into ``grpc.StatusCode`` and the fast lane and the fd socket send them as they are. This
module imports no gRPC, so that every layer (the cache index included) may raise these.
"""

from __future__ import annotations

import errno
from enum import IntEnum


class Code(IntEnum):
    """The canonical status codes (google.rpc.Code): ``grpc.StatusCode``'s names and numbers."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class KVError(Exception):
    """Base of every error the daemon reports to a caller."""

    code: Code = Code.INTERNAL


class InvalidArgument(KVError):
    code = Code.INVALID_ARGUMENT


class NotFound(KVError):
    code = Code.NOT_FOUND


class UnknownClient(NotFound):
    pass


class OutOfRange(KVError):
    code = Code.OUT_OF_RANGE


class LayerOutOfRange(OutOfRange):
    pass


class FailedPrecondition(KVError):
    code = Code.FAILED_PRECONDITION


class NoCapacity(KVError):
    code = Code.RESOURCE_EXHAUSTED


class PermissionDenied(KVError):
    code = Code.PERMISSION_DENIED


class Unauthenticated(KVError):
    code = Code.UNAUTHENTICATED


class Unimplemented(KVError):
    code = Code.UNIMPLEMENTED


class Unavailable(KVError):
    """The daemon cannot take the call now (it is stopping)."""

    code = Code.UNAVAILABLE


class DeadlineExceeded(KVError):
    """A call past its own ``timeout_ms`` (not a copy's: ``JobStopped``)."""

    code = Code.DEADLINE_EXCEEDED


class JobStopped(KVError):
    """A copy stopped at a layer boundary before its last layer: nothing more of it is copied.
    Its code says why: its deadline passed, its call ended, or its client was released. Or
    ("late") a write (device to host) whose copy ended after its deadline, which is not done: its
    engine gives up on the call by then and may reuse the device pages the copy still read (a
    daemon stopped mid-copy, then resumed), so nothing of what it copied is kept."""

    CODES = {
        "deadline": Code.DEADLINE_EXCEEDED,
        "cancelled": Code.CANCELLED,
        "released": Code.NOT_FOUND,
        "late": Code.DEADLINE_EXCEEDED,
    }
    WHY = {
        "deadline": "its timeout_ms passed",
        "cancelled": "its call ended",
        "released": "its client was unregistered or reclaimed",
    }
    # The data plane's LATE_WRITE (kvserver/lane/csrc/plane.h), word for word.
    LATE = ("copy ended after its timeout_ms, when its engine may have given up on it and reused what it "
            "read: nothing of it is kept")

    def __init__(self, reason: str, layers_done: int, total: int) -> None:
        self.code = self.CODES[reason]
        self.reason = reason
        self.layers_done = layers_done
        super().__init__(self.LATE if reason == "late" else (
            f"copy stopped because {self.WHY[reason]}: {layers_done} of its {total} layers were "
            "copied, and nothing more of it will be"))


class GpuStalled(KVError):
    """A client's GPU copies made no progress within --cuda-wait-seconds: the client is failed."""

    code = Code.DEADLINE_EXCEEDED


# Status details travel in HTTP/2 trailers, which peers refuse past 8 KiB (soft) / 16 KiB (hard).
MAX_DETAILS = 2048


def shown(value: object, limit: int = 80) -> str:
    """repr(value), shortened: caller input quoted in a message must not blow up its size."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAILS else f"{text[:MAX_DETAILS]}... ({len(text)} chars)"


def status_of(exc: BaseException) -> tuple[Code, str]:
    """The status code and details for an exception: domain errors keep theirs, anything else is
    INTERNAL."""
    if isinstance(exc, KVError):
        return exc.code, _clip(str(exc))
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        # The daemon's shortage, not a fault of the call: another try may find one.
        return Code.RESOURCE_EXHAUSTED, f"the daemon is out of file descriptors ({exc.strerror}); try again"
    return Code.INTERNAL, _clip(f"internal error: {type(exc).__name__}: {exc}")
