"""The calls the client core plans and its shells carry out: what to send, how to read the
answer, and what a miss answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvclient._messages import Registration


# Op and StreamOp are made for every call and never changed after: not frozen, because a frozen
# dataclass's __init__ costs a microsecond more, on the engine's scheduler thread.
@dataclass(slots=True)
class Op:
    """A unary RPC. ``build`` makes the request from the registration (None for a call that
    needs none); ``read`` turns the answer into the result; a miss answers ``miss``.
    ``registered``: a call on the registration, with the miss policy; else every failure raises.
    ``job``: a Write or Put, whose failure is reported only once its copy cannot still run."""

    rpc: str
    build: Callable[[Registration | None], Any]
    read: Callable[[Any], Any]
    miss: Any = None
    registered: bool = True
    job: bool = False
    cache: bool = False  # a call on the node-wide cache: best effort (see ClientCore.judge)
    timeout: float | None = None  # the call's own bound, if shorter than the client's (a lookup)


@dataclass(slots=True)
class StreamOp:
    """A Load or Get: a stream of LoadProgress over ``layers`` (empty: every layer of the
    registration), recording the layer events of ``event_slot`` on CUDA pools."""

    rpc: str
    build: Callable[[Registration], Any]
    layers: list[int]
    event_slot: int = 0
    get: bool = False
    job: bool = True
    lane: bool = True  # False: gRPC only (a Get with parts: the lane's progress words have no room)

    @property
    def cache(self) -> bool:
        return self.get


@dataclass(slots=True)
class Call:
    """An RPC to send now: ``request`` with the gRPC deadline ``timeout``, made for ``reg``."""

    op: Op | StreamOp
    reg: Registration | None
    request: Any
    timeout: float
    layers: list[int] = field(default_factory=list)
    events: dict[int, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Missed:
    """No RPC: the registration is lost and the call is a miss; ``value`` is its answer (for a
    stream, the layers of the missed handle)."""

    value: Any


@dataclass(frozen=True, slots=True)
class Lost:
    """A registration just given up: ``session`` to cancel (the shell's handle, or None), and
    whether the shell must start re-registering."""

    session: object | None
    reconnect: bool
