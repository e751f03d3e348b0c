"""kvclient: the engine-side library for the kvserver daemon."""

from kvclient._messages import Registration
from kvclient.aio_client import AsyncKVClient, AsyncLoadHandle
from kvclient.cuda_pool import CudaKVPool
from kvclient.errors import KVClientError
from kvclient.shm_pool import ShmKVPool
from kvclient.sync_client import KVClient, LoadHandle
from kvserver.layout import KVLayout

__all__ = [
    "AsyncKVClient",
    "AsyncLoadHandle",
    "CudaKVPool",
    "KVClient",
    "KVClientError",
    "KVLayout",
    "LoadHandle",
    "Registration",
    "ShmKVPool",
]
