"""One-time peer tickets: the credentials and descriptors an engine handed over the fd socket,
held under a random ticket until the Register call that names it (see kvserver.peers.fd_socket).

A ticket is spent by the first Register that names it, whether that registration succeeds or
not; one nobody redeems expires and its descriptors are closed. Runs on the event loop thread.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import resource
import secrets
import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvserver.errors import InvalidArgument, NoCapacity, PermissionDenied
from kvserver.protocol.fd_socket import FDS_PER_MESSAGE, MAX_FDS

logger = logging.getLogger(__name__)

TICKET_SECONDS = 30.0  # an unredeemed ticket's descriptors are closed this long after it was issued
MAX_TICKETS_PER_UID = 64  # outstanding (unredeemed) tickets one uid may hold
MAX_FDS_PER_UID = 4096  # descriptors one uid's unredeemed tickets may hold together


def fd_budget() -> int:
    """Descriptors all unredeemed tickets may hold together: a quarter of the process's limit, so
    that no peer can starve the daemon of the descriptors its sockets and mappings need."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 4)


def raise_fd_limit() -> int:
    """Raises the soft descriptor limit to the hard one (at startup); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            logger.warning("could not raise the descriptor limit from %d to %d", soft, want)
    return soft


CLOSERS = 2  # threads that close peers' descriptors, apart from every other worker
_LINGER_OFF = struct.pack("ii", 1, 0)


def is_shared_memory(fd: int) -> bool:
    """Whether ``fd`` is a file in shared memory (shmem: a memfd or a tmpfs file; hugetlbfs): the
    only files that take seals. No call into any file system."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


