"""The scheduler-side connector: how much of a prompt the node-wide cache holds (a whole-space
Lookup through ``CacheView``, so every TP rank and PP stage of the space holds it), which blocks
to load before a step, and which blocks to store after it.

A request's blocks are stored as they fill (the blocks a step completes, after that step's
forward), not only when it finishes: another replica can hit a long prompt while its first
request still decodes. A finished request whose last blocks are still being stored keeps them
(``request_finished`` answers True) until every worker reports its Puts done.

A request that loads stores nothing more until its load is known good on every worker (their
step reports, ``KVServerWorkerMeta``): blocks computed on top of a load that failed hold wrong
KV under the right keys, and a stored page is never overwritten. After a failed load its blocks
are stored again as vLLM recomputes them. One that finishes in its load's step (vLLM finishes
requests before it hands over the step's reports) keeps its blocks until the report, and stores
then. One preempted and admitted again before its load's report loads nothing until that report
(a report names its request, not its load).

The same holds for every other request that reads those blocks. vLLM caches a loading request's
blocks under their hashes when it allocates them, before they land, so under async scheduling a
request admitted before the failed step's report comes back can hit them in vLLM's own prefix
cache. A request whose local hit includes a block of an unconfirmed load stores nothing until that
load is reported good; if it failed, the request never stores from that block on (what it
computed there was computed on wrong KV). Blocks of a failed load stay suspect until the request
that loaded them has computed them again.

By default (``load`` "auto") a hit the daemon holds in host memory loads with the step (the
forward waits for it, as with ``load`` "sync"), and one its disk tier or the cluster holds in part
loads asynchronously. An asynchronous load (``load`` "async", and every hybrid model's) makes the
request wait in vLLM's WAITING_FOR_REMOTE_KVS until the workers report its Gets ended
(``get_finished``), and vLLM caches its blocks only then: no other request ever reads a block
still loading. A hybrid model (several KV cache groups: full attention
and sliding window) is looked up group by group: the full-attention groups' longest common prefix
h, then each sliding-window group's last blocks below h (the blocks vLLM keeps for a hit of h);
a hit is h only where every group holds its part, else a miss.

A cache reset (``reset``) turns loads and stores off for the rest of the process. vLLM tells only
the scheduler's connector; the workers act on the scheduler's metadata alone, so every worker
(each TP rank and PP stage) stops at the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvclient.away import AwayGate
from kvclient.cache_view import CacheView
from kvclient.results import LookupResult
from kvclient.vllm._events import EventFeed
from kvclient.vllm._meta import KVServerConnectorMetadata, KVServerWorkerMeta, LoadJob, SaveJob
from kvclient.vllm._space import Group, Space, block_keys, hashed_blocks

logger = logging.getLogger("kvclient.vllm")

NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block): a sliding window's skipped blocks


class _NotYet:
    """A lookup the step had no time left for: the request is asked about again next step."""


NOT_YET = _NotYet()


@dataclass(frozen=True)
class _Hit:
    """A lookup's answer: ``pages`` leading blocks every group can serve, pinned under one lease
    per group (indexed as the groups; empty on a miss)."""

    pages: int
    leases: tuple[str, ...] = ()
    disk: int = 0  # of the pages, those the daemon holds only on disk or in the cluster (brought first)


@dataclass
class _Req:
    request: object
    local: int = 0  # tokens vLLM's own prefix cache had (block-aligned), at the last lookup
    found: int = 0  # leading blocks the cache holds, at the last lookup
    leases: tuple[str, ...] = ()
    saved: int = 0  # leading blocks stored or known stored
    saving: bool = False  # a Put was asked for: vLLM keeps its blocks until the workers' Puts end
    loading_from: int | None = None  # first block of a load not yet reported good by the workers
    load_first: int = 0  # first block of its last load
    async_failed: bool = False  # an asynchronous load of it failed: it loads no more, it recomputes
    async_load: bool = False  # its load, if it has one, is asynchronous (vLLM's WAITING_FOR_REMOTE_KVS)
    lookup: Future | None = field(default=None, repr=False)
    asked: float = 0.0  # when that lookup was asked (time.monotonic)
    answer: tuple[_Hit, float] | None = None  # the last answer that pins, and when it was asked
    load_end: int = 0  # the index, among its blocks, past the last one its load writes
    load_failed: bool = False  # its load was reported failed: vLLM computes those blocks again
    # Loads this request's local prefix hit reads before they are reported: loading request ->
    # the first of its blocks among this request's. Nothing is stored while any is left.
    depends: dict[str, int] = field(default_factory=dict)
    tainted_from: int | None = None  # its first block read from, or computed on, a failed load


def _view(g: Group, cfg: dict) -> CacheView:
    """A view of group ``g``'s space on the daemon."""
    return CacheView(cfg.get("address"), model=g.space.model, layout=g.space.layout, dtype=g.space.dtype,
                     page_size=g.space.page_size, num_layers=g.space.num_layers, tp_size=g.space.tp_size,
                     pp_size=g.space.pp_size, timeout=float(cfg.get("lookup_timeout_s", 1.0)),
                     token=cfg.get("token"), tenant_token=cfg.get("tenant_token"), weights=g.space.weights)


