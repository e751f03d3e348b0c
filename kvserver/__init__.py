"""kvserver: a per-node daemon that holds host KV-cache memory for LLM inference engines.

The tree is the map (docs/design.md has it with the path of a Load and of a Get); arrows point
down, and ``lint-imports`` (the contracts in pyproject.toml) holds them:

    __main__, server   flags and bootstrap: the aio server, health, reflection, shutdown
    api                gRPC servicer, credentials, statuses, /metrics
    lane               the shared-memory fast lane (daemon half)
    core               clients and their lifecycle, checked transfers, cache operations, the copier
    media | store      device pools by medium  |  the node-wide cache index
    peers | host       callers' credentials, tickets, tenants  |  the host arena and region pages
    copies | config    jobs, plans, queues, progress, copy kernels  |  the daemon's configuration
    protocol           what the daemon and its clients agree on (kvclient imports only this, v1, errors)
    errors | v1        domain errors with their status codes  |  the generated gRPC modules

Kept import-light: importing ``kvserver`` imports none of its packages.
"""

__version__ = "0.1.0"
