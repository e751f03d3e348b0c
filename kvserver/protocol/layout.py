"""KV geometry shared by the daemon and the client: dtypes, per-token layout and layer ranges."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvserver.errors import InvalidArgument, LayerOutOfRange, shown
from kvserver.v1 import kvserver_pb2 as pb

# Longest layers list looked at id by id (with array operations) to name an id outside the range;
# a longer one (a 16 MiB message holds ~16 M) is refused by its length alone.
MAX_LAYER_IDS = 1 << 20


class Sized(Protocol):
    """A dtype as far as sizes go: a ``KVDType``, a numpy or a torch dtype."""

    @property
    def itemsize(self) -> int: ...


@dataclass(frozen=True, slots=True)
class KVDType:
    """A KV dtype as the daemon knows it: its name (torch's, without ``torch.``), the bytes of one
    element and its wire value. The daemon moves bytes and never loads torch; engines name their
    tensors' dtypes (``wire_dtype`` takes a ``torch.dtype`` as well)."""

    name: str
    itemsize: int
    wire: int

    def __str__(self) -> str:
        return self.name


KV_DTYPES: dict[int, KVDType] = {d.wire: d for d in (
    KVDType("bfloat16", 2, pb.DTYPE_BFLOAT16),
    KVDType("float16", 2, pb.DTYPE_FLOAT16),
    KVDType("float32", 4, pb.DTYPE_FLOAT32),
    KVDType("float8_e4m3fn", 1, pb.DTYPE_FLOAT8_E4M3FN),
    KVDType("float8_e5m2", 1, pb.DTYPE_FLOAT8_E5M2),
)}
KV_DTYPES_BY_NAME: dict[str, KVDType] = {d.name: d for d in KV_DTYPES.values()}


def kv_dtype(dtype: int) -> KVDType:
    """The dtype a wire value names."""
    try:
        return KV_DTYPES[dtype]
    except KeyError:
        allowed = ", ".join(pb.DType.Name(d) for d in KV_DTYPES)
        raise InvalidArgument(f"dtype {dtype} is not supported; use one of {allowed}") from None


def dtype_named(name: str) -> KVDType:
    """The dtype of ``name`` (``bfloat16``, or torch's ``torch.bfloat16``)."""
    try:
        return KV_DTYPES_BY_NAME[name.removeprefix("torch.")]
    except KeyError:
        allowed = ", ".join(KV_DTYPES_BY_NAME)
        raise InvalidArgument(f"dtype {name} is not supported; use one of {allowed}") from None


def wire_dtype(dtype: KVDType | object) -> int:
    """The wire value of a ``KVDType`` or of an engine's ``torch.dtype`` (told by its name)."""
    if isinstance(dtype, KVDType):
        return dtype.wire
    name = str(dtype)
    got = KV_DTYPES_BY_NAME.get(name.removeprefix("torch.")) if name.startswith("torch.") else None
    if got is None:
        allowed = ", ".join(f"torch.{n}" for n in KV_DTYPES_BY_NAME)
        raise InvalidArgument(f"dtype {dtype} is not supported; use one of {allowed}")
    return got.wire


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per-token KV shape of one layer: ``num_parts`` buffers (K and V, or one MLA latent)."""

    is_mla: bool
    num_heads: int
    head_dim: int
    rope_dim: int = 0  # MLA: the qk_rope_head_dim share of head_dim

    @classmethod
    def mha(cls, num_heads: int, head_dim: int) -> KVLayout:
        return cls(False, num_heads, head_dim)

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> KVLayout:
        return cls(True, 1, kv_lora_rank + qk_rope_head_dim, qk_rope_head_dim)

    @property
    def num_parts(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def token_shape(self) -> tuple[int, int]:
        return (self.num_heads, self.head_dim)

    def token_bytes(self, dtype: Sized) -> int:
        """Bytes of one token in one part (K, V or latent) of one layer."""
        return self.num_heads * self.head_dim * dtype.itemsize

    @classmethod
    def from_wire(cls, msg: pb.KVLayout) -> KVLayout:
        """The layout a message names: one object for each layout (the daemon keeps one in each
        of up to 64 Ki space keys, each otherwise one more object for every full collection)."""
        kind = msg.WhichOneof("kind")
        if kind == "mha":
            if msg.mha.num_heads == 0 or msg.mha.head_dim == 0:
                raise InvalidArgument("layout.mha needs num_heads > 0 and head_dim > 0")
            return _interned(False, msg.mha.num_heads, msg.mha.head_dim)
        if kind == "mla":
            if msg.mla.kv_lora_rank == 0:
                raise InvalidArgument("layout.mla needs kv_lora_rank > 0")
            return _interned(True, msg.mla.kv_lora_rank, msg.mla.qk_rope_head_dim)
        raise InvalidArgument("layout must be set to mha or mla")

    def to_wire(self) -> pb.KVLayout:
        if self.is_mla:
            rank = self.head_dim - self.rope_dim
            return pb.KVLayout(mla=pb.MLALayout(kv_lora_rank=rank, qk_rope_head_dim=self.rope_dim))
        return pb.KVLayout(mha=pb.MHALayout(num_heads=self.num_heads, head_dim=self.head_dim))


@functools.lru_cache(maxsize=1024)  # bounded: a peer naming ever new layouts churns it, no more
def _interned(mla: bool, a: int, b: int) -> KVLayout:
    return KVLayout.mla(a, b) if mla else KVLayout.mha(a, b)


@dataclass(frozen=True, slots=True)
class LayerRange:
    """A client's global layer range [start, end); the one place global ids become local ones."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise InvalidArgument(f"layer range [{self.start}, {self.end}) is empty or negative")

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def to_local(self, layer_id: int) -> int:
        if not self.start <= layer_id < self.end:
            raise LayerOutOfRange(
                f"layer {layer_id} is outside this client's layer range {self}"
            )
        return layer_id - self.start

    def select(self, layer_ids) -> list[int]:
        """Global ids (ascending, no repeats; empty means all) to local ids. Every id is checked
        against the range first, so an id outside it is OUT_OF_RANGE however long the list."""
        if not layer_ids:
            return list(range(len(self)))
        n = len(layer_ids)
        if n > len(self):  # never valid: refused with array operations, no Python work per id
            if n > MAX_LAYER_IDS:
                raise InvalidArgument(
                    f"{n} layer ids for the {len(self)} layers of this client's layer range {self}: "
                    "a layers list names each layer of the range at most once"
                )
            ids = np.asarray(layer_ids, dtype=np.int64)
            outside = (ids < self.start) | (ids >= self.end)
            if outside.any():
                self.to_local(int(ids[outside.argmax()]))  # raises, naming the id and the range
            raise InvalidArgument(
                f"layers must be ascending without repeats, got {n} ids for the "
                f"{len(self)} layers of this client's layer range {self}"
            )
        local = [self.to_local(layer) for layer in layer_ids]
        if any(b <= a for a, b in zip(local, local[1:], strict=False)):
            raise InvalidArgument(f"layers must be ascending without repeats, got {shown(list(layer_ids))}")
        return local
