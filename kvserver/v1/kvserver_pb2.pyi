from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType

class MHALayout(_message.Message):
    __slots__ = ("num_heads", "head_dim")
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_heads: int
    head_dim: int
    def __init__(self, num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class MLALayout(_message.Message):
    __slots__ = ("kv_lora_rank", "qk_rope_head_dim")
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    kv_lora_rank: int
    qk_rope_head_dim: int
    def __init__(self, kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("mha", "mla")
    MHA_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    mha: MHALayout
    mla: MLALayout
    def __init__(self, mha: _Optional[_Union[MHALayout, _Mapping]] = ..., mla: _Optional[_Union[MLALayout, _Mapping]] = ...) -> None: ...

class ShmLocation(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class FdLocation(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: int
    def __init__(self, index: _Optional[int] = ...) -> None: ...

class CudaIpcLocation(_message.Message):
    __slots__ = ("ipc_handle", "device_uuid", "allocation_size", "pci_bus_id")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_SIZE_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    device_uuid: str
    allocation_size: int
    pci_bus_id: str
    def __init__(self, ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., allocation_size: _Optional[int] = ..., pci_bus_id: _Optional[str] = ...) -> None: ...

class BufferRef(_message.Message):
    __slots__ = ("shm", "cuda", "fd", "offset", "token_stride", "block_tokens", "block_stride", "head_stride")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    HEAD_STRIDE_FIELD_NUMBER: _ClassVar[int]
    shm: ShmLocation
    cuda: CudaIpcLocation
    fd: FdLocation
    offset: int
    token_stride: int
    block_tokens: int
    block_stride: int
    head_stride: int
    def __init__(self, shm: _Optional[_Union[ShmLocation, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcLocation, _Mapping]] = ..., fd: _Optional[_Union[FdLocation, _Mapping]] = ..., offset: _Optional[int] = ..., token_stride: _Optional[int] = ..., block_tokens: _Optional[int] = ..., block_stride: _Optional[int] = ..., head_stride: _Optional[int] = ...) -> None: ...

class LayerBuffers(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[BufferRef]
    def __init__(self, parts: _Optional[_Iterable[_Union[BufferRef, _Mapping]]] = ...) -> None: ...

class DevicePool(_message.Message):
    __slots__ = ("num_tokens", "layers")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerBuffers]
    def __init__(self, num_tokens: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerBuffers, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("model", "tp_rank", "tp_size", "pp_rank", "pp_size", "start_layer", "end_layer", "num_layers", "layout", "dtype", "page_size", "device_pool", "host_tokens", "event_slots", "min_host_tokens", "replaces_client_id", "peer_ticket", "weights")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_POOL_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MIN_HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLACES_CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_TICKET_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    start_layer: int
    end_layer: int
    num_layers: int
    layout: KVLayout
    dtype: DType
    page_size: int
    device_pool: DevicePool
    host_tokens: int
    event_slots: int
    min_host_tokens: int
    replaces_client_id: str
    peer_ticket: str
    weights: str
    def __init__(self, model: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., page_size: _Optional[int] = ..., device_pool: _Optional[_Union[DevicePool, _Mapping]] = ..., host_tokens: _Optional[int] = ..., event_slots: _Optional[int] = ..., min_host_tokens: _Optional[int] = ..., replaces_client_id: _Optional[str] = ..., peer_ticket: _Optional[str] = ..., weights: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("client_id", "host_tokens", "page_size", "host_bytes_per_token", "epoch", "lease_seconds", "reclaim_grace_seconds", "layer_events", "weights")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    host_tokens: int
    page_size: int
    host_bytes_per_token: int
    epoch: int
    lease_seconds: float
    reclaim_grace_seconds: float
    layer_events: _containers.RepeatedScalarFieldContainer[bytes]
    weights: str
    def __init__(self, client_id: _Optional[str] = ..., host_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., host_bytes_per_token: _Optional[int] = ..., epoch: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., reclaim_grace_seconds: _Optional[float] = ..., layer_events: _Optional[_Iterable[bytes]] = ..., weights: _Optional[str] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ("copies_pending",)
    COPIES_PENDING_FIELD_NUMBER: _ClassVar[int]
    copies_pending: bool
    def __init__(self, copies_pending: bool = ...) -> None: ...

class AllocRequest(_message.Message):
    __slots__ = ("client_id", "num_tokens")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    num_tokens: int
    def __init__(self, client_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AllocResponse(_message.Message):
    __slots__ = ("host_indices",)
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    host_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, host_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("client_id", "host_indices")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    host_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., host_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed_tokens",)
    FREED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    freed_tokens: int
    def __init__(self, freed_tokens: _Optional[int] = ...) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("client_id", "device_indices", "host_indices", "layers", "ready_event", "timeout_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    host_indices: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    ready_event: bytes
    timeout_ms: int
    def __init__(self, client_id: _Optional[str] = ..., device_indices: _Optional[_Iterable[int]] = ..., host_indices: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[int]] = ..., ready_event: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("client_id", "host_indices", "device_indices", "layers", "event_slot", "ready_event", "timeout_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SLOT_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    host_indices: _containers.RepeatedScalarFieldContainer[int]
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    event_slot: int
    ready_event: bytes
    timeout_ms: int
    def __init__(self, client_id: _Optional[str] = ..., host_indices: _Optional[_Iterable[int]] = ..., device_indices: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[int]] = ..., event_slot: _Optional[int] = ..., ready_event: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("last_layer", "layers_done", "done", "bytes", "events_recorded", "pages", "part_pages")
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_RECORDED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PART_PAGES_FIELD_NUMBER: _ClassVar[int]
    last_layer: int
    layers_done: int
    done: bool
    bytes: int
    events_recorded: bool
    pages: int
    part_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, last_layer: _Optional[int] = ..., layers_done: _Optional[int] = ..., done: bool = ..., bytes: _Optional[int] = ..., events_recorded: bool = ..., pages: _Optional[int] = ..., part_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class KVSpace(_message.Message):
    __slots__ = ("model", "layout", "dtype", "page_size", "num_layers", "tp_size", "pp_size", "weights")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout: KVLayout
    dtype: DType
    page_size: int
    num_layers: int
    tp_size: int
    pp_size: int
    weights: str
    def __init__(self, model: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., weights: _Optional[str] = ...) -> None: ...

class OpenSpaceRequest(_message.Message):
    __slots__ = ("space", "peer_ticket")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    PEER_TICKET_FIELD_NUMBER: _ClassVar[int]
    space: KVSpace
    peer_ticket: str
    def __init__(self, space: _Optional[_Union[KVSpace, _Mapping]] = ..., peer_ticket: _Optional[str] = ...) -> None: ...

class OpenSpaceResponse(_message.Message):
    __slots__ = ("space_id", "tenant")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    tenant: str
    def __init__(self, space_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("client_id", "space_id", "keys", "key_bytes", "pin_ms", "whole_space", "memory_only", "timeout_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_MS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_SPACE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    space_id: str
    keys: bytes
    key_bytes: int
    pin_ms: int
    whole_space: bool
    memory_only: bool
    timeout_ms: int
    def __init__(self, client_id: _Optional[str] = ..., space_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., key_bytes: _Optional[int] = ..., pin_ms: _Optional[int] = ..., whole_space: bool = ..., memory_only: bool = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("pages", "lease_id", "disk_pages", "cluster_pages")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DISK_PAGES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    lease_id: str
    disk_pages: int
    cluster_pages: int
    def __init__(self, pages: _Optional[int] = ..., lease_id: _Optional[str] = ..., disk_pages: _Optional[int] = ..., cluster_pages: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("client_id", "space_id", "log_id", "after_seq", "max_keys")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    space_id: str
    log_id: str
    after_seq: int
    max_keys: int
    def __init__(self, client_id: _Optional[str] = ..., space_id: _Optional[str] = ..., log_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., max_keys: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "ts", "removed", "medium", "locality", "keys", "unnamed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    UNNAMED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    removed: bool
    medium: str
    locality: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    unnamed: int
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., removed: bool = ..., medium: _Optional[str] = ..., locality: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., unnamed: _Optional[int] = ...) -> None: ...

class EventsResponse(_message.Message):
    __slots__ = ("log_id", "events", "next_seq", "gap")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    log_id: str
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    next_seq: int
    gap: bool
    def __init__(self, log_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., next_seq: _Optional[int] = ..., gap: bool = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("client_id", "keys", "key_bytes", "device_pages", "ready_event", "timeout_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: bytes
    key_bytes: int
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    ready_event: bytes
    timeout_ms: int
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., key_bytes: _Optional[int] = ..., device_pages: _Optional[_Iterable[int]] = ..., ready_event: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "present", "dropped", "bytes")
    STORED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    stored: int
    present: int
    dropped: int
    bytes: int
    def __init__(self, stored: _Optional[int] = ..., present: _Optional[int] = ..., dropped: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("client_id", "keys", "key_bytes", "device_pages", "layers", "event_slot", "ready_event", "timeout_ms", "lease_id", "parts")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SLOT_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: bytes
    key_bytes: int
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    event_slot: int
    ready_event: bytes
    timeout_ms: int
    lease_id: str
    parts: _containers.RepeatedCompositeFieldContainer[GetPart]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., key_bytes: _Optional[int] = ..., device_pages: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[int]] = ..., event_slot: _Optional[int] = ..., ready_event: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ..., lease_id: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[GetPart, _Mapping]]] = ...) -> None: ...

class GetPart(_message.Message):
    __slots__ = ("keys", "device_pages", "lease_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    def __init__(self, keys: _Optional[bytes] = ..., device_pages: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id", "space_id", "lease_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    space_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., space_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class TransferCounters(_message.Message):
    __slots__ = ("bytes_written", "bytes_loaded", "write_ops", "load_ops")
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    WRITE_OPS_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPS_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    bytes_loaded: int
    write_ops: int
    load_ops: int
    def __init__(self, bytes_written: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., write_ops: _Optional[int] = ..., load_ops: _Optional[int] = ...) -> None: ...

class ClientStats(_message.Message):
    __slots__ = ("client_id", "model", "tp_rank", "pp_rank", "start_layer", "end_layer", "capacity_tokens", "used_tokens", "capacity_bytes", "used_bytes", "transfers", "epoch", "sessions")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    model: str
    tp_rank: int
    pp_rank: int
    start_layer: int
    end_layer: int
    capacity_tokens: int
    used_tokens: int
    capacity_bytes: int
    used_bytes: int
    transfers: TransferCounters
    epoch: int
    sessions: int
    def __init__(self, client_id: _Optional[str] = ..., model: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., transfers: _Optional[_Union[TransferCounters, _Mapping]] = ..., epoch: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "reserved_bytes", "used_bytes", "num_clients", "transfers", "clients", "reclaimed_clients", "cache_bytes", "spaces", "tenants", "kept", "tiers", "room_bytes")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    reserved_bytes: int
    used_bytes: int
    num_clients: int
    transfers: TransferCounters
    clients: _containers.RepeatedCompositeFieldContainer[ClientStats]
    reclaimed_clients: int
    cache_bytes: int
    spaces: _containers.RepeatedCompositeFieldContainer[SpaceStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    kept: KeptCache
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    room_bytes: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_clients: _Optional[int] = ..., transfers: _Optional[_Union[TransferCounters, _Mapping]] = ..., clients: _Optional[_Iterable[_Union[ClientStats, _Mapping]]] = ..., reclaimed_clients: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., spaces: _Optional[_Iterable[_Union[SpaceStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., kept: _Optional[_Union[KeptCache, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., room_bytes: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "slab_bytes", "pages", "bytes", "hits", "evicted_pages", "written_pages", "written_bytes", "promoted_pages", "promoted_bytes", "skipped_pages", "write_errors", "read_errors", "bad_checks", "direct_io", "kept", "present_pages", "joined", "available", "breaker_trips", "timeouts", "busy", "quarantined_pages")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    READ_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BAD_CHECKS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    PRESENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    BREAKER_TRIPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    slab_bytes: int
    pages: int
    bytes: int
    hits: int
    evicted_pages: int
    written_pages: int
    written_bytes: int
    promoted_pages: int
    promoted_bytes: int
    skipped_pages: int
    write_errors: int
    read_errors: int
    bad_checks: int
    direct_io: bool
    kept: KeptCache
    present_pages: int
    joined: bool
    available: bool
    breaker_trips: int
    timeouts: int
    busy: int
    quarantined_pages: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., slab_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., written_pages: _Optional[int] = ..., written_bytes: _Optional[int] = ..., promoted_pages: _Optional[int] = ..., promoted_bytes: _Optional[int] = ..., skipped_pages: _Optional[int] = ..., write_errors: _Optional[int] = ..., read_errors: _Optional[int] = ..., bad_checks: _Optional[int] = ..., direct_io: bool = ..., kept: _Optional[_Union[KeptCache, _Mapping]] = ..., present_pages: _Optional[int] = ..., joined: bool = ..., available: bool = ..., breaker_trips: _Optional[int] = ..., timeouts: _Optional[int] = ..., busy: _Optional[int] = ..., quarantined_pages: _Optional[int] = ...) -> None: ...

class KeptCache(_message.Message):
    __slots__ = ("dir", "adopted_pages", "adopted_bytes", "adopt_seconds", "torn_pages", "dropped_pages", "evicted_pages", "reason")
    DIR_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADOPT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TORN_PAGES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    dir: str
    adopted_pages: int
    adopted_bytes: int
    adopt_seconds: float
    torn_pages: int
    dropped_pages: int
    evicted_pages: int
    reason: str
    def __init__(self, dir: _Optional[str] = ..., adopted_pages: _Optional[int] = ..., adopted_bytes: _Optional[int] = ..., adopt_seconds: _Optional[float] = ..., torn_pages: _Optional[int] = ..., dropped_pages: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class CacheCounters(_message.Message):
    __slots__ = ("pages", "bytes", "hits", "misses", "evictions", "dedup_pages", "dedup_bytes", "dropped")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEDUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    dedup_pages: int
    dedup_bytes: int
    dropped: int
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., dedup_pages: _Optional[int] = ..., dedup_bytes: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class SpaceStats(_message.Message):
    __slots__ = ("tenant", "space", "counters", "parts_seen", "parts", "complete_pages")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    PARTS_SEEN_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_PAGES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    space: KVSpace
    counters: CacheCounters
    parts_seen: int
    parts: int
    complete_pages: int
    def __init__(self, tenant: _Optional[str] = ..., space: _Optional[_Union[KVSpace, _Mapping]] = ..., counters: _Optional[_Union[CacheCounters, _Mapping]] = ..., parts_seen: _Optional[int] = ..., parts: _Optional[int] = ..., complete_pages: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "counters", "quota_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    counters: CacheCounters
    quota_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., counters: _Optional[_Union[CacheCounters, _Mapping]] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class OpenLaneRequest(_message.Message):
    __slots__ = ("client_id", "peer_ticket", "space_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_TICKET_FIELD_NUMBER: _ClassVar[int]
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    peer_ticket: str
    space_id: str
    def __init__(self, client_id: _Optional[str] = ..., peer_ticket: _Optional[str] = ..., space_id: _Optional[str] = ...) -> None: ...

class OpenLaneResponse(_message.Message):
    __slots__ = ("slots", "request_bytes", "response_bytes", "request_format", "rpc_mask", "clock_ns")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FORMAT_FIELD_NUMBER: _ClassVar[int]
    RPC_MASK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_NS_FIELD_NUMBER: _ClassVar[int]
    slots: int
    request_bytes: int
    response_bytes: int
    request_format: int
    rpc_mask: int
    clock_ns: int
    def __init__(self, slots: _Optional[int] = ..., request_bytes: _Optional[int] = ..., response_bytes: _Optional[int] = ..., request_format: _Optional[int] = ..., rpc_mask: _Optional[int] = ..., clock_ns: _Optional[int] = ...) -> None: ...
