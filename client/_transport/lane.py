"""The client's half of the data-plane fast lane (docs/lane.md; the layout is kvserver.protocol.ring).

``ClientLane`` makes the sealed ring, takes its ends of the doorbells it connected to the daemon
(``attach``; the fd socket's lane ticket, kvclient._transport.fd_socket.lane_ticket_for), and
carries one Write, Load, Put, Get or Lookup per slot: the serialized request goes into a free
slot, the submit doorbell rings the daemon (unless its data plane says it is awake), and the
caller's thread waits on its slot's done doorbell (poll with the call's deadline, after a short
spin on the slot's words; with the compiled module, ``kvserver.protocol._wire``, in one call
without the GIL, and rung only while it sleeps: docs/lane.md, "Ringing only a sleeper"). A request
too large for a slot, or a call that finds every slot busy, takes the gRPC path instead (the
caller's choice: ``unary``/``stream`` answer None).

A slot whose call gave up (its deadline) stays the daemon's until the daemon marks it DONE; it is
taken back by a later call. A call given up whose answer still matters (a pinning Lookup: the
daemon, whose bound starts when its loop takes the request, may still answer it in time with a
lease) is watched by a thread of its own until that answer comes, which hands it on
(``unary``'s ``late``) and gives the slot back. When the daemon closes its ends (it stopped, died,
or released the registration), every waiter wakes with UNAVAILABLE, as a gRPC call would.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import itertools
import logging
import math
import mmap
import os
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvclient.errors import KVClientError
from kvserver.protocol import compiled
from kvserver.protocol import ring as R
from kvserver.v1 import kvserver_pb2 as pb

# The compiled calls (csrc/wire.c); None where not built, or built from other sources: the slot is
# then written from Python.
_wire = compiled.extension("kvserver.protocol._wire")

logger = logging.getLogger("kvclient")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# How long a waiter looks at its slot's words before it blocks on the doorbell (docs/lane.md,
# "Waiting"): a small call's answer usually comes sooner than a sleeping thread wakes up. A Load's
# or Get's waiter looks longer: its layers come at the pace of the copy, one every few tens of
# microseconds for a small load, and a waiter asleep between two pays a wake-up for each.
def _env_seconds(name: str, default: int, most: int, unit: str, per_second: float) -> float:
    """Seconds from environment variable ``name``: a number of ``unit`` in [0, most] (``default``,
    and a warning, if it is not one)."""
    text = os.environ.get(name, str(default))
    try:
        n = float(text)
    except ValueError:
        n = -1.0
    if not 0 <= n <= most:
        logger.warning("%s=%r is not a number of %s in [0, %d]; using %d", name, text, unit, most, default)
        n = float(default)
    return n / per_second


def _spin_seconds(name: str, default: int) -> float:
    return _env_seconds(name, default, 10_000, "microseconds", 1e6)


SPIN_SECONDS = _spin_seconds("KVCLIENT_LANE_SPIN_US", 30)
LOAD_SPIN_SECONDS = _spin_seconds("KVCLIENT_LANE_LOAD_SPIN_US", 200)
# Gets in a row the daemon's event loop served, not its data plane, after which the lane's next
# Get sleeps first (``ClientLane.plane_gets``): one alone (a walk that met the loop holding the
# cache's lock) says little of the next.
LOOP_GETS_TO_SLEEP = 2
# A Write the daemon's data plane copies for longer than NAP_MIN_SECONDS (as its last writes on
# this lane say: each answer carries the plane's time on it) is waited for asleep until
# NAP_LEAD_SECONDS before its expected end, then looked at (docs/lane.md, "Napping through a long
# write"): the waiter is awake when the answer lands instead of paying a wake-up after it. The lead
# covers a timer's lateness (the kernel's default 50 us of timer slack, then the wake-up itself);
# 0 turns napping off.
NAP_LEAD_SECONDS = _spin_seconds("KVCLIENT_LANE_NAP_LEAD_US", 100)
NAP_MIN_SECONDS = 300e-6
# Spins that find the CPU shared (a look more than CROWDED_GAP_SECONDS after the last, another
# thread having run on the waiter's CPU meanwhile: the yield between them let it): such a spin
# ends, and CROWDED_STRIKES of them, each within CROWDED_STRIKE_GAP_SECONDS of the last, make this
# process's waits sleep at once instead of spinning for the crowded window (docs/lane.md,
# "Waiting"): on a machine with more runnable threads than cores, a spinning waiter takes the CPU
# from the threads that would answer it, and its answer waits for its next turn on the CPU.
# KVCLIENT_LANE_CROWDED_MS sets the window; 0 turns this off.
CROWDED_GAP_SECONDS = 50e-6
CROWDED_STRIKES = 3
CROWDED_STRIKE_GAP_SECONDS = 0.05


def _crowded_window() -> float:
    return _env_seconds("KVCLIENT_LANE_CROWDED_MS", 1000, 60_000, "milliseconds", 1e3)


def _switches() -> int:
    """This thread's involuntary context switches so far (a yield that let another thread run
    counts as one)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class _Crowded:
    """The Python waits' crowded window (the compiled waits keep their own: ``_wire.crowded``)."""

    window = _crowded_window()
    until = 0.0
    last = -math.inf  # the last spin that found the CPU shared
    strikes = 0
    noticed = 0

    @classmethod
    def note(cls, now: float) -> None:
        cls.strikes = cls.strikes + 1 if now - cls.last <= CROWDED_STRIKE_GAP_SECONDS else 1
        cls.last = now
        cls.noticed += 1
        if cls.strikes >= CROWDED_STRIKES:
            cls.until, cls.strikes = now + cls.window, 0


