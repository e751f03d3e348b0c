"""One-time peer tickets: the credentials and descriptors an engine handed over the fd socket,
held under a random ticket until the Register call that names it (see peer_socket.py).

A ticket is spent by the first Register that names it, whether that registration succeeds or
not; one nobody redeems expires and its descriptors are closed. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass, field

from kvserver.errors import NoCapacity, PermissionDenied

logger = logging.getLogger(__name__)

TICKET_SECONDS = 30.0  # an unredeemed ticket's descriptors are closed this long after it was issued
MAX_TICKETS_PER_UID = 64  # outstanding (unredeemed) tickets one uid may hold


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The engine process on the other end of the fd socket, from SO_PEERCRED."""

    pid: int
    uid: int
    gid: int


@dataclass(slots=True)
class Ticket:
    peer: PeerCred
    fds: list[int]
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)

    def close(self) -> None:
        """Closes every descriptor the ticket holds (idempotent)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                logger.warning("closing a ticket's fd %d failed", fd)


class TicketBook:
    """Outstanding tickets, by ticket string."""

    def __init__(self, ttl: float = TICKET_SECONDS, max_per_uid: int = MAX_TICKETS_PER_UID) -> None:
        self.ttl = ttl
        self.max_per_uid = max_per_uid
        self._tickets: dict[str, Ticket] = {}
        self._per_uid: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._tickets)

    def issue(self, peer: PeerCred, fds: list[int]) -> str:
        """A new ticket holding ``fds``: the book owns them once it returns (if it raises, they
        stay the caller's to close)."""
        if self._per_uid[peer.uid] >= self.max_per_uid:
            raise NoCapacity(
                f"uid {peer.uid} already holds {self.max_per_uid} unredeemed tickets; "
                "register with them or let them expire"
            )
        key = secrets.token_hex(16)
        ticket = Ticket(peer, list(fds))
        self._tickets[key] = ticket
        self._per_uid[peer.uid] += 1
        ticket.expiry = asyncio.get_running_loop().call_later(self.ttl, self._expire, key)
        return key

    def redeem(self, key: str) -> Ticket:
        """The ticket, removed from the book: the caller closes its fds once done with them."""
        ticket = self._tickets.get(key) if key else None
        if ticket is None:
            raise PermissionDenied(
                "peer_ticket is unknown, expired or already used: get a fresh one from the daemon's "
                "fd socket right before each Register"
            )
        self._drop(key)
        return ticket

    def _drop(self, key: str) -> Ticket:
        ticket = self._tickets.pop(key)
        self._per_uid[ticket.peer.uid] -= 1
        if not self._per_uid[ticket.peer.uid]:
            del self._per_uid[ticket.peer.uid]
        if ticket.expiry is not None:
            ticket.expiry.cancel()
        return ticket

    def _expire(self, key: str) -> None:
        if key in self._tickets:
            ticket = self._drop(key)
            logger.info("a ticket of pid %d expired unredeemed; %d fds closed", ticket.peer.pid,
                        len(ticket.fds))
            ticket.close()

    def close(self) -> None:
        for key in list(self._tickets):
            self._drop(key).close()
