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


class Unavailable(KVError):
    code = grpc.StatusCode.UNAVAILABLE


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception: domain errors keep theirs, anything else is INTERNAL."""
    if isinstance(exc, KVError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
