"""The fd socket's daemon half: where an engine hands the daemon its pool's descriptors
(SCM_RIGHTS) and gets back a one-time ticket for its Register call. The protocol, and the engine's
half (``request_ticket``, ``request_lane_ticket``), are in ``kvserver.protocol.fd_socket``.

The daemon reads the peer's pid, uid and gid (SO_PEERCRED), keeps the descriptors under a random
ticket (tickets.py) and answers ``b"T" + ticket``; on anything else it answers
``b"E" + <status code name> + b" " + message`` and closes every descriptor it got. Either way it
then closes the connection, but for a lane ticket's doorbell (a connection whose first message is
``BELL_MAGIC``): checked and answered ``b"B"``, that is kept under its ticket as the daemon's end
of the doorbell (``_doorbell``; at its accept when its first message is there, ``_doorbell_now``).

Every socket is non-blocking and served on the event loop (``add_reader``); a connection that has
not finished within ``CONN_SECONDS`` is dropped, and the daemon holds at most ``MAX_CONNS``
connections at once, at most ``MAX_CONNS_PER_UID`` of one uid, so no peer can stall another.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import stat
import struct

from kvserver.errors import InvalidArgument, KVError, NoCapacity
from kvserver.peers.tickets import (
    PEER_GONE,
    RIGHTS_SPACE,
    SO_PASSRIGHTS,
    PeerCred,
    TicketBook,
    close_off_loop,
    closing_for,
    drain,
    fds_of,
    is_shared_memory,
    pending_for,
    socket_kind,
)
from kvserver.protocol.fd_socket import (
    BELL_HEADER,
    BELL_MAGIC,
    CLOSES_BEHIND,
    FDS_PER_MESSAGE,
    HEADER,
    LANE_HEADER,
    LANE_MAGIC,
    MAGIC,
    MAX_DOORBELLS,
    MAX_FDS,
    MORE,
    TICKET_CHARS,
    TOO_MANY_CONNS,
)

logger = logging.getLogger(__name__)

CONN_SECONDS = 5.0
MAX_CONNS = 64
MAX_CONNS_PER_UID = 8
STUCK_SECONDS = 1.0  # a uid whose closer is this long in one close gets no connection
MAX_PENDING_CLOSES = 1024  # a uid with this many descriptors waiting on its closer gets no connection
ACCEPTS_PER_TURN = 16  # connections one wake-up of the loop accepts at most (a flood waits its turn)
BACKLOG = 1024  # connections the kernel queues (as many as somaxconn allows): an engine's waits there
ACCEPT_RETRY_SECONDS = 0.5  # out of descriptors (EMFILE): how long before it accepts again
_PEERCRED = struct.Struct("3i")
# SO_PEERPIDFD (Linux 6.5): a pidfd of the process that connected, which a pid reused after it
# exits never names; where the kernel lacks it, pidfd_open of its pid right at the accept.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def _is_pidfd(fd: int) -> bool:
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return name == "anon_inode:[pidfd]" or name.startswith("pidfd:")


def _peer_pidfd(conn: socket.socket, pid: int) -> int:
    """A pidfd of the process on the other end of ``conn`` (close-on-exec), or ``PEER_GONE`` where
    that process was gone already, or -1 where this kernel gives none (the lane then opens a pidfd
    by pid when the ticket is redeemed, as before pidfds of peers)."""
    try:
        fd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ESRCH):  # the kernel has it: the peer was reaped
            return PEER_GONE
        if exc.errno != errno.ENOPROTOOPT:
            return -1
        try:
            return os.pidfd_open(pid)  # close-on-exec already
        except ProcessLookupError:
            return PEER_GONE
        except OSError:
            return -1
    if not _is_pidfd(fd):  # an option 77 that means something else here: not ours to keep
        os.close(fd)
        return -1
    os.set_inheritable(fd, False)
    return fd


class PeerSocket:
    """Listens on ``path`` and issues tickets into ``tickets``."""

    def __init__(self, path: str, mode: int, tickets: TicketBook) -> None:
        self.path = path
        self.mode = mode
        self.tickets = tickets
        self.conn_seconds = CONN_SECONDS
        self._sock: socket.socket | None = None
        self._serving: set[asyncio.Task] = set()
        self._per_uid: dict[int, int] = {}

    def start(self) -> None:
        """Listens; a socket left at ``path`` (the gRPC socket's check found no live daemon: a
        crash's leftover) is replaced. Anything else there is kept and refused (OSError)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise FileExistsError(errno.EEXIST, "not a socket (kept: only a socket a stopped daemon "
                                      "left is replaced)", self.path)
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)  # owner-only from the first moment, as the gRPC socket
        try:
            sock.bind(self.path)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    async def stop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for task in list(self._serving):
            task.cancel()
        if self._serving:
            await asyncio.wait(self._serving)
        self.tickets.close()

    # ---- connections ------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):  # the rest at the loop's next turn: the socket reads ready
            if self._sock is None:
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the connection stays queued
                # The reader would be called again at once, and fail again, for as long as the
                # daemon has no descriptor: a core spinning. It listens again a while later.
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._sock.fileno())
                loop.call_later(ACCEPT_RETRY_SECONDS, self._listen_again)
                logger.warning("fd socket accept failed: %s; accepting again in %g s", exc.strerror,
                               ACCEPT_RETRY_SECONDS)
                return
            conn.setblocking(False)
            try:
                pid, uid, gid = _PEERCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                close_off_loop([conn.detach()])
                continue
            peer = PeerCred(pid, uid, gid)
            if pending_for(uid) >= MAX_PENDING_CLOSES:
                # Its closer is behind: nothing more of it is read (what the connection holds goes
                # with it, unread, on that closer) until the closer catches up.
                behind = f"{pending_for(uid)} descriptors this uid sent are waiting to be closed"
                _reply(conn, _error(NoCapacity(f"{behind}; {CLOSES_BEHIND}")), uid)
                continue
            if closing_for(uid) >= STUCK_SECONDS:
                # What it sent queues behind that close (on its own closer): no new connection adds to it.
                stuck = closing_for(uid)
                _reply(conn, _error(NoCapacity(
                    f"a descriptor this uid sent has taken {stuck:.0f} s to close so far (a file on FUSE "
                    "whose server does not answer?); no more are taken from it until it closes")), uid)
                continue
            if self._doorbell_now(conn, peer):
                continue
            if len(self._serving) >= MAX_CONNS or self._per_uid.get(uid, 0) >= MAX_CONNS_PER_UID:
                _reply(conn, _error(NoCapacity(TOO_MANY_CONNS)), uid)
                continue
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
            counted = [True]  # until _serve gives it back (or its task ends without running)
            task = asyncio.get_running_loop().create_task(self._serve(conn, peer, counted))
            self._serving.add(task)
            task.add_done_callback(lambda t, uid=uid, counted=counted: self._served(t, uid, counted))

    def _doorbell_now(self, conn: socket.socket, peer: PeerCred) -> bool:
        """Serves at once, here, a connection whose first message has come and is a doorbell's
        (``BELL_MAGIC``): an engine connects all its lane's doorbells at once, and a doorbell's
        check takes no wait, so none counts among its uid's connections or waits for a task of
        its own. False (nothing read) for any other connection."""
        try:
            if conn.recv(len(BELL_MAGIC), socket.MSG_PEEK | socket.MSG_DONTWAIT) != BELL_MAGIC:
                return False  # (a peek installs no descriptor)
        except OSError:
            return False
        fds: list[int] = []
        try:
            first = _read_message(conn, fds)
            self._doorbell(conn, peer, first, fds)
            return True
        except KVError as exc:
            reply: bytes | None = _error(exc)
        except (_Closed, BlockingIOError, InterruptedError):
            reply = None
        close_off_loop(fds, peer.uid)
        _reply(conn, reply, peer.uid)
        return True

    def _listen_again(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept)

    def _served(self, task: asyncio.Task, uid: int, counted: list[bool]) -> None:
        self._serving.discard(task)
        self._uncount(uid, counted)

    def _uncount(self, uid: int, counted: list[bool]) -> None:
        if counted[0]:
            counted[0] = False
            self._per_uid[uid] -= 1
            if not self._per_uid[uid]:
                del self._per_uid[uid]

    async def _serve(self, conn: socket.socket, peer: PeerCred, counted: list[bool]) -> None:
        fds: list[int] = []
        reply: bytes | None = None
        pidfd = -1
        try:
            pidfd = _peer_pidfd(conn, peer.pid)  # here: a task cancelled before it runs holds none
            async with asyncio.timeout(self.conn_seconds):
                first = await self._message(conn, fds)
                if first[:4] == BELL_MAGIC:  # a doorbell of a lane ticket: kept, not answered and closed
                    self._doorbell(conn, peer, first, fds)
                    conn = None
                    return
                bells = await self._receive(conn, fds, first)
            reply = b"T" + self.tickets.issue(peer, fds, pidfd, bells).encode()
            fds, pidfd = [], -1  # the ticket owns them now
        except TimeoutError:
            reply = _error(InvalidArgument(f"the message did not arrive within {self.conn_seconds} s"))
        except KVError as exc:
            reply = _error(exc)
        except _Closed:
            pass
        except Exception:
            logger.exception("fd socket connection from pid %d failed", peer.pid)
        finally:
            close_off_loop(fds, peer.uid)  # a refused peer's descriptors: maybe the last hold on a big memfd
            if pidfd >= 0:
                os.close(pidfd)
            if conn is not None:
                _reply(conn, reply, peer.uid)
            # Given back now, not a loop turn later when its task's end is seen: an engine
            # connecting again right after its answer is not counted twice.
            self._uncount(peer.uid, counted)

    def _doorbell(self, conn: socket.socket, peer: PeerCred, first: bytes, fds: list[int]) -> None:
        """A connection that is one of a lane ticket's doorbells (its first message ``BELL_MAGIC``,
        the doorbell's index and the ticket): checked, answered ``B`` and kept under the ticket as
        the daemon's end. That end was made by this daemon's accept and no one else holds it: no
        peer can hold its read lock or turn SO_PASSRIGHTS on again through it. Raises KVError
        (the connection is then answered and closed, as any refused one)."""
        if len(first) != BELL_HEADER.size + TICKET_CHARS or fds:
            raise InvalidArgument(f"a doorbell's first message is {BELL_HEADER.size + TICKET_CHARS} bytes "
                                  "(its index and its ticket), without descriptors")
        _, index = BELL_HEADER.unpack_from(first)
        key = first[BELL_HEADER.size:].decode(errors="replace")
        self.tickets.check_doorbell(key, index, peer)
        # No descriptor can come down it from now on (where the kernel has SO_PASSRIGHTS), and it
        # must hold nothing now: what came before with descriptors goes unread, with it, on the
        # uid's closer.
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
        try:
            conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            pass
        else:
            raise InvalidArgument("a doorbell holds messages after its first (or its peer closed it): "
                                  "connect a new one")
        try:
            conn.send(b"B", socket.MSG_DONTWAIT)
        except OSError as exc:
            raise _Closed from exc
        self.tickets.attach_doorbell(key, index, conn.detach())

    async def _receive(self, conn: socket.socket, fds: list[int], data: bytes) -> int:
        """Reads, after the first message ``data``, every announced descriptor into ``fds``;
        returns the number of doorbells a lane ticket is to hold (0 for a plain ticket)."""
        if len(data) == HEADER.size and data[:4] == MAGIC:
            (_, n), bells = HEADER.unpack(data), 0
        elif len(data) == LANE_HEADER.size and data[:4] == LANE_MAGIC:
            _, n, bells = LANE_HEADER.unpack(data)
            if not 1 <= bells <= MAX_DOORBELLS:
                raise InvalidArgument(f"{bells} doorbells asked for; a lane takes 1 to {MAX_DOORBELLS}")
        else:
            raise InvalidArgument(f"expected the {HEADER.size}-byte header starting {MAGIC!r} (or the "
                                  f"{LANE_HEADER.size}-byte one starting {LANE_MAGIC!r})")
        if n > MAX_FDS:
            raise InvalidArgument(f"{n} descriptors announced; at most {MAX_FDS} per ticket")
        while True:
            if len(fds) > n:
                raise InvalidArgument(f"{len(fds)} descriptors sent but {n} announced")
            if len(fds) == n:
                return bells
            if await self._message(conn, fds) != MORE:
                raise InvalidArgument(f"expected {MORE!r} with more descriptors ({len(fds)} of {n} so far)")

    async def _message(self, conn: socket.socket, fds: list[int]) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            try:
                return _read_message(conn, fds)
            except (BlockingIOError, InterruptedError):
                pass
            await _readable(loop, conn)


