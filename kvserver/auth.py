"""Token check on every call: 'authorization: Bearer <token>' metadata, compared in constant time.

Health checks stay open (probes have no token); everything else, reflection included, needs it.
"""

from __future__ import annotations

import hmac

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
MESSAGE = "missing or wrong token: send 'authorization: Bearer <token>' metadata"


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover (makes this an async generator)


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def allows(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

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
