"""The daemon's per-layer interprocess events, opened in the engine's process.

A CUDA load records, for every requested layer, the event of its slot once that layer's copy is
done. The engine's compute stream waits on it (on the GPU) before attention reads the layer; the
CPU never blocks per layer. Waiting binds to the event's latest record, so a stream may wait only
after the daemon has said the load's events are recorded (``LoadHandle.wait_recorded``).
"""

from __future__ import annotations

import torch


def event_handle(event) -> bytes:
    """A torch.cuda.Event created with interprocess=True (or raw handle bytes) as wire bytes."""
    if isinstance(event, bytes | bytearray):
        return bytes(event)
    return bytes(event.ipc_handle())


class LayerEvents:
    def __init__(self, handles: tuple[bytes, ...], num_layers: int, device: torch.device | int) -> None:
        if len(handles) % num_layers:
            raise ValueError(f"{len(handles)} event handles do not divide into {num_layers} layers")
        self.handles = handles
        self.num_layers = num_layers
        self.num_slots = len(handles) // num_layers
        self.device = device
        self._opened: dict[int, torch.cuda.Event] = {}

    def event(self, slot: int, local_layer: int) -> torch.cuda.Event:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"event slot {slot} is not one of {self.num_slots}")
        i = slot * self.num_layers + local_layer
        ev = self._opened.get(i)
        if ev is None:
            ev = self._opened[i] = torch.cuda.Event.from_ipc_handle(self.device, self.handles[i])
        return ev
