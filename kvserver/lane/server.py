"""The daemon's half of the data-plane fast lane: one ``Lane`` per registration that opened one,
and per scheduler's lane of a KV space (its Lookups: ``LaneBook.open_space``).

Where the compiled data plane runs (kvserver.lane.plane), its thread watches the doorbell and
serves binary Writes and Loads itself; what it hands over comes to ``take`` and is served below.
Else a lane watches its submit doorbell on the event loop (``add_reader``). Each wake-up drains the
doorbell (at most ``MAX_DRAIN`` messages) and looks once at every slot the lane is not already
serving: a SUBMITTED one has its request copied into private memory, is marked TAKEN and served by
a task that runs the very code the gRPC RPC runs (``run``), unless ``fast`` serves it at once, with
the same code's checks and plan and no task (a Get, Put or Lookup it can serve whole: ``Fast``).
So a lane has at most ``slots`` requests in flight, and a peer scribbling on its ring or ringing
its doorbell without end only costs itself bounded work per wake-up. The layout is in
``kvserver.protocol.ring``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvserver.core.kvcore import settle
from kvserver.errors import (
    Code,
    DeadlineExceeded,
    FailedPrecondition,
    GpuStalled,
    InvalidArgument,
    KVError,
    status_of,
)
from kvserver.protocol import ring as R
from kvserver.protocol.shared_memory import ShmMapping, map_sealed_fd

logger = logging.getLogger(__name__)

MAX_DRAIN = 64  # doorbell messages read per wake-up
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

# run(rpc name, request bytes, progress callback) -> response bytes; raises as the RPC would.
Runner = Callable[[str, bytes, Callable[[Any], None]], Awaitable[bytes]]
# fast(lane, slot, rpc id, request bytes, counted) -> True: a handed-over Get, Put or Lookup served
# without a task (the data plane copies a Get or Put; it or the loop answers the slot:
# ``Lane.answered`` follows either way); False: not one for that path, nothing was changed,
# ``take`` serves it.
Fast = Callable[["Lane", int, int, bytes, bool], bool]
_FAST = frozenset((R.RPC_GET, R.RPC_PUT, R.RPC_LOOKUP))  # what take() offers it


def _peer_left(sock: socket.socket) -> bool:
    """Whether the peer of a Unix SOCK_SEQPACKET socket has closed its end (POLLRDHUP or POLLHUP)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))


def ring_features(ring: ShmMapping) -> int:
    """The features word of an opened ring's header (R.FEATURE_*): read once, when the lane is
    added; what the client writes there later is not read again."""
    return R.U32.unpack_from(ring.mm, R.FEATURES_AT)[0]