def socket_kind(fd: int) -> tuple[int, int] | None:
    """(family, type) of a socket ``fd``, None for anything else. No call into any file system."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return sock.family, sock.type
    finally:
        sock.detach()


def close_peer_fd(fd: int) -> None:
    """Closes a descriptor a peer sent, without letting it decide how long that takes where that
    can be helped: a socket is closed abortively (SO_LINGER 0), never waiting for a linger time the
    peer chose. (The close of a file on FUSE waits for its server: see ``close_off_loop``.)"""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        sock = None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
        except OSError:
            pass  # not an option of this kind of socket (Unix sockets never linger)
        sock.close()
        return
    try:
        os.close(fd)
    except OSError:
        logger.warning("closing a peer's fd %d failed", fd)


class _Closer:
    """Daemon threads of their own that close peers' descriptors: closing the last reference to
    a large memfd frees all of its pages, and no such close may hold the event loop or the default
    executor that Register's pool opening runs in."""

    def __init__(self, uid: int | None = None) -> None:
        # uid: a uid's one thread (closing_for reads its busy_since), which ends after
        # CLOSER_IDLE_SECONDS with nothing to close; None: the CLOSERS shared ones, for ever
        self._uid = uid
        self._queue: queue.SimpleQueue[tuple[int, list[int]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._most = CLOSERS if uid is None else 1
        self._name = "kvpeer-close" if uid is None else f"kvpeer-close-{uid}"
        self.busy_since: float | None = None  # when its (one) thread began the close under way
        self.pending = 0  # descriptors handed to it and not closed yet
        self.pending_of: Counter[int] = Counter()  # of those, by the uid that sent them

    def close(self, fds: list[int], uid: int = -1) -> None:
        with self._lock:
            if len(self._threads) < self._most:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                thread.start()
                self._threads.append(thread)
            self.pending += len(fds)
            self.pending_of[uid] += len(fds)
        self._queue.put((uid, fds))

    def _run(self) -> None:
        while True:
            if self._uid is None:
                uid, fds = self._queue.get()
            else:
                try:
                    uid, fds = self._queue.get(timeout=CLOSER_IDLE_SECONDS)
                except queue.Empty:
                    with _RISKY_LOCK:  # (close_off_loop queues under it: nothing comes in meanwhile)
                        if self._queue.empty():
                            if _RISKY.get(self._uid) is self:
                                del _RISKY[self._uid]
                            return
                    continue
            for fd in fds:
                if self._uid is not None:
                    self.busy_since = time.monotonic()
                try:
                    close_peer_fd(fd)
                except Exception:  # (the thread goes on with the others: its uid is never locked out)
                    logger.exception("closing a peer's fd %d failed", fd)
                self.busy_since = None
                with self._lock:
                    self.pending -= 1
                    self.pending_of[uid] -= 1
                    if not self.pending_of[uid]:
                        del self.pending_of[uid]


_CLOSER = _Closer()
CLOSER_IDLE_SECONDS = 30.0  # a uid's closer thread ends after this long with nothing to close
# Descriptors other than shared memory (refused ones, sockets: a doorbell, the fd socket's own
# connections) are closed on a thread of their sender's uid: close(2) of a file on FUSE sends a
# FLUSH that its server (maybe the peer itself) can leave unanswered for ever, the last close of a
# socket releases what its queue holds, and the thread waits with it, unkillably. So one uid's
# such file holds only that uid's closes, never other peers' memfds; and
# the fd socket takes no more descriptors of a uid whose closer has been in one close too long.
_RISKY: dict[int, _Closer] = {}
_RISKY_LOCK = threading.Lock()


def close_off_loop(fds: list[int], uid: int = -1) -> None:
    """Closes ``fds``, descriptors a peer (of ``uid``, where known) sent, on the closer threads
    (never the loop's): shared memory on the shared ones, anything else on the uid's own. A
    socket counts as anything else: the last close of one drops what its queue holds, and a
    descriptor of a file on FUSE released there may wait on its server (a writeback)."""
    safe: list[int] = []
    risky: list[int] = []
    for fd in fds:
        (safe if is_shared_memory(fd) else risky).append(fd)
    if safe:
        _CLOSER.close(safe, uid)
    if risky:
        with _RISKY_LOCK:
            closer = _RISKY.get(uid)
            if closer is None:
                closer = _RISKY[uid] = _Closer(uid)
            closer.close(risky, uid)


SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)  # Linux 6.16: a socket that takes no descriptors
RIGHTS_SPACE = socket.CMSG_SPACE(FDS_PER_MESSAGE * 4)  # a control buffer for one message's descriptors


def fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors SCM_RIGHTS control messages carried (now open in this process)."""
    out: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            out.extend(got)
    return out


DRAIN_FDS = MAX_FDS  # descriptors a drain takes at most: what one ticket carries


def drain(sock: socket.socket, uid: int, most: int = 64) -> None:
    """Reads what ``sock`` (a Unix socket a peer of ``uid`` writes to) holds, up to ``most``
    messages and ``DRAIN_FDS`` descriptors, never blocking, its descriptors installed and closed
    on the uid's closer: dropping them unread would release them here, and a file on FUSE
    released may wait on its server. What is left goes with the socket, closed on that closer."""
    taken = 0
    for _ in range(most):
        if taken >= DRAIN_FDS:
            return
        try:
            data, anc, _, _ = sock.recvmsg(64, RIGHTS_SPACE, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
        except OSError:  # nothing more (EAGAIN), or the socket is gone
            return
        fds = fds_of(anc)
        taken += len(fds)
        close_off_loop(fds, uid)
        if not data and not anc:  # end of stream
            return


def pending_for(uid: int) -> int:
    """Descriptors of ``uid``'s waiting to be closed: on its own closer, and the shared memory it
    sent on the shared ones (which a peer sending the same memfd again and again outpaced: the
    daemon held thousands waiting)."""
    closer = _RISKY.get(uid)
    return (0 if closer is None else closer.pending) + _CLOSER.pending_of.get(uid, 0)


def closing_for(uid: int) -> float:
    """Seconds the closer of ``uid``'s descriptors has been in the close under way (0: none)."""
    closer = _RISKY.get(uid)
    since = closer.busy_since if closer is not None else None
    return 0.0 if since is None else time.monotonic() - since


def process_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd reads readable; its pid may name
    another process by now). ``poll``, not ``select``: a daemon holding many peers' descriptors has
    pidfds past select's 1024."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


