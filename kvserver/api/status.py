"""Domain errors as gRPC statuses: the one place where ``kvserver.errors.Code`` meets grpc."""

from __future__ import annotations

import grpc

from kvserver.errors import status_of

_GRPC = {code.value[0]: code for code in grpc.StatusCode}


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception: domain errors keep theirs, anything else is INTERNAL."""
    code, details = status_of(exc)
    return _GRPC[code], details