if _wire is not None:
    _wire.crowded(_Crowded.window)


def crowded(window: float | None = None) -> tuple[float, float, int]:
    """(window, seconds left of the current time without spins, spins that found the CPU shared so
    far) of this process's lane waits; ``window`` (seconds, 0: spins are never cut short) is set
    first, and the current time without spins ends."""
    if window is not None:
        if not 0 <= window <= 3600:
            raise ValueError("a crowded window of 0 to 3600 seconds")
        _Crowded.window, _Crowded.until, _Crowded.strikes = window, 0.0, 0
    if _wire is not None:
        return _wire.crowded() if window is None else _wire.crowded(window)
    return _Crowded.window, max(0.0, _Crowded.until - time.monotonic()), _Crowded.noticed
PACE_WRITES = 8  # the answers a lane's write pace is the least of
_COUNTS = struct.Struct("<III")  # a binary request's n_pages, n_dev, n_layers (lane_request.HEADER at 12)
# _CLOSED: the daemon closed its end (it is gone, or released the registration: its jobs are
# dead). _CUT: this client shut the lane while the call ran (close, unregister): the daemon may
# still copy, so the call ends as a cancelled one, unconfirmed, as a gRPC call would.
_OPEN, _CLOSED, _TIMEOUT, _CUT = 0, 1, 2, 3


