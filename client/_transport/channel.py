"""Addresses and channel options shared by the sync and asyncio clients."""

from __future__ import annotations

import os

from kvserver.protocol.paths import default_socket

MAX_MESSAGE_BYTES = 64 << 20

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC's own reconnect backoff grows to 120 s by default: after a long daemon outage the
    # channel would sit idle for up to two minutes after the daemon is back. Capped at 0.5 s, a
    # client is serving again within about a second of the daemon answering.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def target(address: str | None) -> str:
    """'unix:///p', '/p' (a socket path) or 'host:port'; None reads KVSERVER_ADDRESS."""
    address = address or os.environ.get("KVSERVER_ADDRESS") or default_socket()
    if address.startswith("/"):
        return f"unix://{address}"
    return address