# Ticket.pidfd where the fd socket found the peer gone already (it exited before its ticket).
PEER_GONE = -2


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
    # A pidfd of the process that connected to the fd socket, taken at the connection: unlike its
    # pid, it never names another process, whatever runs between then and the redeem. -1: none
    # (no pidfds of peers in this kernel); PEER_GONE: that process was gone already.
    pidfd: int = -1
    held: int = 0  # descriptors it counts against the book's budgets (its fds, doorbells and pidfd)
    # A lane ticket's doorbells (the fd socket's KVF2), the submit doorbell's first: the daemon's
    # ends, the connections it accepted for them (KVB1), no peer ever held; -1 until connected.
    doorbells: list[int] = field(default_factory=list)

    def take_pidfd(self) -> int:
        """The pidfd, the caller's to close from now on (-1: none; PEER_GONE)."""
        fd, self.pidfd = self.pidfd, -1
        return fd

    def drop_pidfd(self) -> None:
        fd = self.take_pidfd()
        if fd >= 0:
            os.close(fd)

    def take_doorbells(self) -> list[int]:
        """The daemon's ends of the doorbells connected so far, the caller's to close from now on."""
        bells, self.doorbells = self.doorbells, []
        return [fd for fd in bells if fd >= 0]

    def close(self) -> None:
        """Closes every descriptor the ticket holds, here (idempotent): at shutdown only."""
        self.drop_pidfd()
        fds, self.fds = self.fds, []
        for fd in fds + self.take_doorbells():
            close_peer_fd(fd)

    def close_mapped(self, mapped: set[int]) -> None:
        """Closes the ticket's descriptors once a pool is open: those it maps (by index) here,
        since its mappings hold their memory and closing them frees nothing; the others on the
        closer threads, since one of them may be the last hold on a large memfd."""
        self.drop_pidfd()
        fds, self.fds = self.fds, []
        for i, fd in enumerate(fds):
            if i in mapped:
                close_peer_fd(fd)
        close_off_loop([fd for i, fd in enumerate(fds) if i not in mapped] + self.take_doorbells(),
                       self.peer.uid)

    def close_off_loop(self) -> None:
        """Closes every descriptor the ticket holds on the closer threads (a doorbell's queue,
        where the kernel lets a peer send descriptors down it, may hold some)."""
        self.drop_pidfd()
        fds, self.fds = self.fds, []
        close_off_loop(fds + self.take_doorbells(), self.peer.uid)


