"""KV events: which pages of a space the node's cache gains and loses, tier by tier, named by the
engines' own keys, for cache-aware routers.

Owns: ``book`` (EventBook: per-space logs that engines read through the Events call, fed by the
tiers' listeners) and ``publisher`` (the daemon's own ZMQ publisher in vLLM's KVEventBatch schema,
``schema``).
May import: ``store``, ``config`` and ``errors``; never gRPC.
"""

from kvserver.events.book import CPU, LOCAL, REMOTE, STORAGE, EventBook, LoggedEvent

__all__ = ["CPU", "LOCAL", "REMOTE", "STORAGE", "EventBook", "LoggedEvent"]
