"""Credentials in call metadata, compared in constant time.

The client token: 'authorization: Bearer <token>' on every call. Health checks stay open
(probes have no token); everything else, reflection included, needs it.
The admin token: 'x-kvserver-admin: <token>' on a Stats call lists every client of the daemon.
"""

from __future__ import annotations

import hmac

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_KEY = "x-kvserver-admin"
MESSAGE = "missing or wrong token: send 'authorization: Bearer <token>' metadata"


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover (makes this an async generator)


def _value(metadata, key: str) -> bytes | None:
    for k, value in metadata or ():
        if k == key:
            return value.encode() if isinstance(value, str) else value
    return None


def is_admin(metadata, admin_token: str | None) -> bool:
    """The call carries the daemon's admin token (never true when none is set)."""
    if not admin_token:
        return False
    got = _value(metadata, ADMIN_KEY)
    return got is not None and hmac.compare_digest(got, admin_token.encode())


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def allows(self, metadata) -> bool:
        got = _value(metadata, "authorization")
        return got is not None and hmac.compare_digest(got, self._expected)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        if self.allows(details.invocation_metadata):
            return handler
        codec = {"request_deserializer": handler.request_deserializer,
                 "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_deny_unary, **codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_deny_stream, **codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_deny_unary, **codec)
        return grpc.stream_stream_rpc_method_handler(_deny_stream, **codec)