class TicketBook:
    """Outstanding tickets, by ticket string."""

    def __init__(self, ttl: float = TICKET_SECONDS, max_per_uid: int = MAX_TICKETS_PER_UID,
                 max_fds_per_uid: int = MAX_FDS_PER_UID, max_fds: int | None = None) -> None:
        self.ttl = ttl
        self.max_per_uid = max_per_uid
        self.max_fds_per_uid = max_fds_per_uid
        self.max_fds = fd_budget() if max_fds is None else max_fds
        self._tickets: dict[str, Ticket] = {}
        self._per_uid: Counter[int] = Counter()
        self._fds_per_uid: Counter[int] = Counter()
        self.num_fds = 0  # descriptors held by unredeemed tickets
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the tickets' timers run on

    def __len__(self) -> int:
        return len(self._tickets)

    def issue(self, peer: PeerCred, fds: list[int], pidfd: int = -1, doorbells: int = 0) -> str:
        """A new ticket holding ``fds`` and the peer's ``pidfd`` (the book owns them once it
        returns; if it raises, they stay the caller's to close), and room for ``doorbells`` the
        peer then connects (``attach_doorbell``)."""
        if self._per_uid[peer.uid] >= self.max_per_uid:
            raise NoCapacity(
                f"uid {peer.uid} already holds {self.max_per_uid} unredeemed tickets; "
                "register with them or let them expire"
            )
        n = len(fds) + doorbells + (pidfd >= 0)
        if self._fds_per_uid[peer.uid] + n > self.max_fds_per_uid or self.num_fds + n > self.max_fds:
            raise NoCapacity(
                f"too many descriptors held by unredeemed tickets ({self._fds_per_uid[peer.uid]} of uid "
                f"{peer.uid}, at most {self.max_fds_per_uid}; {self.num_fds} in all, at most "
                f"{self.max_fds}): register with them or let them expire"
            )
        key = secrets.token_hex(16)
        ticket = Ticket(peer, list(fds), pidfd=pidfd, held=n, doorbells=[-1] * doorbells)
        self._tickets[key] = ticket
        self._per_uid[peer.uid] += 1
        self._fds_per_uid[peer.uid] += n
        self.num_fds += n
        loop = self._loop = asyncio.get_running_loop()
        ticket.expiry = loop.call_later(self.ttl, self._expire, key)
        if pidfd >= 0:  # a process gone before its Register: its descriptors (its pool) go now
            with contextlib.suppress(OSError, ValueError):  # (else at its expiry, as before)
                loop.add_reader(pidfd, self._expire, key, "its process exited")
        return key

    def check_doorbell(self, key: str, index: int, peer: PeerCred) -> None:
        """Raises unless ``peer`` may connect doorbell ``index`` of ticket ``key``: the ticket's own
        process (same pid and uid), a doorbell the ticket holds and that is not connected yet."""
        ticket = self._tickets.get(key)
        if ticket is None or (ticket.peer.pid, ticket.peer.uid) != (peer.pid, peer.uid):
            raise PermissionDenied("a doorbell names a ticket that is unknown, expired, used, or another "
                                   "process's: connect it right after the lane ticket")
        if not 0 <= index < len(ticket.doorbells):
            raise InvalidArgument(f"doorbell {index} of a ticket of {len(ticket.doorbells)} doorbells")
        if ticket.doorbells[index] >= 0:
            raise InvalidArgument(f"doorbell {index} of this ticket is connected already")

    def attach_doorbell(self, key: str, index: int, fd: int) -> None:
        """Keeps ``fd`` as the daemon's end of doorbell ``index`` of ticket ``key`` (checked by
        ``check_doorbell`` just before, with nothing awaited since)."""
        self._tickets[key].doorbells[index] = fd

    def redeem(self, key: str, pidfd: bool = False) -> Ticket:
        """The ticket, removed from the book: the caller closes its fds once done with them.
        Its pidfd is closed here unless the caller asks for it (``pidfd``: then ``take_pidfd``)."""
        ticket = self._tickets.get(key) if key else None
        if ticket is None:
            raise PermissionDenied(
                "peer_ticket is unknown, expired or already used: get a fresh one from the daemon's "
                "fd socket right before each Register"
            )
        self._drop(key)
        if not pidfd:
            ticket.drop_pidfd()
        return ticket

    def _drop(self, key: str) -> Ticket:
        ticket = self._tickets.pop(key)
        uid = ticket.peer.uid
        self._per_uid[uid] -= 1
        self._fds_per_uid[uid] -= ticket.held
        self.num_fds -= ticket.held
        if not self._per_uid[uid]:
            del self._per_uid[uid], self._fds_per_uid[uid]
        if ticket.expiry is not None:
            ticket.expiry.cancel()
        if ticket.pidfd >= 0 and self._loop is not None:  # (the ticket holds it open: no one else's)
            with contextlib.suppress(Exception):  # (a loop closed already: it reads nothing more)
                self._loop.remove_reader(ticket.pidfd)
        return ticket

    def _expire(self, key: str, why: str = "unredeemed") -> None:
        if key in self._tickets:
            ticket = self._drop(key)
            logger.info("a ticket of pid %d expired (%s); %d fds closed", ticket.peer.pid, why,
                        len(ticket.fds))
            ticket.close_off_loop()

    def close(self) -> None:
        for key in list(self._tickets):
            self._drop(key).close()
