"""kvserver: a per-node daemon that holds host KV-cache memory for LLM inference engines.

Kept import-light: the client library imports ``kvserver.v1`` and ``kvserver.layout`` only.
"""

__version__ = "0.1.0"
