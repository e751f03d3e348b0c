"""The daemon's edge: the gRPC servicer (proto <-> core, nothing else), credentials in call
metadata, domain errors as gRPC statuses, the wire bytes of large answers, and /metrics.

Owns: ``servicer`` (KVServicer), ``auth`` (tokens), ``status`` (errors -> grpc.StatusCode),
``packed`` (index lists encoded with numpy), ``metrics`` (Prometheus).
May import: ``lane`` and everything below it; only ``server`` imports it.
"""
