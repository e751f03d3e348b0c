"""The daemon without gRPC: registered clients and their lifecycle, checked transfer requests,
the node-wide cache's operations as served, and the copier that runs every copy.

Owns: ``kvcore`` (KVCore: register, alloc, free, unregister, checked Write/Load jobs),
``client_state`` (what the daemon holds for one registration), ``epochs`` (registration epochs in
host indices), ``cache_ops`` (Lookup, Put, Get and Release over ``store``), ``copier`` (queues,
inline copies, deadlines, per-layer progress) and ``liveness`` (sessions and the reaper).
May import: ``media``, ``store``, ``peers``, ``host``, ``copies`` and below; never gRPC.
"""