class ClientLane:
    def __init__(self, slots: int = R.DEFAULT_SLOTS, spin: float = SPIN_SECONDS,
                 load_spin: float = LOAD_SPIN_SECONDS) -> None:
        if not 1 <= slots <= R.MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {R.MAX_SLOTS}]")
        if not (0 <= spin <= 0.01 and 0 <= load_spin <= 0.01):
            raise ValueError("spin and load_spin must be between 0 and 10 ms")
        self.slots = slots
        self.spin = spin  # a Write's or Put's wait
        self.load_spin = load_spin  # a Load's or Get's, for each of its steps
        self.nap_lead = NAP_LEAD_SECONDS
        # Seconds the data plane took per (page, layer) of this lane's writes: the least of the
        # last PACE_WRITES answers' (_learn); None until one answered.
        self.write_pace: float | None = None
        self._paces: collections.deque[float] = collections.deque(maxlen=PACE_WRITES)
        # Unary calls whose thread was asleep when the answer came (woken by the doorbell or the
        # nap's timer, not found while looking), as the compiled call reports them (the Python
        # wait, where _wire is not built, counts none).
        self.woken = 0
        # Whether the daemon's data plane serves this lane's Gets whole, as their answers say
        # (FLAG_PLANE_GET; ``note_get``): a Get's first step then comes at once, and its waiter
        # looks for it as a LoadB's does, instead of sleeping for a step that the event loop takes
        # hundreds of microseconds to send. LOOP_GETS_TO_SLEEP Gets in a row that the loop served
        # (those the plane handed over: in a daemon with a disk or cluster tier, those with a key
        # host memory lacks) make the next ones sleep first, until the plane serves one again.
        self.plane_gets = False
        self.gets_on_plane = 0  # Gets answered here (without an error) that the data plane served whole
        self.gets_on_loop = 0  # and those the event loop served
        self._loop_run = 0  # the loop's, in a row
        self.reg: Any = None  # the registration this lane was opened for
        self.request_format = 0  # the daemon's binary Write/Load format (kvserver.protocol.lane_request)
        self.rpc_mask = R.OLD_RPC_MASK  # the rpc ids the daemon serves (OpenLaneResponse.rpc_mask)
        self.clock_offset_ns = 0  # the daemon's CLOCK_MONOTONIC less this process's (learn_clock)
        self.calls = 0  # requests answered on the lane
        self._c = _wire  # the compiled calls, if built (fixed for the lane's life: its header says so)
        size = R.ring_bytes(slots)
        fd = os.memfd_create("kvclient-lane", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        # Quiet: the compiled wait stores a slot's waiting word before it sleeps, so the daemon
        # rings a done doorbell only for a sleeper (the Python wait does not: it is rung always).
        header = R.header(slots, R.FEATURE_QUIET_DONE if self._c is not None else 0)
        self._mm[: len(header)] = header
        view = ctypes.c_char.from_buffer(self._mm)
        self._address = ctypes.addressof(view)  # valid while the mapping is: until _release
        del view  # no export may outlive this line, or the mapping could not be closed
        self._ring_fd = fd
        # The doorbells: connections to the daemon's fd socket made for the lane's ticket
        # (``attach``), whose other ends are the daemon's accepts, which no one else holds
        # (docs/security.md).
        self._submit: socket.socket | None = None
        self._done: list[socket.socket] = []
        self._submit_fd = -1
        self._done_fds: list[int] = []
        self._polls: list[select.poll] = []
        self._peer: list[socket.socket] | None = None  # the other ends, where made here (standalone)
        self._lock = threading.Lock()
        self._free = list(range(slots))
        self._abandoned: set[int] = set()
        self._streams: dict[int, LaneStream] = {}
        self._seq = itertools.count(1)
        self._users = 0
        self.closed = False
        self._cut = False  # closed with wake: this client shut its own ends
        self._released = False

    @classmethod
    def standalone(cls, slots: int = R.DEFAULT_SLOTS, **kw: Any) -> ClientLane:
        """A lane whose doorbells are made here, their other ends in ``daemon_fds`` (for a test
        that stands in for the daemon)."""
        lane = cls(slots, **kw)
        made: list[socket.socket] = []
        try:
            for _ in range(1 + slots):
                made += socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except BaseException:
            for each in made:
                each.close()
            lane.close()
            raise
        lane.attach(made[0::2])
        lane._peer = made[1::2]
        return lane

    # ---- opening -------------------------------------------------------------------------------

    @property
    def doorbells(self) -> int:
        """How many doorbells the lane takes: the submit doorbell and one per slot."""
        return 1 + self.slots

    def ring_fds(self) -> list[int]:
        """What the daemon gets over the fd socket: the ring."""
        return [self._ring_fd]

    def attach(self, ends: list[socket.socket]) -> None:
        """Takes the engine's ends of the doorbells (the submit doorbell's first), as
        ``request_lane_ticket`` connected them for the lane's ticket."""
        if len(ends) != self.doorbells or self._submit is not None:
            for each in ends:
                each.close()
            raise ValueError(f"a lane of {self.slots} slots takes {self.doorbells} doorbells once; "
                             f"{len(ends)} given")
        self._submit, self._done = ends[0], list(ends[1:])
        # Their numbers, for the compiled calls: open until _release, which no call outlives.
        self._submit_fd = self._submit.fileno()
        self._done_fds = [s.fileno() for s in self._done]
        for s in self._done:
            s.setblocking(False)
            p = select.poll()
            p.register(s.fileno(), select.POLLIN)
            self._polls.append(p)

    def daemon_fds(self) -> list[int]:
        """A standalone lane's: the ring, then the other ends of its doorbells."""
        assert self._peer is not None
        return [self._ring_fd] + [s.fileno() for s in self._peer]

    def handed_over(self) -> None:
        """The daemon holds its own copies now (or never will): ours are closed, so that the
        daemon's death reads as end-of-file on our ends."""
        peer, self._peer = self._peer, None
        for s in peer or ():
            s.close()
        if self._ring_fd >= 0:
            os.close(self._ring_fd)
            self._ring_fd = -1

    # ---- calls -----------------------------------------------------------------------------------

    def serves(self, rpc: str) -> bool:
        """Whether the daemon that opened this lane serves ``rpc`` on it."""
        return bool(self.rpc_mask >> R.RPC_IDS[rpc] & 1)

    def opened_by(self, open_lane: Callable[[], Any]) -> Any:
        """``open_lane()``'s answer (the OpenLane call), its clock learnt (``learn_clock``)."""
        asked = time.monotonic_ns()
        opened = open_lane()
        self.learn_clock(opened.clock_ns, asked, time.monotonic_ns())
        return opened

    def learn_clock(self, daemon_ns: int, asked_ns: int, answered_ns: int) -> None:
        """The daemon's clock at its OpenLane answer (``OpenLaneResponse.clock_ns``), given this
        process's CLOCK_MONOTONIC just before the call (``asked_ns``) and just after it: a daemon
        on the same clock stamped it between the two, so calls' expiries are written on this
        process's own clock, however long the answer took; else (another time namespace) on the
        daemon's, by their offset taken at the call's start: never below the true one (the daemon
        stamped later), so an expiry comes late by the round trip at most, never early. 0 (a
        daemon that reads no expiry): no offset."""
        if not daemon_ns or asked_ns <= daemon_ns <= answered_ns:
            self.clock_offset_ns = 0
        else:
            self.clock_offset_ns = daemon_ns - asked_ns

    def _expires(self, deadline: float | None) -> int:
        """A call's expiry (slot word EXPIRES_AT) for a wait until ``deadline`` (time.monotonic;
        None: no expiry, 0)."""
        return 0 if deadline is None else max(1, int(deadline * 1e9) + self.clock_offset_ns)

    def unary(self, rpc: str, data: bytes, timeout: float, late: Callable[[bytes], None] | None = None,
              late_for: float = 0.0) -> bytes | None:
        """Write, Put or Lookup on the lane: the response bytes; None: not sent (take gRPC). Raises
        KVClientError with the daemon's status, or UNAVAILABLE / DEADLINE_EXCEEDED. ``late``: a
        call given up at its deadline is watched for ``timeout + late_for`` seconds more (``_watch``),
        and an OK answer that comes meanwhile is handed to ``late``, on the watching thread."""
        units = self._write_units(data) if rpc == "WriteB" else 0
        now = time.monotonic()
        nap, spin = self._nap(now, units)
        i = self._take(data)
        if i is None:
            return None
        try:
            if self._c is not None:  # submitted, waited for and read in one compiled call
                got = self._c.call(self._address, i, R.RPC_IDS[rpc], next(self._seq), data, self._submit_fd,
                                   self._done_fds[i], self.spin if spin is None else spin, now + timeout, nap,
                                   self._expires(now + timeout))
            else:
                self._put(i, rpc, data, now + timeout)
                got = self._wait(i, now + timeout, spin=spin, nap=nap)
                if self._state(i) == R.DONE:  # answered (even if the daemon closed its end after)
                    got = (*self._result(i), 0, 0)  # busy unknown; the Python wait counts no sleep
        except BaseException:  # a signal's handler raised (or the call was refused): see _end
            self._end(i, done=False)
            raise
        if type(got) is tuple:
            code, response, message, flags, busy, slept = got
            if slept:
                with self._lock:
                    self.woken += 1
            if units and not code:
                self._learn(units, busy)
            self._end(i, done=True)
            if code:
                raise _error(code, message, flags)
            return response
        if got == _TIMEOUT and late is not None:
            self._watch(i, late, time.monotonic() + timeout + late_for)
        else:
            self._end(i, done=False)
        if got == _CLOSED:
            got = self._ended()
        if got == _TIMEOUT:
            raise KVClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane call deadline exceeded")
        raise _unavailable() if got == _CLOSED else _cut()

    def _watch(self, i: int, late: Callable[[bytes], None], until: float) -> None:
        """Slot ``i``, given up by its call, stays that call's (its use of the lane too) while a
        thread waits for its answer until ``until``: an OK one goes to ``late``."""
        try:
            threading.Thread(target=self._await_late, args=(i, late, until), daemon=True,
                             name="kvclient-lane-late").start()
        except RuntimeError:  # no thread to be had: abandoned as any other call's slot
            logger.warning("kvclient: no thread to watch a lane call given up; its late answer is dropped")
            self._end(i, done=False)

    def _await_late(self, i: int, late: Callable[[bytes], None], until: float) -> None:
        """``_watch``'s thread: waits for slot ``i``'s answer (the lane shut, or ``until``, end the
        wait sooner), ends the call as ``unary`` would, and hands an OK answer to ``late``."""
        response = None
        done = False
        try:
            self._wait(i, until)
            done = self._state(i) == R.DONE
            if done:
                code, answer, _, _ = self._result(i)
                response = None if code else answer
        finally:
            self._end(i, done=done)
        if response is not None:
            try:
                late(response)
            except Exception:
                logger.exception("kvclient: handling a lane call's late answer failed")

    def nudge(self) -> None:
        """Rings the daemon's data plane ahead of a call if it sleeps, so that it is awake when the
        request lands: its wake-up then passes while this thread builds the request."""
        with self._lock:  # not closed: the ring is mapped and the doorbell open
            if self.closed:
                return
            if self._c is not None:
                self._c.nudge(self._address, self._submit_fd)
            elif R.U32.unpack_from(self._mm, R.PLANE_AT)[0] == R.PLANE_ASLEEP:
                with contextlib.suppress(OSError):
                    self._submit.send(b"s", socket.MSG_DONTWAIT)

    def _write_units(self, data: bytes) -> int:
        """(pages x layers) of a binary Write: what its copy's length grows with."""
        reg = self.reg
        if reg is None or len(data) < 24:
            return 0
        pages, _, layers = _COUNTS.unpack_from(data, 12)
        return pages * (layers or reg.end_layer - reg.start_layer)

    def _nap(self, now: float, units: int) -> tuple[float, float | None]:
        """(nap until, spin after it) for a Write of ``units``: (0, None), no nap, unless its
        expected copy is long enough for a timer to wake this thread before it ends."""
        pace, lead = self.write_pace, self.nap_lead
        if not units or pace is None or not lead:
            return 0.0, None
        expect = units * pace
        if expect < max(NAP_MIN_SECONDS, 2 * lead):
            return 0.0, None
        # Looked at for the lead and an eighth of the copy (the least of the recent paces is early
        # by the spread of the copies' times, a few percent of a copy on a quiet machine), but not
        # for longer than five leads: past that a wake-up costs less than the spin.
        return now + expect - lead, min(0.01, 5 * lead, lead + expect / 8)

    def _learn(self, units: int, busy_us: int) -> None:
        """Keeps the plane's pace of this Write (``busy_us`` for ``units``): the nap's estimate is the
        least of the last few. A nap that ends before the answer costs a few percent of the copy in
        spin; one that ends after costs a wake-up, so the estimate errs early: an average (pulled up
        by the odd slow copy on a busy machine) woke the client after the answer in many Writes."""
        if busy_us <= 0:
            return  # not copied by the data plane
        self._paces.append(busy_us * 1e-6 / units)
        self.write_pace = min(self._paces)

    def stream(self, rpc: str, data: bytes, timeout: float) -> LaneStream | None:
        """Load or Get on the lane: its progress source for a LoadHandle; None: take gRPC."""
        deadline = time.monotonic() + timeout
        i = self._begin(rpc, data, deadline)
        if i is None:
            return None
        get = rpc == "Get"
        src = LaneStream(self, i, deadline,
                         on_plane=rpc in R.PLANE_STREAMS or (get and self.plane_gets), get=get)
        with self._lock:
            self._streams[i] = src
            self._users -= 1  # the stream holds the slot now; its pumps count as users
        return src

    def _begin(self, rpc: str, data: bytes, deadline: float | None = None) -> int | None:
        """A free slot, the request in it (waited for until ``deadline``) and the daemon rung;
        None: no room (take gRPC). The caller counts as a user of the lane until ``_end`` (or
        ``stream`` hands the slot over)."""
        i = self._take(data)
        if i is not None:
            try:
                self._put(i, rpc, data, deadline)
            except BaseException:
                self._end(i, done=False)
                raise
        return i

    def _take(self, data: bytes) -> int | None:
        """A free slot for ``data``, its caller counted as a user of the lane; None: no room."""
        if len(data) > R.REQUEST_BYTES:
            return None
        with self._lock:
            if self.closed:
                return None
            i = self._free.pop() if self._free else None
            if i is None:
                finished = self._reclaim()
            else:
                self._users += 1
        if i is None:
            for src in finished:  # streams nobody waits for: read their end, so their slots come back
                if src.handle is not None:
                    src.handle._drive()
            with self._lock:
                if self.closed or not self._free:
                    return None
                i = self._free.pop()
                self._users += 1
        return i

    def _put(self, i: int, rpc: str, data: bytes, deadline: float | None = None) -> None:
        """The request into slot ``i``, expiring at ``deadline`` (time.monotonic; None: never),
        marked SUBMITTED, and the daemon rung."""
        expires = self._expires(deadline)
        if self._c is not None:  # the same, in one compiled call
            self._c.submit(self._address, i, R.RPC_IDS[rpc], next(self._seq), data, self._submit_fd, expires)
            return
        off = R.slot_offset(i)
        mm = self._mm
        mm[off + R.REQUEST_AT: off + R.REQUEST_AT + len(data)] = data
        R.CALL.pack_into(mm, off + R.RPC_AT, R.RPC_IDS[rpc], next(self._seq), len(data))
        R.PROGRESS.pack_into(mm, off + R.PROGRESS_AT, 0, 0, 0, 0, 0, 0, 0)  # nothing of the last call
        R.U32.pack_into(mm, off + R.BUSY_AT, 0)
        R.U64.pack_into(mm, off + R.EXPIRES_AT, expires)
        R.U32.pack_into(mm, off + R.STATE, R.SUBMITTED)
        with contextlib.suppress(OSError):  # full (the daemon has doorbells to read) or closed (it is gone)
            self._submit.send(b"s", socket.MSG_DONTWAIT)

    def _reclaim(self) -> list[LaneStream]:
        """Takes back the slots given up on that the daemon has finished; returns the streams it
        has finished that nobody has read to their end yet (lock held)."""
        for i in list(self._abandoned):
            if self._state(i) == R.DONE:
                self._abandoned.discard(i)
                R.U32.pack_into(self._mm, R.slot_offset(i) + R.STATE, R.FREE)
                self._free.append(i)
        return [src for i, src in self._streams.items() if self._state(i) == R.DONE]

    # The state and step words are read first, with an acquire load where the compiled module is
    # built (docs/lane.md, "Memory order"): what is read of the slot after them is as new.

    def _state(self, i: int) -> int:
        if self._c is not None:
            return self._c.word(self._address, i, R.STATE)
        return R.U32.unpack_from(self._mm, R.slot_offset(i) + R.STATE)[0]

    def note_get(self, on_plane: bool) -> None:
        """A Get answered here, served whole on the daemon's data plane or not: how the next ones
        are waited for (``plane_gets``). (Gets of several threads may end at once.)"""
        with self._lock:
            if on_plane:
                self.gets_on_plane += 1
                self._loop_run = 0
                self.plane_gets = True
            else:
                self.gets_on_loop += 1
                self._loop_run += 1
                if self._loop_run >= LOOP_GETS_TO_SLEEP:
                    self.plane_gets = False

    def _progress(self, i: int) -> tuple[int, ...]:
        """(state, layers_done, last_layer, bytes, events_recorded, pages, step, flags)."""
        if self._c is not None:
            return self._c.progress(self._address, i)
        off = R.slot_offset(i)
        return (R.U32.unpack_from(self._mm, off + R.STATE)[0],
                *R.PROGRESS.unpack_from(self._mm, off + R.PROGRESS_AT))

    def _result(self, i: int) -> tuple[int, bytes, str, int]:
        if self._c is not None:
            code, response, message, flags = self._c.result(self._address, i)
            return code, response, message.decode(errors="replace"), flags
        off = R.slot_offset(i)
        mm = self._mm
        code, n, m = R.RESULT.unpack_from(mm, off + R.CODE_AT)
        flags = R.U32.unpack_from(mm, off + R.PROGRESS_AT + 28)[0]
        response = bytes(mm[off + R.RESPONSE_AT: off + R.RESPONSE_AT + min(n, R.RESPONSE_BYTES)])
        message = bytes(mm[off + R.ERROR_AT: off + R.ERROR_AT + min(m, R.ERROR_BYTES)])
        return code, response, message.decode(errors="replace"), flags

    def _end(self, i: int, done: bool) -> None:
        """A call's user leaves: ``done``, its slot comes back (the daemon answered); else it is
        abandoned (still the daemon's) and taken back once the daemon marks it DONE, unless it
        was never submitted (still FREE: the call failed before its submit), which comes back now."""
        with self._lock:
            self._streams.pop(i, None)
            self._users -= 1
            if done:
                self.calls += 1
                if not self.closed:
                    R.U32.pack_into(self._mm, R.slot_offset(i) + R.STATE, R.FREE)
                    self._free.append(i)
            elif self._state(i) == R.FREE:  # only this client stores SUBMITTED, and it did not
                if not self.closed:
                    self._free.append(i)
            else:
                self._abandoned.add(i)
            last = self.closed and self._users == 0 and not self._streams
        if last:
            self._release()

    def _wait(self, i: int, deadline: float, step: int = -1, spin: float | None = None,
              nap: float = 0.0) -> int:
        """Until the slot is DONE (or, ``step`` >= 0, its step word moved past ``step``), its
        doorbell reads end of file, or ``deadline``: _OPEN, _CLOSED / _CUT, or _TIMEOUT. Looks
        at the words for ``spin`` seconds (default ``self.spin``) before it sleeps; with ``nap``
        (a time.monotonic() time) it sleeps until then first, unless rung (compiled wait only)."""
        spin = self.spin if spin is None else spin
        if self._c is not None:
            got = self._c.wait(self._address, i, self._done_fds[i], step, spin, deadline, nap)
            return self._ended() if got == _CLOSED else got

        def ready() -> bool:
            return self._state(i) == R.DONE or (step >= 0 and self._progress(i)[6] != step)

        now = time.monotonic()
        if spin and now >= _Crowded.until:
            until, last = min(deadline, now + spin), now
            switched = _switches() if _Crowded.window else -1
            while True:
                if ready():
                    return _OPEN
                now = time.monotonic()
                if now - last > CROWDED_GAP_SECONDS and switched >= 0 and _switches() > switched:
                    _Crowded.note(now)  # another thread had this one's CPU
                    break
                if now >= until:
                    break
                os.sched_yield()  # whatever else is runnable on this CPU goes first
                last = now
        sock = self._done[i]
        # Closed without wake (the registration was lost), the call still runs to the daemon's
        # answer: only the socket's end says the daemon is gone.
        while True:
            if ready():
                return _OPEN
            left = deadline - time.monotonic()
            if left <= 0:
                return _TIMEOUT
            events = self._polls[i].poll(max(1, math.ceil(left * 1000)))
            if not events:
                continue
            # Drained to EAGAIN: calls answered during a spin left their messages unread.
            try:
                while True:
                    if not sock.recv(16, socket.MSG_DONTWAIT):
                        return self._ended()  # end of file
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._ended()

    def _ended(self) -> int:
        return _CUT if self._cut else _CLOSED

    def _maybe_release(self) -> None:
        with self._lock:
            last = self.closed and self._users == 0 and not self._streams
        if last:
            self._release()

    # ---- closing ---------------------------------------------------------------------------------

    def close(self, wake: bool = True) -> None:
        """No new calls; memory and sockets go once the last call in flight has ended. ``wake``:
        those calls end now (UNAVAILABLE); else (the registration was lost, but the daemon may
        still answer, as a gRPC call in flight would be answered) they run to their end. A Load or
        Get keeps the lane until its handle reads its end (or is collected): what landed is known
        only from the slot."""
        with self._lock:
            if self.closed and not wake:
                return
            self.closed = True
        self.handed_over()
        if wake:
            self._cut = True
            for s in self._doorbell_socks():
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._maybe_release()

    def _doorbell_socks(self) -> list[socket.socket]:
        return ([self._submit] if self._submit is not None else []) + self._done

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        for s in self._doorbell_socks():
            s.close()
        with contextlib.suppress(BufferError):
            self._mm.close()


class LaneStream:
    """The progress of one Load or Get in a slot, pumped by the LoadHandle's waiters."""

    def __init__(self, lane: ClientLane, slot: int, deadline: float, on_plane: bool = True,
                 get: bool = False) -> None:
        self.lane = lane
        self.get = get
        self.slot = slot
        self.deadline = deadline
        self.step = 0
        self.finished = False
        self.handle: Any = None  # the LoadHandle it feeds
        # When the last new step was seen, and the time a step took then: a waiter looks for the
        # next step for the lane's load spin only while steps come that fast (a small load's
        # layers); a large load's layers take longer than any spin, and its waiter sleeps at once
        # after the lane's short spin (spinning there costs the copy itself on a small machine).
        # A request only the daemon's event loop serves (a Get, a Load in protobuf: ``on_plane``
        # False) is taken as slow until its steps show their pace (from its second step on): its
        # first step comes after hundreds of microseconds of Python, and looking for it all that
        # time would cost the engine as much; the loop's later steps come at most once per
        # progress interval (1 ms by default).
        self.step_at: float | None = None
        self.gap: float | None = None if on_plane else math.inf

    def spin(self) -> float:
        """How long the next wait looks at the slot before it sleeps (see ``gap``)."""
        lane = self.lane
        return lane.load_spin if self.gap is None or self.gap <= lane.load_spin else lane.spin

    def pump(self, handle: Any, timeout: float | None, end_only: bool = False) -> None:
        """Waits up to ``timeout`` (None: the call's deadline) for news and hands it to ``handle``;
        ``end_only``: for the call's end only (the daemon rings for no step meanwhile)."""
        if self.finished:
            return
        lane, i = self.lane, self.slot
        with lane._lock:
            released = lane._released
            if released:
                self.finished = True
            else:
                lane._users += 1
        if released:  # failed outside the lane's lock: the handle's error path may call the daemon
            handle._fail(_unavailable())
            return
        ended = False
        try:
            end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
            spin = self.spin()
            got = lane._wait(i, end, -1 if end_only else self.step, spin)
            words = lane._progress(i)
            if words[0] != R.DONE and words[7] & R.FLAG_DONE and got == _OPEN:
                # The last step is published just before DONE and the status: the handle ends
                # with them, and its slot comes back before its waiter returns.
                got = lane._wait(i, end, -1, spin)
                words = lane._progress(i)
            state, layers_done, last_layer, nbytes, recorded, pages, step, flags = words
            done = state == R.DONE
            if step != self.step or done:
                if step != self.step:
                    now = time.monotonic()
                    if self.step_at is not None:
                        self.gap = (now - self.step_at) / ((step - self.step) & 0xFFFFFFFF or 1)
                    self.step_at = now
                self.step = step
                # Done once the slot is: its status is known then (its layers count before).
                handle._update(pages, (), bool(recorded), layers_done, last_layer, nbytes,
                               done and bool(flags & R.FLAG_DONE))
            if done:
                code, _, message, flags = lane._result(i)
                if self.get and not code:
                    lane.note_get(bool(flags & R.FLAG_PLANE_GET))
                error = None
                if code:
                    error = _error(code, message, flags)
                elif not flags & R.FLAG_DONE:
                    error = KVClientError(grpc.StatusCode.INTERNAL, "load ended before the last layer")
            elif got in (_CLOSED, _CUT):
                error = _unavailable() if got == _CLOSED else _cut()
            elif time.monotonic() >= self.deadline:
                error = KVClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane call deadline exceeded")
            else:
                return
            self.finished = ended = True
            lane._end(i, done)
            if error is not None:
                handle._fail(error)
        finally:
            if not ended:
                with lane._lock:
                    lane._users -= 1
                lane._maybe_release()


def _error(code: int, message: str | bytes, flags: int) -> KVClientError:
    if isinstance(message, bytes):
        message = message.decode(errors="replace")
    status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    return KVClientError(status, message, bool(flags & R.FLAG_JOB_ENDED))


def _cut() -> KVClientError:
    """This client closed the lane under the call: the daemon may still copy (unconfirmed)."""
    return KVClientError(grpc.StatusCode.CANCELLED, "the client closed the lane while the call ran")


def _unavailable() -> KVClientError:
    return KVClientError(grpc.StatusCode.UNAVAILABLE, "the daemon closed the lane (stopped, or released the "
                         "registration)")


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def late_release(response: bytes, **owner: str) -> pb.ReleaseRequest | None:
    """A pinning Lookup's answer (``response``, a LookupResponse's bytes) that came after its
    caller gave up: the Release of the lease it took, which nobody holds, under ``owner``
    (``client_id=`` or ``space_id=``); None if it took none."""
    try:
        lease = pb.LookupResponse.FromString(response).lease_id
    except DecodeError:
        return None
    return pb.ReleaseRequest(lease_ids=[lease], **owner) if lease else None


def release_late(stub: Any, response: bytes, timeout: float, metadata: Any, **owner: str) -> None:
    """Sends ``late_release``'s Release (on the lane's watching thread: ``unary``'s ``late``)."""
    req = late_release(response, **owner)
    if req is None:
        return
    try:
        stub.Release(req, timeout=timeout, metadata=metadata)
    except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel closed meanwhile
        logger.debug("releasing the lease of a Lookup given up failed (it ends after its pin_ms): %r", exc)
    else:
        logger.debug("released the lease of a Lookup answered after it was given up")

