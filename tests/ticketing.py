"""Raw stubs that name their caller as kvclient does: a Register or OpenSpace sent without a peer
ticket gets a fresh one (no descriptors) from the daemon's fd socket, since a caller on the Unix
socket is never anonymous. Tests that check requests with no ticket use a plain stub."""

from __future__ import annotations

import grpc

from kvclient._transport.fd_socket import ticket_for
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

NAMED = ("/kvserver.v1.KVServer/Register", "/kvserver.v1.KVServer/OpenSpace")


class _AddTicket(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, address: str) -> None:
        self.address = address

    def intercept_unary_unary(self, continuation, details, request):
        if details.method in NAMED and not request.peer_ticket:
            named = type(request)()
            named.CopyFrom(request)
            named.peer_ticket = ticket_for(self.address)
            request = named
        return continuation(details, request)


def ticketing_stub(channel: grpc.Channel, address: str) -> pb_grpc.KVServerStub:
    """A stub over ``channel`` (to the daemon at ``address``) whose Register and OpenSpace carry a
    peer ticket."""
    return pb_grpc.KVServerStub(grpc.intercept_channel(channel, _AddTicket(address)))

