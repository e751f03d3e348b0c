"""The one exception the client raises, carrying the daemon's gRPC status."""

from __future__ import annotations

import grpc


class KVClientError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def from_rpc_error(exc: grpc.RpcError) -> KVClientError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return KVClientError(code or grpc.StatusCode.UNKNOWN, details or "")
