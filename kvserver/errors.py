"""Domain errors raised by the daemon's core, and the one table that maps them to gRPC codes."""

from __future__ import annotations

import grpc


class KVError(Exception):
    """Base of every error the daemon reports to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KVError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVError):
    code = grpc.StatusCode.NOT_FOUND


class UnknownClient(NotFound):
    pass


class OutOfRange(KVError):
    code = grpc.StatusCode.OUT_OF_RANGE


class LayerOutOfRange(OutOfRange):
    pass


class FailedPrecondition(KVError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NoCapacity(KVError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(KVError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KVError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unimplemented(KVError):
    code = grpc.StatusCode.UNIMPLEMENTED


class JobStopped(KVError):
    """A copy stopped at a layer boundary before its last layer: nothing more of it is copied.
    Its code says why: its deadline passed, its call ended, or its client was released."""

    CODES = {
        "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
        "cancelled": grpc.StatusCode.CANCELLED,
        "released": grpc.StatusCode.NOT_FOUND,
    }
    WHY = {
        "deadline": "its timeout_ms passed",
        "cancelled": "its call ended",
        "released": "its client was unregistered or reclaimed",
    }

    def __init__(self, reason: str, layers_done: int, total: int) -> None:
        self.code = self.CODES[reason]
        self.reason = reason
        self.layers_done = layers_done
        super().__init__(
            f"copy stopped because {self.WHY[reason]}: {layers_done} of its {total} layers were "
            "copied, and nothing more of it will be"
        )


class GpuStalled(KVError):
    """A client's GPU copies made no progress within --cuda-wait-seconds: the client is failed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


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


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception: domain errors keep theirs, anything else is INTERNAL."""
    if isinstance(exc, KVError):
        return exc.code, _clip(str(exc))
    return grpc.StatusCode.INTERNAL, _clip(f"internal error: {type(exc).__name__}: {exc}")
