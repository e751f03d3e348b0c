"""kvclient: the engine-side library for the kvserver daemon."""

from kvclient._messages import Registration
from kvclient.aio_client import AsyncKVClient, AsyncLoadHandle
from kvclient.cache_view import AsyncCacheView, CacheView
from kvclient.cuda_pool import CudaKVPool
from kvclient.errors import KVClientError
from kvclient.results import LookupResult, PutResult
from kvclient.shm_pool import ShmKVPool
from kvclient.sync_client import KVClient, LoadHandle
from kvserver.layout import KVLayout

__all__ = [
    "AsyncCacheView",
    "AsyncKVClient",
    "AsyncLoadHandle",
    "CacheView",
    "CudaKVPool",
    "KVClient",
    "KVClientError",
    "KVLayout",
    "LoadHandle",
    "LookupResult",
    "PutResult",
    "Registration",
    "ShmKVPool",
]
