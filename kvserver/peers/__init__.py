"""Who is calling: the fd socket that takes an engine's descriptors and reads its credentials
(SO_PEERCRED), the one-time tickets that carry them to Register, and tenants.

Owns: ``fd_socket`` (PeerSocket, the daemon's half of ``kvserver.protocol.fd_socket``),
``tickets`` (TicketBook, PeerCred) and ``tenants`` (TenantBook: whose cached pages a caller sees).
May import: ``protocol``, ``config`` and ``errors``.
"""