def _read_message(conn: socket.socket, fds: list[int]) -> bytes:
    """The next message of ``conn``, its descriptors added to ``fds`` (then checked); raises
    BlockingIOError when none has come, _Closed when the peer left, KVError for what is refused."""
    try:
        data, anc, flags, _ = conn.recvmsg(64, RIGHTS_SPACE, socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError):
        raise
    except OSError as exc:
        raise _Closed from exc
    got = fds_of(anc)
    fds.extend(got)
    for i, fd in enumerate(got, len(fds) - len(got)):
        why = _unusable(fd)
        if why:
            raise InvalidArgument(f"descriptor {i} is {why}: a ticket carries shared memory only (a "
                                  "pool's buffers, a lane's ring: memfds, or files on tmpfs or "
                                  "hugetlbfs); a lane's doorbells are connected to this socket, not sent")
    if flags & socket.MSG_CTRUNC:
        # The control buffer holds FDS_PER_MESSAGE descriptors: truncated short of that, the
        # kernel could not install them here (this process is at its descriptor limit).
        if len(got) < FDS_PER_MESSAGE or _out_of_descriptors():
            raise NoCapacity("the daemon is out of descriptors (its limit is "
                             f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): try again later")
        raise InvalidArgument(f"more than {FDS_PER_MESSAGE} descriptors in one message")
    if flags & socket.MSG_TRUNC:
        raise InvalidArgument("fd socket message too long")
    if not data and not anc:
        raise _Closed
    return data


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


