"""What the daemon and its clients agree on, beside the generated gRPC modules (``kvserver.v1``):
the KV layout and layer ranges, the fast lane's ring format, the fd socket's handshake, shared
memory as both ends map it, CUDA IPC handles and device identities, and the default socket path.

The client library (kvclient) imports only this package, ``kvserver.v1`` and ``kvserver.errors``
of kvserver; nothing here imports the daemon.

Owns: ``layout``, ``ring``, ``fd_socket``, ``shared_memory``, ``cuda_ipc``, ``paths`` and
``compiled`` (which of the package's C extensions match their sources).
May import: ``errors`` and ``v1``.
"""
