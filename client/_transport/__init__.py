"""How the client's calls reach the daemon (internal to kvclient): the gRPC channel and its
address, the fd socket that hands a pool's descriptors over for a peer ticket, and the
shared-memory fast lane. The shells (``sync_client``, ``aio_client``) use them; the sans-IO cores
(``core``, ``view_core``) use only ``channel.target``, the rule that turns an address into a target.

Owns: ``channel`` (addresses, targets, channel options), ``fd_socket`` (peer tickets) and ``lane``
(the fast lane's engine half).
May import: ``kvclient.errors``, ``kvserver.protocol``, ``kvserver.v1`` and ``kvserver.errors``.
"""
