"""The daemon's own KV event publisher (--kv-events-endpoint): every space's stores and removals
in every tier, in vLLM's schema, on a ZMQ PUB socket, one topic per space; with
--kv-events-replay-endpoint, a ROUTER socket where a subscriber that missed batches asks for them
from a sequence number (vLLM's replay protocol: the start as 8 bytes big-endian, answered with the
buffered (topic, seq, payload) frames and an end marker of seq -1).

For routers that index shared tiers (the node's cache as one place): its events carry no engine's
identity. Routers that steer requests to engines get them through each engine's own publisher
(the vLLM connector's ``take_events``).

The event loop only queues a record (a copy of the keys' arrays); a thread turns keys into block
hashes as vLLM makes them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default: the key's
bytes as a big-endian integer, its low 64 bits; else the bytes), encodes and sends, batching what arrived
within ``FLUSH_SECONDS`` per space. A full queue drops records (``dropped``), never blocks the loop.

Primitives: ``ZmqPublisher`` (``record``, ``close``, ``endpoint``, ``replay_endpoint``) and
``space_topic``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from hashlib import blake2b
from urllib.parse import quote

from kvserver.store import Keys, SpaceKey
from kvserver.store.keep import space_json

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 0.05
MAX_QUEUED_KEYS = 1 << 20  # keys of records waiting for the thread, at most
REPLAY_BATCHES = 10_000  # batches kept for replay, at most
REPLAY_BYTES = 256 << 20  # and their payloads' bytes, at most
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
    """``kvserver/<tenant>/<space digest>``: the topic of a space's events (a subscriber filters
    one space by it, a tenant by its prefix)."""
    record = json.dumps(space_json(space), sort_keys=True, separators=(",", ":"))
    digest = blake2b(record.encode(), digest_size=16, person=b"kvserver-space").hexdigest()
    return f"kvserver/{quote(space.tenant, safe='')}/{digest}"


def block_hash(key: bytes, as_int: bool) -> bytes | int:
    """vLLM's external block hash of a key: its bytes, or (vLLM's default) the integer of its
    bytes, big-endian, in 64 bits."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1) if as_int else key


class ZmqPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, int_hashes: bool = True) -> None:
        import msgspec
        import zmq

        from kvserver.events import schema

        self._schema = schema
        self._encode = msgspec.msgpack.Encoder().encode
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (REPLAY_BATCHES + 1))
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.int_hashes = int_hashes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued_keys = 0  # keys of the records in the queue (the loop adds, the thread takes)
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque()
        self._buffered = 0  # bytes of the payloads kept for replay
        self._seq = 0
        self.dropped = 0  # records dropped for a full queue
        self.sent = 0  # batches sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserver-kv-events", daemon=True)
        self._thread.start()

    def record(self, space: SpaceKey, stored: bool, medium: str, locality: str, keys: Keys,
               ts: float) -> None:
        """On the loop: queues a record (``keys`` owned by it); past ``MAX_QUEUED_KEYS`` waiting,
        drops it (counted in ``dropped``)."""
        with self._lock:
            if self._queued_keys + len(keys) > MAX_QUEUED_KEYS:
                self.dropped += 1
                return
            self._queued_keys += len(keys)
        self._queue.put((space, stored, medium, locality, keys, ts))

    def _event(self, space: SpaceKey, stored: bool, medium: str, locality: str, keys: Keys):
        hashes = [block_hash(k, self.int_hashes) for k in keys.as_bytes() if k is not None]
        if not hashes:
            return None
        s = self._schema
        if stored:
            return s.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                 block_size=space.page_size, lora_id=None, medium=medium, lora_name=None,
                                 locality=locality)
        return s.BlockRemoved(block_hashes=hashes, medium=medium, locality=locality)

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the sockets are this thread's: closed here, never from another thread
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _loop(self) -> None:
        pending: dict[SpaceKey, list] = {}
        flush_at = 0.0
        drain_until = None
        while True:
            if self._stop.is_set():
                if drain_until is None:
                    drain_until = time.monotonic() + 1.0  # what was recorded goes out, for a second
                if self._queue.empty() or time.monotonic() > drain_until:
                    self._flush(pending)
                    return
            self._serve_replay()
            try:
                space, stored, medium, locality, keys, ts = self._queue.get(timeout=FLUSH_SECONDS / 2)
                with self._lock:
                    self._queued_keys -= len(keys)
                ev = self._event(space, stored, medium, locality, keys)
                if ev is not None:
                    if not pending:
                        flush_at = time.monotonic() + FLUSH_SECONDS
                    pending.setdefault(space, []).append(ev)
            except queue.Empty:
                pass
            except Exception:
                logger.exception("a KV event could not be made")
            if pending and (time.monotonic() >= flush_at or self._stop.is_set()):
                self._flush(pending)

    def _flush(self, pending: dict) -> None:
        for space, events in pending.items():
            self._send(space_topic(space).encode(), self._schema.KVEventBatch(ts=time.time(), events=events))
        pending.clear()

    def _send(self, topic: bytes, batch) -> None:
        try:
            payload = self._encode(batch)
            self._seq += 1
            self._pub.send_multipart((topic, self._seq.to_bytes(8, "big"), payload))
            self._buffer.append((self._seq, topic, payload))
            self._buffered += len(payload)
            while len(self._buffer) > REPLAY_BATCHES or self._buffered > REPLAY_BYTES:
                self._buffered -= len(self._buffer.popleft()[2])
            self.sent += 1
        except Exception:
            logger.exception("a KV event batch could not be sent")

    def _serve_replay(self) -> None:
        if self._replay is None or not self._replay.poll(0):
            return
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                return
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, topic, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        except Exception:
            logger.exception("a KV event replay failed")

    def close(self) -> None:
        """Sends what is queued (a second at most) and closes; the thread closes its sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._ctx.term()
