"""The compiled data plane's Python side: starts its thread, gives it lanes and gates, and serves
on the event loop what it hands over (kvserver/lane/csrc/kvlane.c; docs/design.md).

A registration gets a ``Gate`` when the plane can copy for it by itself: a shared-memory pool of
plain buffers (one token stride), all sealed descriptors (no named object that could shrink under
the mapping). Its lane's binary Writes and Loads are then checked and copied on the plane's thread;
every other request on the lane comes back here, in arrival order, and runs the code the RPC runs.
The cache's copies of such a registration (a Put's, a Get's), planned on the loop, are copied on
the plane's thread too (``copy``): no piece of them goes through Python, and their end comes back
on the same eventfd as the handoffs. A lane Get served without a task (``Answer``) has its copy
answer its slot there too.
Without the compiled module (a build without a compiler) there is no plane: lanes are served on the
event loop as before, binary requests included.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvserver.copies.workers import Work
from kvserver.errors import JobStopped
from kvserver.protocol import compiled

if TYPE_CHECKING:
    from kvserver.copies.job import Job
    from kvserver.copies.progress import LayerSignal
    from kvserver.core.client_state import ClientState
    from kvserver.lane.server import Lane

# The compiled plane (csrc/kvlane.c); None where not built, or built from other sources: the event
# loop then serves every lane request.
_kvlane = compiled.extension("kvserver.lane._kvlane")

logger = logging.getLogger(__name__)

# KVSERVER_DATA_PLANE=python turns the plane off (the event loop serves every request).
ENABLED = _kvlane is not None and os.environ.get("KVSERVER_DATA_PLANE", "compiled") != "python"
# KVSERVER_PLANE_GETS=0 keeps lane Gets, an engine's Lookups and its Puts on the event loop (the
# plane still copies them there; KVSERVER_PLANE_PUTS=0, kvserver.core.cache_ops: only the Puts of
# new keys).
GETS = os.environ.get("KVSERVER_PLANE_GETS", "1") != "0"
POLL_SECONDS = 0.0005  # how often a waiter on the plane's copies looks again
MAX_KEPT_TABLES = 4096  # host tables whose rows _host_rows keeps (one a client)
# The most ends of the calls the plane served whole that one turn of the loop settles (take_gets),
# and the most page ids they carry (a scheduler's Lookup of a whole space may carry 8 Ki; the first
# end is taken whatever it carries): the rest are settled in the turns after, between the loop's
# other work. The plane keeps at most 256 ends posted for the loop, but Gets still copying do not
# count there: many that a deadline stops at once post their ends together.
SETTLE_BATCH = 256
SETTLE_IDS = 64 << 10
# The most requests the plane handed over that one turn of the loop serves, taken one lane after
# another (a Lookup served at once costs up to ~100 µs): the rest in the turns after, so that a
# burst on many lanes (one tenant may hold 256) holds the loop a turn at a time, and a lane's
# request waits for at most one request of each lane queued before it, not for all they hold.
HANDOFF_BATCH = 64
# A copy's end the plane posts back for a write whose copy ended past its write_by_ns (csrc/plane.h's
# DONE_LATE; 0 done, 1 stopped by its stop word, 2 its gate closed, 3 the plane stopped it).
DONE_LATE = 4
# The stop word of a copy made at once (``copy_now``): nothing can stop it while it runs on the loop.
_NO_STOP = np.zeros(1, np.int64)


def available() -> bool:
    return ENABLED


class Answer(NamedTuple):
    """The lane slot a loop's copy answers (``DataPlane.copy``): the lane's handle on the plane, the
    slot, the pages word it says (a Get's hit), the request's timeout_ms, when it arrived
    (``time.monotonic_ns()``: its latency is counted from there), and whether its handoff counted
    it in the gate's Python copies (the plane gives that count back once it holds the copy)."""

    lane: int
    slot: int
    found: int
    timeout_ms: int
    arrival_ns: int
    counted: bool


class _Settled(asyncio.Future):
    """A command's end on the loop: it cannot be cancelled, so that its state is always the
    command's. A task awaiting it directly is cancelled only once the command has ended (and
    ``wait_for`` waits that long): wait for it through ``asyncio.shield``, ``asyncio.wait`` or
    ``kvcore.settle``."""

    def cancel(self, msg: Any = None) -> bool:
        return False


def _on_loop(cf: Future, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """A loop future that settles as command ``cf`` ended. Unlike ``asyncio.wrap_future``'s, a
    cancel neither cancels the command (which may be running: the thread would then keep a lane its
    caller believes it never got) nor the future (whose end says what the command did)."""
    fut = _Settled(loop=loop)

    def copy(_: Future) -> None:
        exc = cf.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(cf.result())

    def ended(_: Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: no one waits
            loop.call_soon_threadsafe(copy, cf)

    cf.add_done_callback(ended)
    return fut


def _logged(fut: asyncio.Future) -> None:
    if fut.exception() is not None:  # (never cancelled: _Settled)
        logger.error("a command to the data plane's thread failed", exc_info=fut.exception())


class DataPlane:
    def __init__(self, progress_interval: float, buckets: tuple[float, ...] = (), spin: float = 0.0) -> None:
        assert _kvlane is not None
        # buckets: the edges of the latency histograms it keeps (kvserver.api.metrics.BUCKETS);
        # spin: seconds its thread looks again after a request or a copy before it sleeps
        self.engine = _kvlane.Engine(progress_interval, list(buckets), spin)
        self.lanes: dict[int, Lane] = {}  # by key: never reused, so a late handoff finds no other lane
        self._keys = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        # The loop's copies on the plane's thread, by ticket: what each needs until its end is taken
        # (its future, its job, whose stop word and progress the thread reads and writes, its gate).
        self._copies: dict[int, tuple[Future, Job, Any, LayerSignal | None, Callable[[], None]]] = {}
        self._tickets = itertools.count(1)
        self._rows: dict[int, tuple[Any, Any, tuple[int, int, int] | None]] = {}  # host_rows
        self.copies = 0  # the loop's copies it has taken
        self.answered = 0  # of those, the ones that answered their lane slot (a Get's: Answer)
        self.now = 0  # of those, the ones copied and answered on the loop at once (``copy_now``)
        self.stopped = False
        # Lane Gets served whole on the plane's thread (``serve_gets``): the cache it walks, and who
        # settles their ends on the loop.
        self.cache: Any = None
        self._cache_lock: Any = None
        self._get_ended: Callable[..., None] | None = None
        self._settle_soon = False  # a turn of the loop is to settle the ends left (_settle_batch)
        # Requests handed over and not served yet, per lane in arrival order, the lanes in turn.
        self._handed: collections.OrderedDict[Any, collections.deque] = collections.OrderedDict()
        self._handed_soon = False  # a turn of the loop is to serve the rest (_serve_handed)
        # Where a lane's opening, a gate's close and a lane's removal wait for the plane's thread
        # to take them: one thread, so they run in the order sent. The loop goes on meanwhile: a
        # thread slow to take a command (no CPU for it, on a busy machine) holds up the call that
        # sent it, not every engine's calls. (A pause and the drain's unwatch_all still wait on
        # the loop.)
        self._commands = ThreadPoolExecutor(1, thread_name_prefix="kvserver-plane-commands")

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.engine.notify_fd, self._handoffs)

    def take_handoffs(self) -> None:
        """Serves what the plane handed over until now, all of it (the loop's reader does it as it
        comes, ``HANDOFF_BATCH`` a turn)."""
        self._handoffs()
        while self._handed:
            self._serve_handed(len(self._handed) + HANDOFF_BATCH)

    def _handoffs(self) -> None:
        # take_handoffs drains the eventfd first: whatever the thread posts after that rings it
        # again (an end of a call it served, only the first one the loop has not taken: the ends
        # are taken after the drain, in _settle_batch, which leaves the rest to its next turns),
        # so nothing is left for a wake-up that never comes.
        handed = self.engine.take_handoffs()
        for ticket, status, layers in self.engine.take_completions():
            try:
                self._ended(ticket, status, layers)
            except Exception:  # the other ends, and the handoffs, are served all the same
                logger.exception("settling a copy the data plane ended failed")
        self._settle_batch()
        for item in handed:
            queue = self._handed.get(item[0])
            if queue is None:
                queue = self._handed[item[0]] = collections.deque()
            queue.append(item)
        # Served by one callback a turn of the loop (never here as well: with the turn's callback
        # that would be two batches in one turn).
        if self._loop is None:
            self._serve_handed()
        elif self._handed and not self._handed_soon:
            self._handed_soon = True
            self._loop.call_soon(self._serve_handed)

    def _serve_handed(self, most: int = HANDOFF_BATCH) -> None:
        """Serves at most ``most`` of the requests handed over, one lane's after another's; a
        later turn of the loop serves the rest."""
        self._handed_soon = False
        try:
            for _ in range(most):
                if not self._handed:
                    return
                key, queue = next(iter(self._handed.items()))
                item = queue.popleft()
                if queue:
                    self._handed.move_to_end(key)
                else:
                    del self._handed[key]
                self._serve_one(*item)
        finally:  # (a request that raised leaves the others to the next turn, not to a next handoff)
            if self._handed and not self._handed_soon and self._loop is not None:
                self._handed_soon = True
                self._loop.call_soon(self._serve_handed)

    def _serve_one(self, key: Any, slot: int, rpc: int, counted: bool) -> None:
        lane = self.lanes.get(key)
        if lane is None:  # removed meanwhile: the request dies with its lane
            return
        if slot < 0:  # a space's lane whose peer closed its end of the doorbell
            try:
                lane.peer_closed()
            except Exception:  # the other handoffs are served all the same
                logger.exception("closing a space's lane whose peer left failed")
            return
        try:
            lane.take(slot, rpc, counted)
        except Exception:  # answered INTERNAL; the other requests are served
            logger.exception("serving a request handed over by the data plane failed")
            lane.refuse(slot, "the daemon failed to take this request: see its log", counted)

    # ---- lane Gets served whole on the plane ----------------------------------------------------

    def serve_gets(self, cache: Any, address: int, nbytes: int, ended: Callable[..., None],
                   whole: bool = False) -> None:
        """Has the plane's thread serve lane Gets whole (docs/design.md, "A Get on the data plane")
        from ``cache`` (a KVCache in the arena at ``address``, ``nbytes``) for the gates given a
        part (``Gate.set_cache``): it walks the index and holds the pages under the cache's lock
        (attached here: from now on the loop's changes take the plane's lock), copies them and
        answers the slot; and the engines' Lookups of their own part, which it walks and answers;
        ``ended([(token, gid, ids, found, misses, status, layers, bytes, kind), ...])`` settles
        them on the loop, all that ended since the last (a Get's pages let go, the pages made
        recent, the counters kept). ``whole``: only the
        calls whose every key host memory holds, the others handed to the loop (a daemon with a
        disk or cluster tier, which may hold the rest). Once, before any gate is given a part."""
        c = _kvlane.Cache(address, nbytes, whole)
        lock = cache.lock
        lock.attach(c)
        with lock:
            pages = cache.pages
            c.set_tables(*pages.index.tables(), pages.state, pages.offset, pages.readers, pages.slab,
                         pages.slab_holds, pages.part, pages.index.counter, pages.stamp, pages.slab_stamp,
                         pages.ticks)
            pages.on_slabs = c.set_slabs
            pages.index.on_state = c.set_index
        self.engine.set_cache(c)
        self.cache, self._cache_lock, self._get_ended = c, lock, ended

    def settle_gets(self) -> None:
        """Settles every Get the plane served whole that has ended (the loop's reader does it as
        they end, ``SETTLE_BATCH`` a turn; a harvest of the counters first, so that Stats counts
        every Get answered)."""
        while self._settle_batch(again=False):
            pass

    def _settle_batch(self, again: bool = True) -> bool:
        """Settles the oldest ends of the calls the plane served whole, ``SETTLE_BATCH`` and
        ``SETTLE_IDS`` at most; True if there may be more, which (``again``) the loop's next turn
        settles (one turn at a time however often this runs meanwhile, and after a failure too):
        the plane posts no wake-up for them, only for an end posted once none is left."""
        if self._get_ended is None:
            return False
        more = True
        try:
            ends = self.engine.take_gets(SETTLE_BATCH, SETTLE_IDS)
            if ends:
                self._get_ended(ends)
            more = bool(ends) and self.engine.ends_waiting > 0
        finally:
            if more and again and not self._settle_soon and self._loop is not None and not self.stopped:
                self._settle_soon = True
                self._loop.call_soon(self._settle_later)
        return more

    def _settle_later(self) -> None:
        self._settle_soon = False
        self._settle_batch()

    @property
    def plane_gets(self) -> int:
        """Lane Gets the plane's thread has served whole (taken, found or not)."""
        return self.engine.plane_gets

    @property
    def plane_lookups(self) -> int:
        """Lane Lookups the plane's thread has served whole: an engine's of its own part, and a
        scheduler's of its whole space on the space's lane (``plane_space_lookups``)."""
        return self.engine.plane_lookups

    @property
    def plane_space_lookups(self) -> int:
        """A scheduler's Lookups of its whole space the plane's thread has answered on its lane."""
        return self.engine.plane_space_lookups

    @property
    def plane_puts(self) -> int:
        """Lane Puts of keys all stored already that the plane's thread has answered whole."""
        return self.engine.plane_puts

    @property
    def plane_stores(self) -> int:
        """Lane Puts that stored pages the plane's thread copied and filed itself (from its gate's
        stash: ``stash``)."""
        return self.engine.plane_stores

    def stash(self, gate: Any, ids: np.ndarray, full: int) -> None:
        """Sets free cache pages ``ids`` aside for ``gate``'s Puts, which the plane's thread then
        stores whole (docs/design.md, "A Put on the data plane"): pages being written, in no part,
        of the gate's tenant; ``full``: the pages its stash is kept at (``Gate.stash_short`` says a
        Put of at most that many found it short). With the cache's lock held."""
        self.engine.stash(gate, np.ascontiguousarray(ids, np.int64), full)

    def unstash(self, gate: Any) -> np.ndarray:
        """The pages of ``gate``'s stash, taken out of it. With the cache's lock held."""
        return np.frombuffer(self.engine.unstash(gate), np.int64).copy()

    # ---- the loop's copies ----------------------------------------------------------------------

    def copy(self, gate: Any, job: Job, to_device: bool, signal: LayerSignal | None, host: tuple[int, int],
             ended: Callable[[], None], answer: Answer | None = None) -> Future | None:
        """Runs ``job``, a cache copy the loop planned and ordered for the registration whose
        plane turn it holds (``gate``), on the plane's thread; ``host``: (address, bytes) of the
        arena its offsets are in. The future is running at once (a stop goes through the job's
        stop word, read at layer boundaries) and is settled on the loop, after ``ended()`` is
        called (work held behind the job may go). None: the plane does not take it (a closed gate,
        host rows not laid out as cache pages are), and the caller copies it as before.
        ``answer``: the copy (a load) also answers a lane slot handed over to the loop, as the
        plane answers its own Loads (``Answer``; ``_kvlane``'s submit_copy). (A small answering
        copy is made at once, on the loop, by ``copy_now``.)"""
        plan = job.plan
        rows = self.host_rows(job.host_table, plan.page_size, host)
        if rows is None:
            return None
        base, stride, limit = rows
        # Device pages (the plane takes each page's tokens in order) or tokens; the plane merges
        # consecutive tokens into runs.
        pages = plan.device_pages
        tokens = np.ascontiguousarray(plan.device_rows if pages is None else pages, np.int64)
        host_pages = np.ascontiguousarray(plan.host_pages, np.int64)
        layers = np.asarray(job.local_layers, np.int64)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # never dropped unstarted: a stop is the stop word's
        # Counted before the thread can answer the slot, so that whoever sees the answer sees the
        # count; taken back if the copy is not taken.
        self.copies += 1
        self.answered += answer is not None
        ticket = next(self._tickets)
        # Held here from before the thread may see them until their end is taken: the job (its
        # stop word), the signal (its counter and fd) and the gate the thread reads and writes.
        self._copies[ticket] = (fut, job, gate, signal, ended)
        try:
            taken = self.engine.submit_copy(
                ticket, gate, to_device, base, stride, limit,
                host_pages, tokens, layers, job.stop_word,
                signal.counter if signal is not None else None, signal.fd if signal is not None else -1,
                signal.interval if signal is not None else 0.0,
                *((None, -1, 0, 0, 0, False) if answer is None else answer), paged=pages is not None,
                write_by_ns=0 if to_device or job.deadline <= 0 else int(job.deadline * 1e9))
        except (MemoryError, RuntimeError):  # no room, or the plane stopped: the copy workers run it
            logger.exception("the data plane could not take a cache copy; the copy workers run it")
            taken = False
        except BaseException:  # its checks refused it (ValueError): an inconsistency, copied nowhere
            del self._copies[ticket]
            self.copies -= 1
            self.answered -= answer is not None
            raise
        if not taken:
            del self._copies[ticket]
            self.copies -= 1
            self.answered -= answer is not None
            return None
        job.work = Work(to_device, 0, lambda _: None, future=fut)  # what later copies of it wait on
        return fut

    def copy_now(self, gate: Any, table: Any, page_size: int, host: tuple[int, int], offsets: np.ndarray,
                 device_pages: np.ndarray, layers: np.ndarray, answer: Answer) -> int:
        """A small answering copy (a lane Get's) of cache pages at ``offsets`` of the arena ``host``
        (``table``: the client's cache table) into whole ``device_pages``, of the registration's
        local ``layers``, copied and answered here, on the loop, by the plane's own code
        (``submit_copy``'s now), with no job: for a registration nothing else of which is in
        flight on the loop (``Copier.alone``), so that nothing is to be ordered or settled later.
        The status its slot was answered with; -1: not copied, nothing changed (its gate has a copy
        on the plane, or its host rows are not cache pages): ``copy`` then."""
        rows = self.host_rows(table, page_size, host)
        if rows is None:
            return -1
        base, stride, limit = rows
        # Counted before the call can answer the slot (whoever sees the answer sees the count),
        # taken back if it is not copied.
        self.copies += 1
        self.answered += 1
        self.now += 1
        code = -1
        try:
            code = self.engine.submit_copy(0, gate, True, base, stride, limit, offsets, device_pages, layers,
                                           _NO_STOP, None, -1, 0.0, *answer, paged=True, now=True)
        except (MemoryError, RuntimeError):  # the plane stopped: its submission would say so
            code = -1
        finally:
            if code < 0:  # (a ValueError, an inconsistency, too: nothing was copied)
                self.copies -= 1
                self.answered -= 1
                self.now -= 1
        return code

    def host_rows(self, table: Any, page_size: int, host: tuple[int, int]) -> tuple[int, int, int] | None:
        """(base, stride, limit) of a copy's host rows, cache pages of ``page_size`` tokens in the
        arena ``host`` (``table``: the job's host table): page chunks ``stride`` bytes apart from
        ``base``, within ``limit`` bytes of it; None where they are laid out otherwise (the plane
        does not take the copy). Kept per table (a client's cache table lives as long as it)."""
        if table is None:
            return None
        known = self._rows.get(id(table))
        if known is not None and known[0] is table and known[1] == (host, page_size):
            return known[2]
        rows = None
        page = page_size * table.row_bytes
        if table.row_stride == 1 and table.geometry is None:
            bases = table.bases.reshape(-1).astype(np.int64)
            stride = int(bases[1] - bases[0]) if len(bases) > 1 else page
            address, size = host
            base = int(bases[0])  # the offsets count from here: the arena's start, as cache_table lays it
            if (stride >= page and address <= base <= address + size and np.array_equal(
                    bases, bases[0] + stride * np.arange(len(bases), dtype=np.int64))):
                rows = (base, stride, address + size - base)
        if len(self._rows) >= MAX_KEPT_TABLES:
            self._rows.clear()
        self._rows[id(table)] = (table, (host, page_size), rows)  # held: its id is not reused meanwhile
        return rows

    def _ended(self, ticket: int, status: int, layers: int) -> None:
        entry = self._copies.pop(ticket, None)
        if entry is None:
            return
        fut, job, _, _, ended = entry
        job.work.ended = True
        ended()
        if status == 0:
            fut.set_result(None)
        elif status == DONE_LATE:  # a write that ended past its deadline (Job.check_ended)
            fut.set_exception(JobStopped("late", layers, len(job.local_layers)))
        elif status == 1 or job.stop_reason:
            fut.set_exception(job.stopped(layers))
        else:  # its gate closed (the client is going), or the plane stopped
            fut.set_exception(JobStopped("released" if status == 2 else "cancelled", layers,
                                         len(job.local_layers)))

    # ---- gates ---------------------------------------------------------------------------------

    @staticmethod
    def gate_bytes(client: ClientState) -> int:
        """The daemon's own memory a gate for ``client`` may come to hold: 8 bytes per device
        token (its write marks and a request's scratch: a request names tokens) and 12 per host
        page, written as requests name them, kept until the gate goes."""
        return 8 * client.device.num_tokens + 12 * (len(client.pages.is_allocated) + 1)

    def gate_for(self, client: ClientState, max_indices: int) -> Any | None:
        """A gate for ``client`` if the plane can copy for it alone; None: the loop serves it."""
        buffers = client.device.plane_buffers()
        if buffers is None:
            return None  # blocks, strided heads, mixed strides; named objects; CUDA (KVSERVER_PLANE_CUDA=0)
        bases, stride = buffers
        spec = client.spec
        gate = _kvlane.Gate(
            owned=client.pages.is_allocated.view(np.uint8), host_base=int(client.host_table.bases[0][0]),
            page_bytes=spec.page_bytes, page_size=spec.page_size, token_bytes=spec.token_bytes,
            parts=spec.layout.num_parts, start_layer=spec.layers.start, num_layers=len(spec.layers),
            epoch=client.epoch, dev_tokens=client.device.num_tokens, dev_bases=bases, dev_stride=stride,
            max_indices=max_indices)
        client.device.plane_setup(gate)  # a CUDA pool's stream, events and driver
        return gate

    def space_gate(self) -> Any | None:
        """A gate for a scheduler's lane of one KV space where the plane serves cache calls
        (``serve_gets``): the plane watches the lane and answers its Lookups of the whole space
        once the loop gives the gate the space's parts (``Gate.set_space``; ``CacheOps``), handing
        the others over; None: the loop serves the lane."""
        return _kvlane.space_gate() if self.cache is not None and not self.stopped else None

    def close_gate(self, gate: Any) -> asyncio.Future:
        """The gate takes no new request from now on; its copies stop at their next layer
        boundary (answered NOT_FOUND, as a released client's are). Returns what is done once the
        plane's thread has taken the close: after the piece and the doorbells it was handling (a
        caller that needn't wait lets it run: its failure is logged)."""
        gate.shut()
        return self._command(self.engine.close_gate, gate)

    def _command(self, fn: Callable[..., Any], *args: Any, logged: bool = True) -> asyncio.Future:
        """Runs ``fn(*args)``, a command that waits for the plane's thread, on the command
        thread; done at once where the plane has stopped (its thread takes no command). ``logged``:
        its failure is logged (for callers that need not wait for it)."""
        loop = asyncio.get_running_loop()
        if self.stopped:
            done = loop.create_future()
            done.set_result(None)
            return done
        fut = _on_loop(self._commands.submit(fn, *args), loop)
        if logged:
            fut.add_done_callback(_logged)
        return fut

    async def idle(self, gate: Any) -> None:
        """Once this returns after ``close_gate``, the plane touches none of the client's memory
        (a CUDA pool's jobs end once the GPU is done with them, or given up on: the pool's close
        then quarantines what the GPU may still touch)."""
        while gate.inflight or gate.x_inflight:
            await asyncio.sleep(POLL_SECONDS)

    # ---- lanes ---------------------------------------------------------------------------------

    def add(self, lane: Lane, gate: Any) -> tuple[int, asyncio.Future]:
        """Puts the lane on the plane's thread: its handle at once (known before the thread
        hands any request of it over), and what is done once the thread watches its doorbell (on
        the command thread, behind the closes and removals sent before it): OSError where it
        cannot (the lane is then not the thread's at all, its handle names nothing), RuntimeError
        once the plane has stopped."""
        if self.stopped:
            raise RuntimeError("the data plane has stopped")
        if self._loop is None:
            self.start()
        key = next(self._keys)
        handle = self.engine.new_lane(key, gate, lane.ring_address, lane.slots, lane.submit_fd,
                                      lane.done_fds, lane.quiet_done)
        self.lanes[key] = lane  # before the thread has it: it may hand a request over at once
        lane.plane_key = key
        watched = self._command(self._watch, handle, logged=False)  # (its caller raises what failed)

        def failed(fut: asyncio.Future) -> None:
            if fut.exception() is not None:  # (never cancelled: _Settled)
                self.lanes.pop(key, None)

        watched.add_done_callback(failed)
        return handle, watched

    def _watch(self, handle: int) -> None:
        try:
            self.engine.watch_lane(handle)
        except KeyError:  # the plane stopped first: the stop freed it
            raise RuntimeError("the data plane has stopped") from None

    def remove(self, lane: Lane, handle: int, wait: bool = False) -> asyncio.Future | None:
        """Takes the lane off the plane: nothing it hands over from now on is served. Once what
        this returns is done (at once with ``wait``, which waits on the loop: for a lane that
        never served) the plane's thread no longer touches the lane's ring or sockets (a stopped
        plane's thread has ended, and let go of every lane it had)."""
        self.lanes.pop(lane.plane_key, None)
        if wait:
            if not self.stopped:
                self._remove_lane(handle)
            return None
        return self._command(self._remove_lane, handle)

    def _remove_lane(self, handle: int) -> None:
        with contextlib.suppress(KeyError):  # the plane stopped first: its stop let go of the lane
            self.engine.remove_lane(handle)

    def finish_slot(self, handle: int, slot: int, seq: int, code: int, response: bytes,
                    message: bytes) -> None:
        """Ends the loop's answer of handed-off ``slot`` in C (``_kvlane``'s finish_slot: the
        response, the status, the slot given back, DONE, and the doorbell rung only for a client
        asleep on a quiet lane); nothing is written to a lane removed meanwhile (it is closing)."""
        with contextlib.suppress(KeyError):
            self.engine.finish_slot(handle, slot, seq, code, response, message)

    def unwatch_all(self) -> None:
        self.engine.unwatch_all()

    async def drain(self, grace: float) -> None:
        """At shutdown: no new request is taken; the copies running get up to ``grace`` s."""
        self.engine.unwatch_all()
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while self.engine.jobs and loop.time() < end:
            await asyncio.sleep(POLL_SECONDS * 10)

    def stop(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.engine.notify_fd)
        if self.cache is not None:  # no Get walks the cache any more
            with self._cache_lock:
                self.cache.close()
        self.engine.stop()
        self.stopped = True
        # The commands still waiting run nothing now (the thread has ended): the command thread
        # ends once they have.
        self._commands.shutdown(wait=True)
        # The loop's copies still on the thread ended with it (posted as halted): settled here,
        # since the reader is gone; so are its Gets (their pages let go).
        for ticket, status, layers in self.engine.take_completions():
            self._ended(ticket, status, layers)
        self.settle_gets()



