"""The daemon's own KV event publisher (--kv-events-endpoint): every space's stores and removals
in every tier, in vLLM's schema, on a ZMQ PUB socket, one topic per space; with
--kv-events-replay-endpoint, a ROUTER socket where a subscriber that missed batches asks for them
from a sequence number (vLLM's replay protocol: the start as 8 bytes big-endian, answered with the
buffered (topic, seq, payload) frames and an end marker of seq -1).

One sequence numbers the whole stream, every topic's batches together (vLLM's replay request
names no topic): a subscriber that finds gaps by it, or asks for replays, subscribes to the whole
stream and keeps the topics it wants by the topic frame (a replay answer carries each batch's
topic); a subscriber of some topics only sees the others' numbers as gaps, and must not ask for
replays, which hand it every topic's batches.

For routers that index shared tiers (the node's cache as one place per topic): its events carry no
engine's identity. Routers that steer requests to engines get them through each engine's own
publisher (the vLLM connector's ``take_events``).

The event loop only queues a record (a copy of the keys' arrays, in chunks of a batch's size); a
thread turns keys into block hashes as vLLM makes them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default: the key's bytes as a big-endian integer, its low 64 bits; else the bytes), encodes
and sends, batching what arrived within ``FLUSH_SECONDS`` per space, each batch's payload
``BATCH_BYTES`` at most: its events' own fields (a BlockStored's map is ~125 bytes beyond its
hashes) are counted with their hashes, so the sockets' high-water marks, counted in batches, bound
bytes too. Consecutive removals of one medium and locality in a batch share one ``BlockRemoved``
(a set of hashes: the order of removals has no meaning); stores are never merged (a BlockStored's
hashes may be read as a chain).
A record that finds ``MAX_QUEUED_KEYS`` waiting is dropped, never blocking the loop (a record into
a shorter queue is taken whole, however large); the space's topic then gets vLLM's
``AllBlocksCleared`` once what was queued before the drop is out, so a router forgets what it knew
of the space rather than keep a page whose removal it never heard. Drops are counted
(``dropped``, ``dropped_keys``: the metrics' ``kvserver_kv_events_dropped_keys_total``) and
logged, once a burst. Each topic's first batch after the publisher starts begins with
``AllBlocksCleared`` too: what a router learned from an earlier daemon is void.

A replay answer goes out as its peer reads: at most ``REPLAY_HWM`` batches queued for one peer,
the rest sent as that queue drains, whole and in order (never cut short: a subscriber applies the
live batch once its replay ended), a peer's further requests answered in turn; an answer whose
peer read nothing for ``REPLAY_STALL_SECONDS`` is ended, and at most ``REPLAY_ANSWERS`` peers'
run at once. A replay batch is queued without a copy: every peer's queue refers to the one
zero-copy frame the replay buffer keeps of it, so silent peers cost ZMQ's bookkeeping of their
messages, not copies of the buffer. Neither socket asks who connects.

Primitives: ``ZmqPublisher`` (``record``, ``start``, ``close``, ``endpoint``, ``replay_endpoint``)
and ``space_topic``.
"""

from __future__ import annotations

import errno
import json
import logging
import queue
import threading
import time
from collections import deque
from hashlib import blake2b
from urllib.parse import quote

from kvserver.store import MAX_KEY_BYTES, Keys, SpaceKey
from kvserver.store.keep import space_json

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 0.05
MAX_QUEUED_KEYS = 1 << 20  # keys of records waiting for the thread: a record finding this many is dropped
BATCH_BYTES = 64 << 10  # a batch's encoded payload, at most (msgpack: 9 an int hash, 2 + a key's bytes)
BATCH_FRAMING = 64  # of them, the batch's own array, ts and a leading AllBlocksCleared (39 bytes), at most
EVENT_ROOM = 256  # an event's own fields beyond its hashes (~125 bytes), at most: a chunk fits a batch
PUB_HWM = 1024  # batches ZMQ queues for one subscriber, at most (64 MiB): past it, it misses batches
REPLAY_BATCHES = 10_000  # batches kept for replay, at most
REPLAY_BYTES = 256 << 20  # and their payloads' bytes, at most
REPLAY_HWM = 64  # batches of a replay answer ZMQ queues for its peer, at most (4 MiB)
REPLAY_ANSWERS = 32  # peers with a replay answer under way, at most (a new one ends the stalest's)
REPLAY_ASKED = 4  # requests of one peer waiting for its answer under way, at most (more: unanswered)
REPLAY_STALL_SECONDS = 30.0  # an answer whose peer took nothing this long is ended
WARN_QUIET_SECONDS = 1.0  # drops this far apart are one burst, logged once it is over
WARN_EVERY_SECONDS = 30.0  # a longer burst is logged this often
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def check_events_installed() -> None:
    """ValueError, saying what to install, if pyzmq or msgspec cannot be imported here."""
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--kv-events-endpoint needs pyzmq and msgspec ({exc}): "
                         "pip install 'kvserver[events]'") from None


