"""Where a client finds the daemon when it is given no address: the default gRPC socket path."""

from __future__ import annotations

import os


def default_socket() -> str:
    if os.geteuid() == 0:
        return "/run/kvserver/kvserver.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvserver-{os.geteuid()}"
    return os.path.join(runtime, "kvserver", "kvserver.sock")
