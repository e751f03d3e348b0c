"""KV events for the engine's router: what the node's cache (host memory, its disk tier, the
cluster tier) gains and loses of this engine's space, whoever caused it, published through vLLM's
own publisher (the connector's ``take_events``) under this engine's identity.

A thread polls the daemon (``CacheView.events``, every ``events_interval_ms``, 100 by default) for
each KV cache group's space and turns each batch of keys into one vLLM ``BlockStored`` or
``BlockRemoved`` carrying the engine's own block hashes (the keys are vLLM's block hashes, in
vLLM's external form: ``maybe_convert_block_hash``), the medium (``CPU``, ``STORAGE``), the
locality (``LOCAL``, ``REMOTE`` for the cluster tier) and the group. At most ``MAX_PENDING_KEYS``
keys wait for ``take_events``; past that the oldest events are dropped and counted (``dropped``,
``dropped_keys``) and logged once a burst of drops is over (drops ``WARN_QUIET_SECONDS`` apart are
two bursts; a longer one is logged every ``WARN_EVERY_SECONDS``), with the totals since the start:
a burst of evictions costs the engine bounded memory. The daemon knows no token ids: the events carry none
(routers match block hashes). Off unless vLLM's KV events are on (``--kv-events-config``
``enable_kv_cache_events``) and ``kv_events`` is not false in ``kv_connector_extra_config``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import grpc

from kvclient.cache_view import CacheView
from kvclient.errors import KVClientError

logger = logging.getLogger("kvclient.vllm")

MAX_PENDING_KEYS = 1 << 16
WARN_QUIET_SECONDS = 1.0  # drops this far apart are one burst, logged once it is over
WARN_EVERY_SECONDS = 30.0  # a longer burst is logged this often


class EventFeed:
    """``views[i]`` is group ``groups[i]``'s space."""

    def __init__(self, views: list[CacheView], group_indexes: list[int], block_size: int,
                 interval: float = 0.1) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored, self._removed, self._convert = BlockStored, BlockRemoved, maybe_convert_block_hash
        self.views, self.groups, self.block_size, self.interval = views, group_indexes, block_size, interval
        self._where = [("", 0)] * len(views)  # per view: (log id, last seq read)
        self._pending: deque[tuple[int, object]] = deque()  # (keys, event)
        self._pending_keys = 0
        self._lock = threading.Lock()
        self.dropped = 0  # events dropped for want of room (take_events too rare)
        self.dropped_keys = 0  # and their keys
        self._burst = [0, 0, 0.0, 0.0]  # drops not logged yet: events, keys, first and last (monotonic)
        self.gaps = 0  # reads that found the daemon's log had dropped events before them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserver-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._poll_all()
        finally:
            self._warn_drops(time.monotonic(), last=True)

    def _poll_all(self) -> None:
        while not self._stop.wait(self.interval):
            self._warn_drops(time.monotonic())
            for i, view in enumerate(self.views):
                try:
                    self.poll(i, view)
                except KVClientError as exc:
                    if exc.code == grpc.StatusCode.UNIMPLEMENTED:  # a daemon without KV events
                        logger.warning("kvserver: the daemon does not publish KV events (%s): its "
                                       "node cache's events are left out", exc)
                        return
                    logger.debug("kvserver: reading KV events failed", exc_info=True)
                except Exception:  # a daemon away: the next poll tries again
                    logger.debug("kvserver: reading KV events failed", exc_info=True)

    def poll(self, i: int, view: CacheView) -> int:
        """Reads group ``i``'s new events (all there are now); returns how many."""
        n = 0
        while True:
            log_id, seq = self._where[i]
            r = view.events(log_id, seq)
            if r.gap:
                self.gaps += 1
                logger.warning("kvserver: KV events were dropped before seq %d (this engine read too "
                               "rarely): its router may hold stale entries", r.next_seq)
            self._where[i] = (r.log_id, r.next_seq)
            for ev in r.events:
                self._add(ev, self.groups[i])
            n += len(r.events)
            if not r.events or r.log_id != log_id:
                return n

    def _add(self, ev, group: int) -> None:
        hashes = [self._convert(k) for k in ev.keys]
        if not hashes:
            return
        if ev.removed:
            event = self._removed(block_hashes=hashes, medium=ev.medium, group_idx=group,
                                  locality=ev.locality)
        else:
            event = self._stored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                 block_size=self.block_size, lora_id=None, medium=ev.medium, lora_name=None,
                                 group_idx=group, locality=ev.locality)
        with self._lock:
            self._pending.append((len(hashes), event))
            self._pending_keys += len(hashes)
            events = keys = 0
            while self._pending_keys > MAX_PENDING_KEYS and len(self._pending) > 1:
                n, _ = self._pending.popleft()
                self._pending_keys -= n
                events += 1
                keys += n
            if events:
                self.dropped += events
                self.dropped_keys += keys
                now = time.monotonic()
                burst = self._burst
                if not burst[0]:
                    burst[2] = now
                burst[0] += events
                burst[1] += keys
                burst[3] = now

    def _warn_drops(self, now: float, last: bool = False) -> None:
        """Logs the drops of a burst once it is over (and a long one every WARN_EVERY_SECONDS)."""
        with self._lock:
            events, keys, first, latest = self._burst
            if not events or not (last or now - latest >= WARN_QUIET_SECONDS
                                  or now - first >= WARN_EVERY_SECONDS):
                return
            self._burst = [0, 0, 0.0, 0.0]
            total_events, total_keys = self.dropped, self.dropped_keys
        logger.warning("kvserver: %d KV events (%d block hashes) dropped in %.1f s: more than %d block "
                       "hashes waited for the engine to publish them (it steps too rarely), the oldest "
                       "went; its router may hold stale entries (%d events, %d block hashes dropped "
                       "since the start)", events, keys, latest - first, MAX_PENDING_KEYS, total_events,
                       total_keys)

    def take(self) -> list:
        """The events read since the last call, oldest first."""
        with self._lock:
            out = [event for _, event in self._pending]
            self._pending.clear()
            self._pending_keys = 0
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for view in self.views:
            view.close()