def space_topic(space: SpaceKey) -> str:
    """``kvserver/<tenant>/<space digest>``: the topic of a space's events (the topic frame names
    the space of each batch, and a tenant's by its prefix; the sequence numbers the whole stream)."""
    record = json.dumps(space_json(space), sort_keys=True, separators=(",", ":"))
    digest = blake2b(record.encode(), digest_size=16, person=b"kvserver-space").hexdigest()
    return f"kvserver/{quote(space.tenant, safe='')}/{digest}"


def block_hash(key: bytes, as_int: bool) -> bytes | int:
    """vLLM's external block hash of a key: its bytes, or (vLLM's default) the integer of its
    bytes, big-endian, in 64 bits."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1) if as_int else key


class _Answer:
    """A peer's replay answer under way: batches ``next_seq`` .. ``last_seq`` still to send, then
    its end; then the answers to the requests it made meanwhile (``asked``: their first and last
    seqs), in order."""

    __slots__ = ("next_seq", "last_seq", "moved_at", "asked")

    def __init__(self, next_seq: int, last_seq: int, now: float) -> None:
        self.next_seq = next_seq
        self.last_seq = last_seq
        self.moved_at = now  # when its peer last took a batch (or asked)
        self.asked: deque[tuple[int, int]] = deque()


class ZmqPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, int_hashes: bool = True,
                 *, start: bool = True) -> None:
        """Binds the sockets; ``start``: starts the thread that publishes (else ``start()`` does:
        records queue until then)."""
        import msgspec
        import zmq

        from kvserver.events import schema

        self._schema = schema
        self._encode = msgspec.msgpack.Encoder().encode
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(PUB_HWM)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer: EAGAIN, not a silent drop
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.int_hashes = int_hashes
        # Keys of one chunk of a record: one event of the widest hashes fits an empty batch.
        self._room = BATCH_BYTES - BATCH_FRAMING  # bytes of a batch's events, at most
        self.batch_keys = (self._room - EVENT_ROOM) // (9 if int_hashes else 2 + MAX_KEY_BYTES)
        self._overheads: dict[tuple, int] = {}  # an event's bytes beyond its hashes, by its fields
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued_keys = 0  # keys of the records in the queue (the loop adds, the thread takes)
        self._lock = threading.Lock()
        self._voided: set[SpaceKey] = set()  # spaces whose last queued item voids them (the loop's)
        # (seq, topic, payload, the payload's zero-copy frame for replays or None), seqs in a row
        self._buffer: deque[tuple[int, bytes, bytes, object]] = deque()
        self._buffered = 0  # bytes of the payloads kept for replay
        self._answers: dict[bytes, _Answer] = {}  # replay answers under way, by peer
        self._topics: dict[SpaceKey, bytes] = {}  # the spaces published since the start
        self._seq = 0
        self.dropped = 0  # records dropped for a full queue
        self.dropped_keys = 0  # and their keys
        self._burst = [0, 0, 0.0, 0.0]  # drops not logged yet: records, keys, first and last (monotonic)
        self.sent = 0  # batches sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserver-kv-events", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Starts publishing (once; for a publisher made with ``start=False``)."""
        self._thread.start()

    def record(self, space: SpaceKey, stored: bool, medium: str, locality: str, keys: Keys,
               ts: float) -> None:
        """On the loop: queues a record (``keys`` owned by it), whole, in chunks of a batch's
        keys; with ``MAX_QUEUED_KEYS`` waiting, drops it (counted) and queues the space's
        AllBlocksCleared instead, unless what it last queued of the space is one."""
        n = len(keys)
        with self._lock:
            full = self._queued_keys >= MAX_QUEUED_KEYS
            if full:
                self.dropped += 1
                self.dropped_keys += n
                now = time.monotonic()
                burst = self._burst
                if not burst[0]:
                    burst[2] = now
                burst[0] += 1
                burst[1] += n
                burst[3] = now
            else:
                self._queued_keys += n
        if full:
            if space not in self._voided:  # after what was queued before: it is void too
                self._voided.add(space)
                self._queue.put((space, stored, medium, locality, None, ts))
            return
        self._voided.discard(space)
        step = self.batch_keys
        for at in range(0, n, step):
            self._queue.put((space, stored, medium, locality, keys[at : at + step], ts))

    def _event(self, space: SpaceKey, stored: bool, medium: str, locality: str, hashes: list):
        s = self._schema
        if stored:
            return s.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                 block_size=space.page_size, lora_id=None, medium=medium, lora_name=None,
                                 locality=locality)
        return s.BlockRemoved(block_hashes=hashes, medium=medium, locality=locality)

    def _hashes_bytes(self, hashes: list) -> int:
        """What ``hashes`` encode to, at most (msgpack: an int in 9 bytes at most, a key of up to
        MAX_KEY_BYTES as bin 8: 2 + its bytes)."""
        return 9 * len(hashes) if self.int_hashes else 2 * len(hashes) + sum(map(len, hashes))

    def _overhead(self, space: SpaceKey, stored: bool, medium: str, locality: str) -> int:
        """What an event of these fields encodes to beyond its hashes, at most: measured once per
        fields (its map, its names and values, its hashes' array header up to array 32)."""
        fields = (stored, medium, locality, space.page_size)
        n = self._overheads.get(fields)
        if n is None:
            empty = self._event(space, stored, medium, locality, [])
            n = self._overheads[fields] = len(self._encode(empty)) + 4
        return n

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the sockets are this thread's: closed here, never from another thread
            self._warn_drops(time.monotonic(), last=True)
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _loop(self) -> None:
        pending: dict[SpaceKey, list] = {}  # per space: [events, their keys]
        flush_at = 0.0
        drain_until = None
        while True:
            if self._stop.is_set():
                if drain_until is None:
                    drain_until = time.monotonic() + 1.0  # what was recorded goes out, for a second
                if self._queue.empty() or time.monotonic() > drain_until:
                    self._flush(pending)
                    return
            moved = self._serve_replay()
            try:
                item = self._queue.get(timeout=0.001 if moved else FLUSH_SECONDS / 2)
                if not pending:
                    flush_at = time.monotonic() + FLUSH_SECONDS
                self._take(pending, *item)
            except queue.Empty:
                pass
            except Exception:
                logger.exception("a KV event could not be made")
            now = time.monotonic()
            if pending and (now >= flush_at or self._stop.is_set()):
                self._flush(pending)
            self._warn_drops(now)

    def _take(self, pending: dict[SpaceKey, list], space: SpaceKey, stored: bool, medium: str,
              locality: str, keys: Keys | None, ts: float) -> None:
        """Adds a record's event to its space's pending batch (``[events, their encoded bytes]``),
        sending the batch first if the event would take it past ``BATCH_BYTES``."""
        s = self._schema
        if keys is None:  # records of the space were dropped: its events waiting here are void too
            pending[space] = [[s.AllBlocksCleared()], 0]  # counted in BATCH_FRAMING
            return
        with self._lock:
            self._queued_keys -= len(keys)
        hashes = [block_hash(k, self.int_hashes) for k in keys.as_bytes() if k is not None]
        if not hashes:
            return
        size = self._hashes_bytes(hashes)
        batch = pending.get(space)
        if batch is not None and not stored and batch[1] + size <= self._room:
            last = batch[0][-1]
            if isinstance(last, s.BlockRemoved) and (last.medium, last.locality) == (medium, locality):
                last.block_hashes.extend(hashes)  # the same removal of more blocks
                batch[1] += size
                return
        size += self._overhead(space, stored, medium, locality)
        if batch is not None and batch[1] + size > self._room:  # full: out now
            self._send(space, batch[0])
            batch = None
        if batch is None:
            batch = pending[space] = [[], 0]
        batch[0].append(self._event(space, stored, medium, locality, hashes))
        batch[1] += size

    def _flush(self, pending: dict[SpaceKey, list]) -> None:
        for space, (events, _) in pending.items():
            self._send(space, events)
        pending.clear()

    def _send(self, space: SpaceKey, events: list) -> None:
        s = self._schema
        topic = self._topics.get(space)
        if topic is None:  # the space's first batch since the start: an earlier daemon's is void
            topic = space_topic(space).encode()
            if not isinstance(events[0], s.AllBlocksCleared):
                events = [s.AllBlocksCleared(), *events]
        try:
            payload = self._encode(s.KVEventBatch(ts=time.time(), events=events))
        except Exception:
            logger.exception("a KV event batch could not be encoded")
            return
        self._topics[space] = topic
        self._seq += 1
        # Replay answers queue this one frame for every peer: references, not copies, of the payload.
        frame = self._zmq.Frame(payload, copy=False) if self._replay is not None else None
        self._buffer.append((self._seq, topic, payload, frame))
        self._buffered += len(payload)
        while len(self._buffer) > REPLAY_BATCHES or self._buffered > REPLAY_BYTES:
            self._buffered -= len(self._buffer.popleft()[2])
        try:
            self._pub.send_multipart((topic, self._seq.to_bytes(8, "big"), payload))
            self.sent += 1
        except Exception:
            logger.exception("a KV event batch could not be sent")

    def _warn_drops(self, now: float, last: bool = False) -> None:
        """Logs the drops of a burst once it is over (and a long one every WARN_EVERY_SECONDS)."""
        with self._lock:
            records, keys, first, latest = self._burst
            if not records or not (last or now - latest >= WARN_QUIET_SECONDS
                                   or now - first >= WARN_EVERY_SECONDS):
                return
            self._burst = [0, 0, 0.0, 0.0]
        logger.warning("KV events: %d records (%d keys) dropped in %.1f s, the publisher's queue full "
                       "(%d keys waiting or more): their spaces' topics get AllBlocksCleared", records,
                       keys, latest - first, MAX_QUEUED_KEYS)

    def _serve_replay(self) -> bool:
        """Takes replay requests and sends what their peers' queues have room for; True if a
        batch went out (more may follow at once)."""
        if self._replay is None:
            return False
        zmq = self._zmq
        now = time.monotonic()
        try:
            for _ in range(REPLAY_ANSWERS):
                if not self._replay.poll(0):
                    break
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3:
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                answer = self._answers.get(client)
                if answer is not None:  # answered after the one under way (a few at most)
                    if len(answer.asked) < REPLAY_ASKED:
                        answer.asked.append((first, self._seq))
                    continue
                if len(self._answers) >= REPLAY_ANSWERS:  # the stalest gives way
                    del self._answers[min(self._answers, key=lambda c: self._answers[c].moved_at)]
                self._answers[client] = _Answer(first, self._seq, now)
        except Exception:
            logger.exception("a KV event replay request failed")
        moved = False
        for client, answer in list(self._answers.items()):
            try:
                self._answer(client, answer, now)
                while answer.asked:
                    answer.next_seq, answer.last_seq = answer.asked.popleft()
                    self._answer(client, answer, now)
                del self._answers[client]
            except zmq.Again:  # its queue is full: the rest once it reads
                if now - answer.moved_at > REPLAY_STALL_SECONDS:
                    logger.info("a KV event replay was ended: its peer took nothing for %.0f s",
                                REPLAY_STALL_SECONDS)
                    del self._answers[client]
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:  # a peer gone ends its answer silently
                    logger.warning("a KV event replay failed: %s", exc)
                del self._answers[client]
            moved |= answer.moved_at == now
        return moved

    def _answer(self, client: bytes, answer: _Answer, now: float) -> None:
        """Sends the rest of ``answer`` and its end; zmq.Again once its peer's queue is full."""
        flags = self._zmq.NOBLOCK
        buf = self._buffer
        while buf and answer.next_seq <= answer.last_seq:
            oldest = buf[0][0]
            if answer.next_seq < oldest:  # gone from the buffer meanwhile (or never there)
                answer.next_seq = oldest
                continue
            seq, topic, _, frame = buf[answer.next_seq - oldest]
            self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), frame), flags)
            answer.next_seq = seq + 1
            answer.moved_at = now
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags)

    def close(self) -> None:
        """Sends what is queued (a second at most) and closes; the thread closes its sockets."""
        self._stop.set()
        if self._thread.ident is None:  # never started: nothing to send
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            return
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._ctx.term()
