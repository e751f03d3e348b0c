"""The one exception the client raises, carrying the daemon's gRPC status."""

from __future__ import annotations

import grpc

# The daemon's mark on every Write and Load answer: the call's copy job is dead (or never ran).
JOB_ENDED = ("kvserver-job", "ended")


class KVClientError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, job_ended: bool = False) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        # The daemon itself answered a Write or Load with this status, once its job was dead.
        # False for a deadline or disconnection seen on the client's side only.
        self.job_ended = job_ended


def from_rpc_error(exc: grpc.RpcError) -> KVClientError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    ended = any(tuple(m) == JOB_ENDED for m in trailers or ())
    details = details or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "SERVER: Received message larger than max" in details:
        # (the daemon's transport refused the request; not this side's own 64 MiB channel)
        details += (" (the daemon takes no request larger than the largest valid one under its "
                    "--max-request-indices, 16 MiB at the default: split the call)")
    return KVClientError(code or grpc.StatusCode.UNKNOWN, details, ended)
