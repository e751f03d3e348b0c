"""A scheduler's view of one KV space, without its I/O: the OpenSpace it sends, the Lookups and
Releases it makes with the space id it gets, and what their failures mean.

The view holds no pool and no registration. An outage (or a slow daemon) answers "nothing
cached"; NOT_FOUND means the daemon restarted and forgot the space: the view opens it again and
retries once. Requests that are wrong raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from kvclient._resilience import is_miss
from kvclient._transport.channel import target
from kvclient.core import call_metadata, lease_list, packed
from kvclient.errors import KVClientError
from kvclient.keys import KEY_BYTES, Keys
from kvclient.results import EventsResult, LookupResult
from kvserver.protocol.layout import KVLayout, wire_dtype
from kvserver.v1 import kvserver_pb2 as pb

RETRY = "retry"
MISS = "miss"


@dataclass(frozen=True, slots=True)
class ViewOp:
    """A call on the space: ``build`` makes the request from the space id; ``retry``: on
    NOT_FOUND, reopen the space and send it once more."""

    rpc: str
    build: Callable[[str], Any]
    read: Callable[[Any], Any]
    miss: Any
    retry: bool = True


class ViewCore:
    def __init__(self, address: str | None, *, model: str, layout: KVLayout, dtype: torch.dtype,
                 page_size: int, num_layers: int, tp_size: int, pp_size: int, timeout: float,
                 token: str | None, tenant_token: str | None, weights: str = "") -> None:
        self.target = target(address)
        self.timeout = timeout
        self.metadata = call_metadata(token, tenant_token)
        self.space = pb.KVSpace(model=model, layout=layout.to_wire(), dtype=wire_dtype(dtype),
                                page_size=page_size, num_layers=num_layers, tp_size=tp_size, pp_size=pp_size,
                                weights=weights)
        self.space_id = ""
        self.tenant = ""
        self.misses = 0
        self.reopens = 0

    def open_request(self, ticket: str) -> pb.OpenSpaceRequest:
        return pb.OpenSpaceRequest(space=self.space, peer_ticket=ticket)

    def opened(self, resp: pb.OpenSpaceResponse) -> str:
        self.space_id, self.tenant = resp.space_id, resp.tenant
        return self.space_id

    def failed(self, op: ViewOp, error: KVClientError, retried: bool) -> str:
        """RETRY (open the space again, then resend) or MISS (answer ``op.miss``); raises a
        failure that means the request is wrong."""
        if error.code == grpc.StatusCode.NOT_FOUND:
            self.space_id = ""  # forgotten by a restarted daemon: opened again on the next call
            if op.retry and not retried:
                self.reopens += 1
                return RETRY
        elif not is_miss(error.code):
            raise error
        self.misses += 1
        return MISS

    def lookup(self, keys: Keys, pin_ms: int, key_bytes: int = KEY_BYTES) -> ViewOp:
        data, width, _ = packed(keys, key_bytes)
        return ViewOp("Lookup", lambda sid: pb.LookupRequest(space_id=sid, keys=data, key_bytes=width,
                                                             pin_ms=pin_ms),
                      LookupResult.from_wire, LookupResult(0))

    def events(self, log_id: str, after_seq: int, max_keys: int = 0) -> ViewOp:
        """The space's KV events after ``after_seq`` of log ``log_id`` (a miss: none, the same
        place to read from)."""
        return ViewOp("Events", lambda sid: pb.EventsRequest(space_id=sid, log_id=log_id,
                                                             after_seq=after_seq, max_keys=max_keys),
                      EventsResult.from_wire, EventsResult(log_id, after_seq))

    def release(self, lease_ids: str | Sequence[str]) -> ViewOp:
        # Leases of a space the daemon forgot are gone with it: nothing to retry.
        ids = lease_list(lease_ids)
        return ViewOp("Release", lambda sid: pb.ReleaseRequest(space_id=sid, lease_ids=ids),
                      lambda resp: resp.released, 0, retry=False)