class SchedulerSide:
    def __init__(self, groups: Space | tuple[Group, ...], cfg: dict, enabled: bool,
                 block_ids: Callable[[str], tuple[list[int], ...]], *, loads: bool = True,
                 saves: bool = True, events: bool = False) -> None:
        if isinstance(groups, Space):  # one full-attention group
            groups = (Group(index=0, space=groups, layer_names=()),)
        self.groups = groups
        self.space = space = groups[0].space
        self.hybrid = len(groups) > 1 or groups[0].window_blocks is not None
        self.enabled = enabled  # keys shared across processes (keys_shareable): the cache is on
        self.stopped = False  # a cache reset turned loads and stores off for good (reset())
        self.loads = loads  # kv_role kv_consumer or kv_both
        self.saves = saves  # kv_role kv_producer or kv_both
        self.block_size = space.page_size
        self.pin_ms = int(cfg.get("lookup_pin_ms", 10_000))
        self.lookup_timeout = float(cfg.get("lookup_timeout_s", 1.0))
        self._step_deadline: float | None = None  # when this step's synchronous lookups must end
        self.max_loads = int(cfg.get("event_slots", 16))  # a worker's Gets in flight in one step
        mode = str(cfg.get("lookup", "sync"))
        if mode not in ("sync", "async"):
            raise ValueError(f"kv_connector_extra_config.lookup must be 'sync' or 'async', not {mode!r}")
        self._async = mode == "async"
        load = str(cfg.get("load") or ("async" if self.hybrid else "auto"))
        if load not in ("sync", "async", "auto"):
            raise ValueError(f"kv_connector_extra_config.load must be 'sync', 'async' or 'auto', "
                             f"not {load!r}")
        if self.hybrid and load != "async":
            raise ValueError("a hybrid model (several KV cache groups or a sliding window) loads "
                             "asynchronously: vLLM takes failed loads of such models per request only; "
                             f"drop \"load\": \"{load}\"")
        self.async_loads = load == "async"
        # "auto": a hit held in the daemon's host memory loads with the step (sync); one the daemon
        # reads back from its disk tier or pulls from the cluster first loads asynchronously, so no
        # step waits on a disk or a network.
        self.auto_loads = load == "auto"
        # Lookups (async mode) and releases run here, off the scheduler's thread.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserver-lookup")
        self._block_ids = block_ids
        self.views = [_view(g, cfg) for g in groups]
        self.view = self.views[0]
        self._reqs: dict[str, _Req] = {}
        # Blocks whose KV is not known good, by vLLM block id: those of loads not yet reported
        # (block -> loading request), and those read from or computed on a load that failed
        # (block -> (whose, the key it should hold): a block vLLM reused for other content no
        # longer matches its key, and is forgotten then).
        self._loading_blocks: dict[int, str] = {}
        self._bad_blocks: dict[int, tuple[str, bytes]] = {}
        self._unreported: dict[str, list[tuple[int, bytes]]] = {}  # loading request -> (block, key)
        self._dependents: dict[str, set[str]] = {}  # loading request -> requests that read its blocks
        self._loads: list[LoadJob] = []
        self._loading_reqs = 0  # requests with loads in this step
        # Asynchronous loads not yet reported by the workers: they hold a worker's event slot
        # (CUDA) across steps, so they count against event_slots until they end.
        self._async_loading: set[str] = set()
        self._finish_saves: list[SaveJob] = []
        # Finished requests whose stores wait for a load's report (their own synchronous load's, or
        # one their local hit read): request -> (tokens computed, its blocks). vLLM holds their
        # blocks (request_finished answered True) until the workers report them in
        # finished_sending, which they do once told (``_released``, the next step's ``finished``).
        self._held: dict[str, tuple[int, tuple[list[int], ...]]] = {}
        self._released: set[str] = set()
        # After one lookup that failed, lookups miss without asking until a probe (off this
        # thread) finds the daemon answering: a stuck daemon costs the scheduler one bounded wait.
        self.away = AwayGate(self.view.ping, name="kvserver-vllm-probe")
        # KV events of the node's cache for this engine's router (vLLM's KV events on).
        self.events: EventFeed | None = None
        if events and enabled and bool(cfg.get("kv_events", True)):
            # Views of its own: its calls never count against the lookups' (the away gate).
            interval = max(10.0, float(cfg.get("events_interval_ms", 100))) / 1000
            self.events = EventFeed([_view(g, cfg) for g in groups], [g.index for g in groups],
                                    self.block_size, interval)

    def take_events(self) -> list:
        """The node cache's KV events for this engine since the last call (vLLM's own event
        types); none unless vLLM's KV events are on."""
        return self.events.take() if self.events is not None else []

    # ---- lookup ----------------------------------------------------------------------------

    def _step_left(self) -> float | None:
        """Seconds the scheduler's step may still wait on lookups (synchronous lookups: one
        ``lookup_timeout_s`` a step, all of them together); None for lookups off its thread."""
        if self._async:
            return None
        now = time.monotonic()
        if self._step_deadline is None:
            self._step_deadline = now + self.lookup_timeout
        return self._step_deadline - now

    def _ask(self, view: CacheView, keys: list[bytes]) -> LookupResult | None | _NotYet:
        """The view's lookup of ``keys``; None: a miss (the daemon away, slow or refusing, and
        the away gate closed); ``NOT_YET``: the step's lookup time is spent (asked next step)."""
        first = self._step_deadline is None  # the step's first lookup has the whole bound
        left = self._step_left()
        if left is not None and left <= 0:
            return NOT_YET
        cut = left is not None and not first and left < self.lookup_timeout  # (bound: the step's rest)
        misses = view.misses
        try:
            found = view.lookup(b"".join(keys), pin_ms=self.pin_ms, key_bytes=len(keys[0]), timeout=left)
        except Exception as exc:  # the daemon refused: a miss, never the scheduler's end
            logger.warning("kvserver: lookup failed (%s): a miss", exc)
            found = None
        if found is None or view.misses > misses:
            if cut:  # on the step's rest of its time: asked again next step with a whole bound
                return NOT_YET
            self.away.failed()  # away, slow or refusing: no more waits
            return None
        return found

    WINDOW_TRIES = 3  # window checks of one lookup, each below the last one's missing block

    def _lookup(self, keys: list[bytes]) -> _Hit | None:
        """The hit every group serves; None: the step's lookup time ran out (ask next step)."""
        if not self.away.open:
            return _Hit(0)
        leases = [""] * len(self.groups)
        full = [g for g in self.groups if g.window_blocks is None]
        windows = [g for g in self.groups if g.window_blocks is not None]
        if not full:  # windows only: the first one's stored prefix bounds the hit
            full, windows = windows[:1], windows[1:]
        h, disk, late = len(keys), 0, False
        for g in full:
            found = self._ask(self.views[g.index], keys[:h]) if h else None
            if found is None or found is NOT_YET:
                h, late = 0, found is NOT_YET
                break
            leases[g.index] = found.lease_id
            h = min(h, found.pages)
            disk = max(disk, found.away_pages)
        found_all = not windows
        for _ in range(self.WINDOW_TRIES if windows and h else 0):
            found_all, h = self._windows(keys, h, windows, leases)
            if h is None:
                h, late = 0, True
            if found_all or h == 0:
                break
        if found_all and h > 0:
            return _Hit(h, tuple(leases), disk)
        self._release_all(tuple(leases))
        return None if late else _Hit(0)

    def _windows(self, keys: list[bytes], h: int, windows: list[Group],
                 leases: list[str]) -> tuple[bool, int | None]:
        """Asks each window group for the blocks vLLM keeps below a hit of ``h``, from ``h`` down:
        (True, h) once they all have them; else (False, the hit to try next: below the first
        missing block found), and 0 when there is none, None when the step's time ran out."""
        for g in windows:
            if leases[g.index]:  # an earlier try's pin: that try missed
                self._release(leases[g.index], g.index)
                leases[g.index] = ""
        for g in windows:
            ask = keys[max(0, h - g.window_blocks):h][::-1]
            found = self._ask(self.views[g.index], ask)
            if found is None or found is NOT_YET:
                return False, None if found is NOT_YET else 0
            leases[g.index] = found.lease_id
            if found.pages < len(ask):
                return False, max(0, h - found.pages - 1)
        return True, h

    def _set_leases(self, st: _Req, leases: tuple[str, ...]) -> None:
        self._release_all(tuple(old if old not in leases else "" for old in st.leases))
        st.leases = leases

    def _release_all(self, leases: tuple[str, ...]) -> None:
        for g, lease in enumerate(leases):
            if lease:
                self._release(lease, g)

    def _release(self, lease: str, group: int = 0) -> None:
        try:
            self._pool.submit(self._release_now, lease, group)  # never on the scheduler's thread
        except RuntimeError:  # the pool is shut down (the engine stops): here, then
            self._release_now(lease, group)

    def _release_now(self, lease: str, group: int = 0) -> None:
        try:
            self.views[group].release(lease)
        except Exception:
            pass  # it ends by itself at its pin's end

    def _release_answer(self, answer: Future) -> None:
        """The leases of a lookup's answer released, on the pool: a done-callback added to an
        answer already in runs at once, on the thread that adds it (the scheduler's)."""
        if not answer.cancelled() and answer.exception() is None:
            for g, lease in enumerate(answer.result().leases):
                if lease:
                    self._release(lease, g)

    def _answer(self, st: _Req, keys: list[bytes]) -> _Hit | None:
        """This request's lookup answer; None: not yet (async mode: vLLM asks again next step).
        An answer that pins is kept for half its pin's life: a request vLLM cannot admit yet (no
        free blocks, this step's loads full) is not looked up, pinned and released every step."""
        if st.answer is not None and (time.monotonic() - st.answer[1]) * 2000 < self.pin_ms:
            return st.answer[0]
        if not self._async:
            found = self._lookup(keys)
            if found is not None and found.leases:  # a miss pins nothing: asked again, it may find
                st.answer = (found, time.monotonic())   # what was stored since
            return found
        if st.lookup is None:  # answered at a later step, never this one: the step is not held
            st.lookup = self._pool.submit(self._lookup, keys)
            st.asked = time.monotonic()
            return None
        if not st.lookup.done():
            return None
        found, st.lookup = st.lookup.result(), None
        found = found if found is not None else _Hit(0)  # (no step bound off the scheduler's thread)
        # Its age counted from when it was asked (its pin's start, or before), not from now: an
        # answer taken steps later is not held past its pin.
        st.answer = (found, st.asked)
        return found

    @property
    def active(self) -> bool:
        """Loads and stores are on: keys shared across processes, and no cache reset since."""
        return self.enabled and not self.stopped

    def reset(self) -> None:
        """vLLM reset its caches (``reset_cache``): from now on this engine looks nothing up (so
        loads nothing) and asks no Put, logged once at WARNING.

        vLLM runs it from ``EngineCore._reset_caches`` (``pause_generation(clear_cache=True)``,
        as RL loops do around an in-place weight update) and on ``POST
        /reset_prefix_cache?reset_external=true``. The pages stored before it were computed by
        the weights the engine had then, under a KV space whose ``weights`` identity cannot
        change in a running engine; after a weight update loading them would serve KV of other
        weights, and storing new KV there would hand KV of the new weights to engines still on
        the old ones. Nothing tells a reset for a weight update from another one, so every reset
        ends the connector's use of the cache. (Moving to a new identity instead would need every
        worker to register again mid-run under an identity no other engine, nor a later restart
        of this one, could ever take by chance.)

        What was already asked of the workers still runs: Puts a step asked for before the reset
        (of KV the old weights computed, into blocks vLLM holds until they end), loads already
        started (a reset vLLM reports successful has none: their requests hold blocks), and the
        hybrid models' ``reused`` lists that keep those Puts from reading given-out blocks. Pins
        held for requests not yet admitted are released, and the node cache's events are no
        longer published for this engine."""
        if self.stopped:
            return
        self.stopped = True
        if self.enabled:
            logger.warning("kvserver: vLLM reset its caches (reset_prefix_cache with reset_connector, as "
                           "pause_generation(clear_cache=True) around a weight update does): the connector "
                           "no longer loads or stores for the rest of this process, since the node cache's "
                           "pages were computed under this engine's weights identity before the reset; "
                           "restart the engine (with a new \"weights\" if its weights changed) to use the "
                           "cache again")
        for st in self._reqs.values():
            self._drop_pins(st)
            st.lookup = None
            st.answer = None
        if self.events is not None:
            self.events.close()
            self.events = None

    def _drop_pins(self, st) -> None:
        """Releases what the request's lookups pin: the leases held, and a lookup still running's
        once it answers."""
        if st.lookup is not None:
            st.lookup.add_done_callback(self._release_answer)
        self._set_leases(st, ())

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.active:
            return 0, False
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(request)
        st.local = num_computed_tokens
        # As vLLM's own prefix cache: whole blocks, and at least the prompt's last token computed.
        keys = block_keys(request, self.space.hash_stride, (request.num_tokens - 1) // self.block_size)
        if not self.loads or not keys or not self.away.open or st.async_failed:
            # After an asynchronous load that failed, vLLM computes the request from its start
            # (as a failed synchronous load's blocks): never load, fail, load again.
            st.found = 0
            return 0, False
        found = self._answer(st, keys)
        if found is None:
            return None, False
        if found.leases != st.leases:
            self._set_leases(st, found.leases)
        st.found = min(found.pages, len(keys))
        st.saved = max(st.saved, st.found)
        external = max(0, st.found * self.block_size - num_computed_tokens)
        if external and rid in self._unreported:
            # Admitted again (preempted) before the workers reported its last synchronous load, as
            # with more than two steps in flight: a report names its request, not its load, so a
            # second load waits for the first one's report (asked again next step, pin kept).
            return None, False
        if external and self._loading_reqs + len(self._async_loading) >= self.max_loads:
            # This step's loads are full: not a miss (that would recompute the whole prefix), but
            # "ask again next step", its answer and pin kept for then.
            return None, False
        st.async_load = external > 0 and (self.async_loads or (self.auto_loads and found.disk > 0))
        return external, st.async_load

    def _check_local_hit(self, st: _Req, ids: list[int]) -> None:
        """The blocks vLLM's own prefix cache gave the request: any of an unreported load makes it
        wait for that report before it stores; any read from, or computed on, a failed load (its
        own included, after a preemption) stops its stores there."""
        rid = st.request.request_id
        keys = block_keys(st.request, self.space.hash_stride, len(ids))
        for i, block in enumerate(ids):
            owner = self._loading_blocks.get(block)
            if owner is not None and owner != rid:
                if owner not in st.depends:
                    st.depends[owner] = i
                    self._dependents.setdefault(owner, set()).add(rid)
                continue
            bad = self._bad_blocks.get(block)
            if bad is None:
                continue
            if i < len(keys) and bad[1] != keys[i]:
                del self._bad_blocks[block]  # vLLM reused it for other content since
            else:
                self._taint(st, i)

    def _taint(self, st: _Req, first: int) -> None:
        """The request's blocks from ``first`` on were read from, or computed on, a failed load:
        never stored, and suspect to any request that hits them in vLLM's prefix cache."""
        st.tainted_from = first if st.tainted_from is None else min(st.tainted_from, first)
        self._mark_bad(st)

    def _mark_bad(self, st: _Req, ids: list[int] | None = None) -> None:
        req = st.request
        if st.tainted_from is None:
            return
        ids = list(ids) if ids is not None else list(self._block_ids(req.request_id)[0])
        keys = block_keys(req, self.space.hash_stride, len(ids), start=st.tainted_from)
        for block, key in zip(ids[st.tainted_from:], keys, strict=False):
            # A block of the failed load itself keeps its loader's mark: the loader computes it
            # again in place, and its mark goes then.
            old = self._bad_blocks.get(block)
            if old is None or old[1] != key:
                self._bad_blocks[block] = (req.request_id, key)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.answer = None  # admitted: a later lookup (after a preemption, say) asks again
        all_ids = blocks.get_block_ids()
        if self._loading_blocks or self._bad_blocks:
            local = st.local // self.block_size
            if local:
                self._check_local_hit(st, list(all_ids[0])[:local])
        if num_external_tokens <= 0:
            self._set_leases(st, ())  # nothing to load: the pin is not needed
            return
        rid = request.request_id
        first = st.local // self.block_size
        n = -(-num_external_tokens // self.block_size)
        keys = block_keys(request, self.space.hash_stride, first + n, start=first)
        key_bytes = len(keys[0]) if keys else 32
        for g in self.groups:
            lease = st.leases[g.index] if st.leases else ""
            ids = list(all_ids[g.index])[first:first + n]
            # A shorter key list (cannot happen with vLLM's own numbers) loads fewer blocks, and the
            # worker reports the rest as failed: vLLM recomputes them, never reads them unloaded.
            pairs = list(zip(ids, keys, strict=False))
            if g.window_blocks is not None:  # below the window vLLM holds null blocks: not loaded
                pairs = [(b, k) for b, k in pairs if b != NULL_BLOCK]
                ids = [b for b, _ in pairs]
            if not ids:
                if lease:
                    self._release(lease, g.index)
                continue
            self._loads.append(LoadJob(rid, b"".join(k for _, k in pairs), ids, lease, key_bytes=key_bytes,
                                       group=g.index, asynchronous=st.async_load))
        self._loading_reqs += 1
        if st.async_load:
            self._async_loading.add(rid)
        st.leases = ()  # the Gets end them
        st.loading_from = st.load_first = first
        st.load_end, st.load_failed = first + n, False
        if st.async_load:
            return  # vLLM caches the blocks once they landed: no other request reads them before
        ids = list(all_ids[0])[first:first + n]
        self._unreported[rid] = list(zip(ids, keys, strict=False))
        for block in ids:
            self._loading_blocks[block] = rid

    # ---- per step --------------------------------------------------------------------------

    def _save_jobs(self, st: _Req, computed_tokens: int,
                   block_ids: tuple[list[int], ...] | None = None) -> list[SaveJob]:
        if st.loading_from is not None or st.depends:
            return []  # blocks computed on an unconfirmed load wait for the workers' report
        req = st.request
        full = min(hashed_blocks(req, self.space.hash_stride), computed_tokens // self.block_size)
        if st.tainted_from is not None:
            full = min(full, st.tainted_from)  # never a block read from, or computed on, a failed load
        if st.load_failed and full >= st.load_end:  # its failed blocks computed again: good now
            rid = req.request_id
            for block in [b for b, (owner, _) in self._bad_blocks.items() if owner == rid]:
                del self._bad_blocks[block]
            st.load_failed = False
        if full <= st.saved:
            return []  # the common decode step: nothing new, nothing read
        all_ids = block_ids if block_ids is not None else self._block_ids(req.request_id)
        if any(len(all_ids[g.index]) < full for g in self.groups):
            return []
        keys = block_keys(req, self.space.hash_stride, full, start=st.saved)
        jobs = []
        for g in self.groups:
            pairs = list(zip(all_ids[g.index][st.saved:full], keys, strict=False))
            if g.window_blocks is not None:  # blocks vLLM freed below the window are not stored
                pairs = [(b, k) for b, k in pairs if b != NULL_BLOCK]
            if pairs:
                jobs.append(SaveJob(req.request_id, b"".join(k for _, k in pairs), [b for b, _ in pairs],
                                    key_bytes=len(keys[0]), group=g.index))
        st.saved = full
        st.saving = st.saving or bool(jobs)
        return jobs

    def _reused(self, scheduler_output, loads: list[LoadJob]) -> set[int]:
        """Hybrid models: the blocks this step writes into, given out to its requests (from each
        one's first uncomputed block on: below it, a local hit's blocks are only read) or loaded
        into. vLLM frees a sliding window's blocks while their request runs, so one of them may
        still be read by a Put queued in an earlier step: the workers finish such Puts before the
        forward (handle_preemptions)."""
        out: set[int] = set()
        bs = self.block_size
        for r in scheduler_output.scheduled_new_reqs:
            for ids in r.block_ids:
                out.update(ids[r.num_computed_tokens // bs:])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            # A resumed request's are its whole table; another's, the blocks added this step.
            skip = cached.num_computed_tokens[i] // bs if rid in resumed else 0
            for ids in new or ():
                out.update(ids[skip:])
        for job in loads:
            out.update(job.block_ids)
        out.discard(NULL_BLOCK)
        return out

    def build_connector_meta(self, scheduler_output) -> KVServerConnectorMetadata:
        meta = KVServerConnectorMetadata(loads=self._loads, saves=self._finish_saves,
                                         preempted=set(scheduler_output.preempted_req_ids or ()),
                                         finished=self._released)
        self._loads, self._finish_saves, self._loading_reqs, self._released = [], [], 0, set()
        self._step_deadline = None  # the next step's lookups get their own lookup_timeout_s
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:  # its blocks went back to vLLM once the workers' Puts read them
                st.saving = False
        if self.hybrid and self.enabled:  # after a reset too: Puts asked before it may still run
            meta.reused = self._reused(scheduler_output, meta.loads)
        if not self.active or not self.saves:
            return meta
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            # The blocks this step's forward fills; stored after it (wait_for_save).
            meta.saves.extend(self._save_jobs(st, st.request.num_computed_tokens + n))
        return meta

    def update_connector_output(self, connector_output) -> None:
        """The workers' step report: which synchronous loads landed on every one of them
        (``KVServerWorkerMeta``), and which asynchronous loads ended on all of them, failed or
        not (vLLM's aggregated ``finished_recving`` and ``failed_recving``)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVServerWorkerMeta):
            for rid, ok in meta.loads.items():
                self._load_done(rid, ok)
        failed = getattr(connector_output, "failed_recving", None) or ()
        for rid in getattr(connector_output, "finished_recving", None) or ():
            if rid in self._async_loading:
                self._async_loading.discard(rid)
                self._load_done(rid, rid not in failed, asynchronous=True)
        if self._held:
            self._settle_held()

    def _settle_held(self) -> None:
        """Finished requests held for a load's report that came: what they computed is stored
        (not past a failed load's blocks), and the workers report them once those Puts ended."""
        for rid, (computed, block_ids) in list(self._held.items()):
            st = self._reqs[rid]
            if st.loading_from is not None or st.depends:
                continue
            del self._held[rid]
            if st.load_failed:  # its own load failed, and nothing computes those blocks again (vLLM
                self._taint(st, st.load_first)  # 0.33 sets a failed request's tokens back first)
            self._finish(st, computed, block_ids)
            self._released.add(rid)

    def _load_done(self, rid: str, ok: bool, asynchronous: bool = False) -> None:
        st = self._reqs.get(rid)
        self._load_reported(rid, st, ok)
        if st is None:
            return
        if not ok:  # vLLM recomputes from the first failed block: those are stored again then
            st.saved = min(st.saved, st.load_first)
            st.async_failed = st.async_failed or asynchronous
        st.loading_from = None

    def _load_reported(self, rid: str, st: _Req | None, ok: bool) -> None:
        """A load is known good or failed (its request may have finished already): the requests
        that read its blocks learn which."""
        for block, key in self._unreported.pop(rid, ()):
            if self._loading_blocks.get(block) == rid:
                del self._loading_blocks[block]
                if not ok:
                    self._bad_blocks[block] = (rid, key)
        if st is not None and not ok:
            st.load_failed = True
        for other in self._dependents.pop(rid, ()):
            dep = self._reqs.get(other)
            if dep is None:
                continue
            first = dep.depends.pop(rid, None)
            if first is not None and not ok:
                self._taint(dep, first)

    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """``block_ids``: the request's blocks, one list per KV cache group."""
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            return False, None
        if rid in self._async_loading:
            # Its Gets still write its blocks: vLLM holds them until the workers report the load
            # (finished_recving), and frees them then. It computed nothing to store.
            del self._reqs[rid]
            self._set_leases(st, ())
            return False, None
        self._drop_pins(st)
        # Blocks whose KV is written but whose hash came after their step was scheduled (decode
        # tokens under async scheduling) are stored by the next step's workers.
        computed = max(0, request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0) or 0))
        full = min(hashed_blocks(request, self.space.hash_stride), computed // self.block_size)
        if self.active and self.saves and (st.loading_from is not None or st.depends) and full > st.saved:
            # Finished in the step of a load whose report comes after this call (vLLM finishes
            # requests before it hands the connector the step's output), or on a local hit of one:
            # its blocks are held until the report says whether what it computed can be stored.
            self._held[rid] = (computed, block_ids)
            return True, None
        self._finish(st, computed, block_ids)
        return st.saving, None

    def _finish(self, st: _Req, computed: int, block_ids: tuple[list[int], ...]) -> None:
        """The request ends: forgotten, the blocks it computed and has not stored yet stored by
        the workers' next step (``computed`` tokens, of ``block_ids``)."""
        del self._reqs[st.request.request_id]
        self._forget_loads(st, st.request, block_ids)
        if self.active and self.saves:
            self._finish_saves.extend(self._save_jobs(st, computed, block_ids))

    def _forget_loads(self, st: _Req, request, block_ids: tuple[list[int], ...]) -> None:
        """A request ends. Its load's report, if still to come, resolves its blocks then; what it
        computed on a failed load stays marked (its last blocks too); it waits on no load more."""
        rid = request.request_id
        self._mark_bad(st, block_ids[0])
        for owner in st.depends:
            deps = self._dependents.get(owner)
            if deps is not None:
                deps.discard(rid)
                if not deps:
                    del self._dependents[owner]

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.close()
        for st in self._reqs.values():
            self._release_all(st.leases)
        self._reqs.clear()
        self.away.close()
        self._pool.shutdown(wait=True, cancel_futures=False)
        for view in self.views:
            view.close()