def open_ring(fds: list[int], doorbells: list[int]) -> tuple[ShmMapping, socket.socket, list[socket.socket]]:
    """Checks and takes over a ticket's descriptors: (ring, submit doorbell, done doorbells).
    ``fds``: what the peer sent, the ring alone; ``doorbells``: the daemon's ends of the ticket's
    doorbells, the connections the fd socket accepted for them (a doorbell a peer sent is refused:
    a peer holding a copy of the daemon's end could hold its read lock, or take descriptors down
    it again). The caller keeps both lists and closes them if this raises; on success they belong
    to the results (the ring's descriptor is closed, its mapping kept)."""
    if len(fds) != 1 or len(doorbells) < 2:
        raise InvalidArgument(
            f"a lane takes its ring alone ({len(fds)} descriptors sent) and the doorbells the daemon "
            f"accepted for its ticket ({len(doorbells)}; at least two): ask the fd socket for a lane "
            "ticket (kvserver.protocol.fd_socket.request_lane_ticket)")
    if -1 in doorbells:
        raise InvalidArgument(f"doorbell {doorbells.index(-1)} of the lane's ticket was never connected")
    try:
        seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise FailedPrecondition("the lane's ring must be a memfd sealed with F_SEAL_SHRINK, F_SEAL_GROW "
                                 "and F_SEAL_SEAL")
    try:
        size = os.fstat(fds[0]).st_size
    except OSError:
        size = 0  # map_sealed_fd says why it cannot be used
    if size > R.ring_bytes(R.MAX_SLOTS):  # refused unmapped: a sparse memfd can be as large as it likes
        raise InvalidArgument(f"the lane's ring is {size} bytes; {R.MAX_SLOTS} slots take "
                              f"{R.ring_bytes(R.MAX_SLOTS)}")
    ring = map_sealed_fd(fds[0], "the lane's ring")
    try:
        if ring.size < R.HEADER.size:
            raise InvalidArgument(f"the lane's ring is {ring.size} bytes: smaller than its header")
        magic, version, slots, slot_bytes, req, resp, err = R.HEADER.unpack(bytes(ring.mm[: R.HEADER.size]))
        if magic != R.MAGIC or version != R.VERSION:
            raise InvalidArgument(f"the lane's ring has magic {magic!r} version {version}; expected "
                                  f"{R.MAGIC!r} version {R.VERSION}")
        if (slot_bytes, req, resp, err) != (R.SLOT_BYTES, R.REQUEST_BYTES, R.RESPONSE_BYTES, R.ERROR_BYTES):
            raise InvalidArgument("the lane's ring has another slot layout than this daemon's")
        if not 1 <= slots <= R.MAX_SLOTS:
            raise InvalidArgument(f"the lane's ring has {slots} slots; 1 to {R.MAX_SLOTS}")
        if ring.size != R.ring_bytes(slots):
            raise InvalidArgument(f"the lane's ring is {ring.size} bytes; {slots} slots take "
                                  f"{R.ring_bytes(slots)}")
        if len(doorbells) != 1 + slots:
            raise InvalidArgument(f"{len(doorbells)} doorbells for a ring of {slots} slots; expected "
                                  f"{1 + slots}")
        socks = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd) for fd in doorbells]
    except BaseException:
        ring.close()
        raise
    os.close(fds[0])
    return ring, socks[0], socks[1:]


