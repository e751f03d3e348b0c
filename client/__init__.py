"""kvclient: the engine-side library for the kvserver daemon.

The public API is what this module exports, plus ``kvclient.keys``, ``kvclient.views_pool``,
``kvclient.registrar`` and the engine packages ``kvclient.sglang`` and ``kvclient.vllm``. Inside:

    core, _ops, _messages, _resilience     the client without its I/O: requests, answers, misses
    sync_client, aio_client, _shell        its two shells (threads; asyncio) and their load handles
    _transport/                            channel, fd socket tickets, the shared-memory fast lane
    shm_pool, cuda_pool, views_pool        device pools by medium (cuda_events: per-layer events)
    view_core, cache_view                  a scheduler's read-only view of a KV space
    keys, results, errors, registrar       page keys, answers, the one exception, register-or-miss
    sglang/, vllm/                         the engines' own plug-in seams

It imports of kvserver only ``kvserver.protocol``, ``kvserver.v1`` and ``kvserver.errors``.
"""

from kvclient._messages import Registration
from kvclient.aio_client import AsyncKVClient, AsyncLoadHandle
from kvclient.cache_view import AsyncCacheView, CacheView
from kvclient.cuda_pool import CudaKVPool
from kvclient.errors import KVClientError
from kvclient.results import LookupResult, PutResult
from kvclient.shm_pool import ShmKVPool
from kvclient.sync_client import KVClient, LoadHandle
from kvserver.protocol.layout import KVLayout

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
