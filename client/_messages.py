"""Messages the client core builds and reads: the Register request, the registration it answers, ids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvclient.cuda_pool import CudaKVPool
from kvclient.shm_pool import ShmKVPool
from kvclient.views_pool import KVViewsPool
from kvserver.protocol import lane_request
from kvserver.protocol.layout import wire_dtype
from kvserver.v1 import kvserver_pb2 as pb

Indices = torch.Tensor | np.ndarray | Sequence[int]


@dataclass(frozen=True, slots=True)
class Registration:
    client_id: str
    host_tokens: int
    page_size: int
    host_bytes_per_token: int
    start_layer: int
    end_layer: int
    epoch: int
    layer_events: tuple[bytes, ...] = ()  # CUDA pools: [slot * layers + local layer]

    def load_layers(self, layers: list[int]) -> list[int]:
        """The global layers a Load of ``layers`` (``layer_list``'s; [] for all) lands."""
        return layers or list(range(self.start_layer, self.end_layer))


def index_array(values: Indices) -> np.ndarray:
    """The indices as one flat int64 array (a copy only where the input is not one already)."""
    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1).to("cpu", torch.int64).numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def index_source(values: Indices) -> tuple:
    """(owner, address, count) of the indices as contiguous int64 memory, for the lane's binary
    request (kvserver.protocol.lane_request.pack_at): a CPU int64 tensor as it is, else a copy."""
    if isinstance(values, torch.Tensor) and values.dtype is torch.int64 and values.is_cpu \
            and values.is_contiguous() and not values.requires_grad:
        return values, values.data_ptr(), values.numel()
    return lane_request.index_source(index_array(values))


def ids(values: Indices) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    if isinstance(values, np.ndarray):
        return values.reshape(-1).tolist()
    return list(values)


def register_request(
    *,
    model: str,
    pool: ShmKVPool | CudaKVPool | KVViewsPool,
    start_layer: int,
    end_layer: int,
    num_layers: int,
    host_tokens: int,
    page_size: int,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    event_slots: int = 0,
    min_host_tokens: int = 0,
    peer_ticket: str = "",
    weights: str = "",
) -> pb.RegisterRequest:
    """The request without a ticket unless given one: the clients get a fresh ticket for each
    Register they send (``_transport.fd_socket.ticketed``)."""
    return pb.RegisterRequest(
        model=model,
        weights=weights,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        start_layer=start_layer,
        end_layer=end_layer,
        num_layers=num_layers,
        layout=pool.layout.to_wire(),
        dtype=wire_dtype(pool.dtype),
        page_size=page_size,
        device_pool=pool.descriptor(),
        host_tokens=host_tokens,
        event_slots=event_slots,
        min_host_tokens=min_host_tokens,
        peer_ticket=peer_ticket,
    )


def registration(resp: pb.RegisterResponse, req: pb.RegisterRequest) -> Registration:
    return Registration(
        client_id=resp.client_id,
        host_tokens=resp.host_tokens,
        page_size=resp.page_size,
        host_bytes_per_token=resp.host_bytes_per_token,
        start_layer=req.start_layer,
        end_layer=req.end_layer,
        epoch=resp.epoch,
        layer_events=tuple(resp.layer_events),
    )


def layer_list(layers: Iterable[int] | None) -> list[int]:
    return [] if layers is None else [int(x) for x in layers]


def host_tensor(resp: pb.AllocResponse) -> torch.Tensor:
    return torch.tensor(resp.host_indices, dtype=torch.int64)