class Lane:
    """``owner``: what logs name the lane by. ``close_when_gone``: the lane closes itself when its
    peer closes its end of the submit doorbell, or when the process ``peer_gone_fd`` (a pidfd the
    lane owns; -1: none) exits (a space's lane, which no registration's release closes); a
    registration's lane is closed by that release. A space's lane drains at most ``slots + 1``
    doorbell messages a wake-up."""

    def __init__(self, owner: str, ring: ShmMapping, submit: socket.socket, done: list[socket.socket],
                 run: Runner, on_served: Callable[[], None] | None = None, *,
                 close_when_gone: bool = False, peer_gone_fd: int = -1, fast: Fast | None = None) -> None:
        self.owner = owner
        self.close_when_gone = close_when_gone
        self._closing: asyncio.Task | None = None
        self._gone_fd = peer_gone_fd
        self._max_drain = len(done) + 1 if close_when_gone else MAX_DRAIN
        self.slots = len(done)
        self._mm = ring.mm
        self._ring = ring
        self._submit = submit
        self._done = done
        self._run = run
        self._fast = fast
        self._tasks: list[asyncio.Task | None] = [None] * self.slots
        self._watching = False
        self._closed = False
        self.served = 0
        self.on_close: Callable[[Lane], None] | None = None  # when its close begins
        self.on_closed: Callable[[Lane], None] | None = None  # when its close has ended
        self._ended: asyncio.Future | None = None  # done once close has released everything
        # The compiled data plane watching this lane (kvserver.lane.plane), if any: it reads the
        # doorbell and hands over, through take(), what it does not serve itself. on_served is
        # called once for each of those handed-over requests that the plane counted (the copies:
        # a Lookup holds none of the registration's copies off) when it has ended.
        self._plane: Any = None
        self._counted = [False] * self.slots  # per handed-over slot: on_served is owed at its end
        self._handle = 0
        # Done once the plane's thread has let go of the ring and the doorbells (DataPlane.remove):
        # until then close() keeps them.
        self._removal: asyncio.Future | None = None
        self._adding: asyncio.Future | None = None  # its opening on the plane (DataPlane.add)
        self.plane_key = 0  # its key on the plane (never reused)
        self.gate: Any = None  # its gate there
        self._on_served = on_served
        # Read once: the data plane rings this ring's done doorbells only for a sleeping client.
        self.quiet_done = bool(ring_features(ring) & R.FEATURE_QUIET_DONE)

    @property
    def ring_address(self) -> int:
        """Where the ring is mapped (valid until close unmaps it; no export of it is kept)."""
        view = ctypes.c_char.from_buffer(self._mm)
        try:
            return ctypes.addressof(view)
        finally:
            del view

    @property
    def submit_fd(self) -> int:
        return self._submit.fileno()

    @property
    def done_fds(self) -> list[int]:
        return [s.fileno() for s in self._done]

    async def start(self, plane: Any = None, gate: Any = None) -> None:
        """Starts serving: on the data plane's thread with ``gate`` (put there off the event loop,
        ``DataPlane.add``; its error raised: OSError, the thread cannot watch the doorbell), else
        on the loop. A caller cancelled meanwhile has the opening waited out and undone (the lane
        off the plane again) before CancelledError: it may let go of the ring and the doorbells.
        A close meanwhile (its registration's release) waits for the opening, then undoes it."""
        self._submit.setblocking(False)
        loop = asyncio.get_running_loop()
        if plane is not None and gate is not None:
            self._plane = plane
            self.gate = gate
            handle, adding = plane.add(self, gate)
            self._handle = handle  # (an answer to a request the plane hands over names the lane by it)
            self._adding = adding
            adding.add_done_callback(self._added)  # first: before any waiter of it resumes
            if await settle(adding):  # undone as a close undoes it (what it handed over too)
                closing = asyncio.ensure_future(self.close())
                await settle(closing)
                if closing.exception() is not None:
                    logger.error("closing a lane whose opening was cancelled failed",
                                 exc_info=closing.exception())
                raise asyncio.CancelledError
            adding.result()  # its error, if it failed
        else:
            loop.add_reader(self._submit.fileno(), self._doorbell)
            self._watching = True
        if self._gone_fd >= 0 and not self._closed:
            try:
                loop.add_reader(self._gone_fd, self._gone, "its process exited")
            except BaseException:
                self._unwatch(wait=True)  # the caller closes the ring and the doorbells at once
                raise

    def close_gone_fd(self) -> None:
        """Closes the pidfd of its peer's process, once (a failed opening's caller, or its close)."""
        if self._gone_fd >= 0:
            with contextlib.suppress(ValueError, RuntimeError):  # not watched, or no loop
                asyncio.get_running_loop().remove_reader(self._gone_fd)
            os.close(self._gone_fd)
            self._gone_fd = -1

    @property
    def was_on_plane(self) -> bool:
        """Whether the data plane's thread watched it (it may have copied for it)."""
        return self._adding is not None and self._adding.done() and self._adding.exception() is None

    def _added(self, adding: asyncio.Future) -> None:
        if adding.exception() is None:  # (never cancelled: DataPlane's command futures)
            self._watching = True
        else:  # freed: a lane made later may have its address
            self._handle = 0

    @property
    def closing(self) -> bool:
        """Whether its close has begun."""
        return self._closed

    def peer_closed(self) -> None:
        """The plane saw the peer close its end of the submit doorbell (a space's lane: it
        closes itself, as ``_doorbell`` closes one the loop watches)."""
        if self.close_when_gone:
            self._gone("its peer closed its end")

    def _gone(self, why: str) -> None:
        """The peer is gone (``close_when_gone``): the lane closes itself, no release will (and
        it is closed even if letting go of its doorbells fails: its close lets go of the rest)."""
        try:
            self._unwatch()
            if self._gone_fd >= 0:
                asyncio.get_running_loop().remove_reader(self._gone_fd)
        finally:
            if self._closing is None and not self._closed:
                logger.info("lane of %s closed: %s", self.owner, why)
                self._closing = asyncio.ensure_future(self.close())

    def _unwatch(self, wait: bool = False) -> None:
        if self._watching:
            self._watching = False
            if self._plane is not None:
                self._removal = self._plane.remove(self, self._handle, wait=wait)
                # Its handle names memory freed once the removal is done, which a lane opened later
                # may reuse: an answer still to come (a lane closing itself, not closed yet) finds
                # no lane.
                self._handle = 0
            else:
                asyncio.get_running_loop().remove_reader(self._submit.fileno())

    def take(self, i: int, rpc: int, counted: bool = True) -> None:
        """Serves slot ``i``, which the plane marked TAKEN and handed over as call ``rpc``: the id it
        read, by which it decided ``counted`` (in the gate's count of the loop's requests, which
        on_served gives back at its end); the peer may have written another id in the ring since."""
        if self._closed:  # the slot dies with the lane
            self._served_elsewhere(counted)
            return
        if self._tasks[i] is not None:  # cannot be: the plane hands a slot over once until released
            logger.error("the data plane handed over slot %d of %s twice", i, self.owner)
            self._served_elsewhere(counted)
            return
        self._counted[i] = counted
        off = R.slot_offset(i)
        mm = self._mm
        _, seq, n = R.CALL.unpack_from(mm, off + R.RPC_AT)
        data = bytes(mm[off + R.REQUEST_AT: off + R.REQUEST_AT + min(n, R.REQUEST_BYTES)])  # private copy
        if rpc in _FAST and self._fast is not None and n <= R.REQUEST_BYTES and not self._expired(i):
            try:
                if self._fast(self, i, rpc, data, counted):
                    return
            except Exception:  # Fast changes nothing before it says True: the task serves it
                logger.exception("the plane's Get or Put path failed on %s; the event loop serves it",
                                 self.owner)
        self._tasks[i] = asyncio.ensure_future(self._serve(i, rpc, seq, n, data))

    # ---- a Get or Put served without a task (Fast) -------------------------------------------

    @property
    def plane_handle(self) -> int:
        """This lane's handle on the data plane (0: none)."""
        return self._handle

    def answer_none_found(self, i: int, counted: bool) -> None:
        """Answers handed-over Get ``i`` that found no page: done, as ``_serve`` ends one."""
        self._answer(i, counted, R.FLAG_JOB_ENDED | R.FLAG_DONE, b"", 0, "")

    def answer_now(self, i: int, counted: bool, response: bytes, code: int = 0, message: str = "") -> None:
        """Answers handed-over request ``i`` (a Put, a Lookup, a failed Get) with ``response``, or
        ``code`` and ``message``, as ``_serve`` ends one: its count given back first, then the slot
        (nothing is written to a closed lane's ring)."""
        self._answer(i, counted, R.FLAG_JOB_ENDED, response[: R.RESPONSE_BYTES], code, message)

    def _answer(self, i: int, counted: bool, flags: int, response: bytes, code: int, message: str) -> None:
        self.answered(counted)
        if self._closed:
            return
        off = R.slot_offset(i)
        mm = self._mm
        seq = R.CALL.unpack_from(mm, off + R.RPC_AT)[1]
        text = message.encode()[: R.ERROR_BYTES]
        if flags & R.FLAG_DONE:
            R.PROGRESS.pack_into(mm, off + R.PROGRESS_AT, 0, 0, 0, 0, 0, 1, flags)
        else:
            R.U32.pack_into(mm, off + R.PROGRESS_AT + 28, flags)
        self._done_with(i, seq, code, response, text)

    def answered(self, counted: bool) -> None:
        """A request served through ``Fast`` has ended (its slot answered, or its lane gone)."""
        self.served += 1
        self._served_elsewhere(counted)

    def refuse(self, i: int, message: str, counted: bool = True) -> None:
        """Answers handed-over slot ``i`` with INTERNAL, never having run it."""
        self._served_elsewhere(counted)
        if self._closed:
            return
        off = R.slot_offset(i)
        mm = self._mm
        seq = R.CALL.unpack_from(mm, off + R.RPC_AT)[1]
        text = message.encode()[: R.ERROR_BYTES]
        R.U32.pack_into(mm, off + R.PROGRESS_AT + 28, R.FLAG_JOB_ENDED)
        self._done_with(i, seq, int(Code.INTERNAL), b"", text)

    def _done_with(self, i: int, seq: int, code: int, response: bytes, text: bytes) -> None:
        """Ends slot ``i``'s answer, its progress words already written: the response, the message,
        the status and ``seq``, then DONE (last: the client reads the rest once it sees it), then
        its doorbell. A slot the data plane handed over is given back to it before DONE (the
        client's next request in it is the plane's), all of it in one compiled call that rings
        the doorbell only for a client asleep on a quiet lane (docs/lane.md, "Ringing only a
        sleeper")."""
        if self._plane is not None:
            self._plane.finish_slot(self._handle, i, seq, code, response, text)
            return
        off = R.slot_offset(i)
        mm = self._mm
        mm[off + R.RESPONSE_AT: off + R.RESPONSE_AT + len(response)] = response
        mm[off + R.ERROR_AT: off + R.ERROR_AT + len(text)] = text
        R.RESULT.pack_into(mm, off + R.CODE_AT, code, len(response), len(text))
        R.DONE_SEQ.pack_into(mm, off + R.DONE_SEQ_AT, seq)
        R.U32.pack_into(mm, off + R.STATE, R.DONE)
        self._ring_done(i)

    def _served_elsewhere(self, counted: bool) -> None:
        if counted and self._on_served is not None:
            self._on_served()

    def _doorbell(self) -> None:
        for _ in range(self._max_drain):
            try:
                data = self._submit.recv(16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data, gone = b"", True
            else:
                # An empty read is the peer's end of file or an empty message (SOCK_SEQPACKET carries
                # them): the socket says which.
                gone = not data and _peer_left(self._submit)
            if gone:  # the peer closed its end: it is gone; the release cleans up
                if self.close_when_gone:
                    self._gone("its peer closed its end")
                    return
                self._unwatch()
                break
        self._scan()

    def _scan(self) -> None:
        mm = self._mm
        for i in range(self.slots):
            if self._tasks[i] is not None:
                continue
            off = R.slot_offset(i)
            if R.U32.unpack_from(mm, off + R.STATE)[0] != R.SUBMITTED:
                continue
            rpc, seq, n = R.CALL.unpack_from(mm, off + R.RPC_AT)
            data = bytes(mm[off + R.REQUEST_AT: off + R.REQUEST_AT + min(n, R.REQUEST_BYTES)])  # private copy
            R.U32.pack_into(mm, off + R.STATE, R.TAKEN)
            fast = rpc == R.RPC_LOOKUP and self._fast is not None and n <= R.REQUEST_BYTES
            if fast and not self._expired(i):
                try:  # (a space's lane: its Lookups)
                    if self._fast(self, i, rpc, data, False):
                        continue
                except Exception:  # Fast changes nothing before it says True: the task serves it
                    logger.exception("the Lookup path without a task failed on %s; a task serves it",
                                     self.owner)
            self._tasks[i] = asyncio.ensure_future(self._serve(i, rpc, seq, n, data))

    async def _serve(self, i: int, rpc: int, seq: int, n: int, data: bytes) -> None:
        off = R.slot_offset(i)
        mm = self._mm
        step = 0

        final = None

        def progress(p: Any) -> None:
            nonlocal step, final
            if p.done:  # published with DONE: the client sees the end and the status at once
                final = p
                return
            step = (step + 1) & 0xFFFFFFFF
            R.PROGRESS.pack_into(mm, off + R.PROGRESS_AT, p.layers_done, p.last_layer, p.bytes,
                                 int(p.events_recorded), p.pages, step, 0)
            self._ring_done(i)

        R.PROGRESS.pack_into(mm, off + R.PROGRESS_AT, 0, 0, 0, 0, 0, 0, 0)
        code, response, message, ended = 0, b"", b"", True
        try:
            name = R.RPC_NAMES.get(rpc)
            if name is None:
                raise InvalidArgument(f"unknown lane rpc id {rpc}")
            if self._expired(i):
                raise DeadlineExceeded("the call's client had stopped waiting for it when the daemon took "
                                       "it: not started")
            if n > R.REQUEST_BYTES:
                raise InvalidArgument(f"request_len {n} is more than a slot's {R.REQUEST_BYTES} bytes")
            response = await self._run(name, data, progress)
            if len(response) > R.RESPONSE_BYTES:
                raise KVError(f"a {len(response)}-byte response does not fit a slot")
        except asyncio.CancelledError:
            self._tasks[i] = None
            if self._plane is not None:
                self._served_elsewhere(self._counted[i])
            raise
        except Exception as exc:
            status, text = status_of(exc)
            code, message, response = int(status), text.encode()[: R.ERROR_BYTES], b""
            ended = not isinstance(exc, GpuStalled)
        if self._plane is not None:
            self._served_elsewhere(self._counted[i])
        if self._closed:
            return
        flags = R.FLAG_JOB_ENDED if ended else 0
        if final is not None:
            R.PROGRESS.pack_into(mm, off + R.PROGRESS_AT, final.layers_done, final.last_layer, final.bytes,
                                 int(final.events_recorded), final.pages, (step + 1) & 0xFFFFFFFF,
                                 flags | R.FLAG_DONE)
        else:
            R.U32.pack_into(mm, off + R.PROGRESS_AT + 28, flags)
        self._tasks[i] = None
        self.served += 1
        self._done_with(i, seq, code, response, message)
        if self._watching and self._plane is None:
            self._scan()  # a request submitted while this slot's neighbours were all busy

    def _expired(self, i: int) -> bool:
        """Whether slot ``i``'s client stopped waiting before now (its expiry word, on this
        clock: kvserver.protocol.ring): such a call is answered DEADLINE_EXCEEDED, never run."""
        expires = R.U64.unpack_from(self._mm, R.slot_offset(i) + R.EXPIRES_AT)[0]
        return bool(expires) and time.monotonic_ns() >= expires

    def _ring_done(self, i: int) -> None:
        with contextlib.suppress(OSError):  # a full queue (the client reads it later) or a gone peer
            self._done[i].send(b"d", socket.MSG_DONTWAIT)

    async def drain(self, grace: float) -> None:
        """At shutdown: takes no new request, and gives those running up to ``grace`` seconds to
        finish (as the gRPC server gives its calls); ``close`` ends what is left. (The plane's
        own copies get the grace from ``DataPlane.drain``.)"""
        if self._plane is None:
            self._unwatch()
        tasks = [t for t in self._tasks if t is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

    async def close(self) -> None:
        """Stops serving: no more requests are taken, running ones are cancelled and awaited,
        then the ring is unmapped and the doorbells closed (the client's waiters see them close).
        A close while another runs (the lane's own, its peer gone) waits for that one to end."""
        if self._closed:
            if self._ended is not None:
                await asyncio.shield(self._ended)
            return
        self._closed = True
        self._ended = asyncio.get_running_loop().create_future()
        if self.on_close is not None:
            self.on_close(self)
        try:
            if self._adding is not None:  # its opening first: then it comes off the plane again
                with contextlib.suppress(Exception):  # (failed: it never was on it)
                    await asyncio.shield(self._adding)
            self._unwatch()
            tasks = [t for t in self._tasks if t is not None]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self._removal is not None:  # the plane's thread lets go of the ring first
                with contextlib.suppress(Exception):  # (logged where it failed)
                    await asyncio.shield(self._removal)
        finally:  # also when this close is itself cancelled: nothing would close them later
            if self._adding is not None and not self._adding.done():  # (cancelled) once it opened
                self._adding.add_done_callback(lambda _: self._off_then_let_go())
            else:
                self._off_then_let_go()

    def _off_then_let_go(self) -> None:
        """Lets go of the ring and the doorbells once the plane's thread has (at once if it had)."""
        self._unwatch()
        removal = self._removal
        if removal is not None and not removal.done():
            removal.add_done_callback(lambda _: self._let_go())
        else:
            self._let_go()

    def _let_go(self) -> None:
        """The ring unmapped, the doorbells and the pidfd closed; the close has ended."""
        if self._ended is None or self._ended.done():
            return
        try:
            for s in (self._submit, *self._done):
                s.close()
            self.close_gone_fd()
            self._ring.close()
        finally:
            self._ended.set_result(None)
            if self.on_closed is not None:
                self.on_closed(self)