def _out_of_descriptors() -> bool:
    """Whether this process can open no descriptor now: the kernel truncates the descriptors of
    a message it cannot install (MSG_CTRUNC), which is otherwise a peer's oversized message."""
    try:
        os.close(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


def _unusable(fd: int) -> str:
    """Why a peer's descriptor is none a pool or a lane can use ('' if it is one: shared memory).
    Checked before a ticket keeps it: a descriptor of another kind (a TCP socket set to linger, a
    file on a slow file system) could block whoever closes it, and a socket is no lane's doorbell
    (those are connected to this socket). Nothing here calls into a file system (any user can
    mount a FUSE one whose server never answers): shared memory is what takes seals, a socket
    what answers SO_TYPE; anything else is named from its /proc link."""
    if is_shared_memory(fd):
        return ""
    if socket_kind(fd) is not None:
        return "a socket"
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        return f"unusable ({exc.strerror})"
    if link.startswith("pipe:"):
        return "a pipe"
    return "a file outside shared memory" if link.startswith("/") else f"not a file ({link.split(':')[0]})"


class _Closed(Exception):
    """The peer went away mid-message: nothing to answer."""


def _error(exc: KVError) -> bytes:
    return b"E" + f"{exc.code.name} {exc}".encode()[:1024]


def _reply(conn: socket.socket, reply: bytes | None, uid: int) -> None:
    """Answers (if ``reply``) and closes the connection. Whatever the peer (of ``uid``) sent that
    was not read goes first: a Unix socket closed with unread data resets its peer, which would
    then lose the answer. Its descriptors are installed and closed on the uid's closer, as is the
    connection itself (its queue may hold more): released here, a file on FUSE could hold the
    loop on its server. Nothing is read from a uid whose closer is behind."""
    if pending_for(uid) < MAX_PENDING_CLOSES:
        drain(conn, uid)
    if reply is not None:
        with contextlib.suppress(OSError):
            conn.send(reply)
    close_off_loop([conn.detach()], uid)
