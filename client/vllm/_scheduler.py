"""The scheduler-side connector: how much of a prompt the node-wide cache holds (a whole-space
Lookup through ``CacheView``, so every TP rank and PP stage of the space holds it), which blocks
to load before a step, and which blocks to store after it.

A request's blocks are stored as they fill (the blocks a step completes, after that step's
forward), not only when it finishes: another replica can hit a long prompt while its first
request still decodes. A finished request whose last blocks are still being stored keeps them
(``request_finished`` answers True) until every worker reports its Puts done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvclient.cache_view import CacheView
from kvclient.results import LookupResult
from kvclient.vllm._meta import KVServerConnectorMetadata, LoadJob, SaveJob
from kvclient.vllm._space import Space, block_keys

logger = logging.getLogger("kvclient.vllm")

KEY_BYTES = 32  # vLLM's sha256 block hashes


@dataclass
class _Req:
    request: object
    local: int = 0  # tokens vLLM's own prefix cache had (block-aligned), at the last lookup
    found: int = 0  # leading blocks the cache holds, at the last lookup
    lease: str = ""
    saved: int = 0  # leading blocks stored or known stored
    saving: bool = False  # a Put was asked for: vLLM keeps its blocks until the workers' Puts end
    lookup: Future | None = field(default=None, repr=False)


class SchedulerSide:
    def __init__(self, space: Space, cfg: dict, enabled: bool, block_ids: Callable[[str], list[int]], *,
                 loads: bool = True, saves: bool = True) -> None:
        self.space = space
        self.enabled = enabled
        self.loads = loads  # kv_role kv_consumer or kv_both
        self.saves = saves  # kv_role kv_producer or kv_both
        self.block_size = space.page_size
        self.pin_ms = int(cfg.get("lookup_pin_ms", 10_000))
        mode = str(cfg.get("lookup", "sync"))
        if mode not in ("sync", "async"):
            raise ValueError(f"kv_connector_extra_config.lookup must be 'sync' or 'async', not {mode!r}")
        self._async = mode == "async"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserver-lookup") if self._async else None
        self._block_ids = block_ids
        self.view = CacheView(cfg.get("address"), model=space.model, layout=space.layout, dtype=space.dtype,
                              page_size=space.page_size, num_layers=space.num_layers, tp_size=space.tp_size,
                              pp_size=space.pp_size, timeout=float(cfg.get("timeout_s", 5.0)),
                              token=cfg.get("token"), tenant_token=cfg.get("tenant_token"))
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._finish_saves: list[SaveJob] = []

    # ---- lookup ----------------------------------------------------------------------------

    def _lookup(self, keys: list[bytes]) -> LookupResult:
        try:
            return self.view.lookup(b"".join(keys), pin_ms=self.pin_ms, key_bytes=KEY_BYTES)
        except Exception as exc:  # the daemon refused or is away: a miss, never the scheduler's end
            logger.warning("kvserver: lookup failed (%s): a miss", exc)
            return LookupResult(0)

    def _set_lease(self, st: _Req, lease: str) -> None:
        if st.lease:
            self._release(st.lease)
        st.lease = lease

    def _release(self, lease: str) -> None:
        try:
            self.view.release(lease)
        except Exception:
            pass  # it ends by itself at its pin's end

    def _release_answer(self, answer: Future) -> None:
        if not answer.cancelled() and answer.exception() is None and answer.result().lease_id:
            self._release(answer.result().lease_id)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.enabled:
            return 0, False
        if not self.loads:  # a producer only: stores, never loads
            st = self._reqs.setdefault(request.request_id, _Req(request))
            st.local = num_computed_tokens
            return 0, False
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(request)
        # As vLLM's own prefix cache: whole blocks, and at least the prompt's last token computed.
        keys = block_keys(request, self.space.hash_stride, (request.num_tokens - 1) // self.block_size)
        if not keys:
            st.local, st.found = num_computed_tokens, 0
            return 0, False
        if self._async:
            if st.lookup is None:  # answered at a later step, never this one: the step is not held
                st.lookup = self._pool.submit(self._lookup, keys)
                return None, False
            if not st.lookup.done():
                return None, False  # vLLM asks again next step
            found, st.lookup = st.lookup.result(), None
        else:
            found = self._lookup(keys)
        self._set_lease(st, found.lease_id)
        st.local, st.found = num_computed_tokens, min(found.pages, len(keys))
        st.saved = max(st.saved, st.found)
        hit = st.found * self.block_size
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            self._set_lease(st, "")  # nothing to load: the pin is not needed
            return
        first = st.local // self.block_size
        n = -(-num_external_tokens // self.block_size)
        ids = list(blocks.get_block_ids()[0])[first:first + n]
        keys = block_keys(request, self.space.hash_stride, first + n)[first:]
        # A shorter key list (cannot happen with vLLM's own numbers) loads fewer blocks, and the
        # worker reports the rest as failed: vLLM recomputes them, never reads them unloaded.
        self._loads.append(LoadJob(request.request_id, b"".join(keys[:len(ids)]), ids, st.lease))
        st.lease = ""  # the Get ends it

    # ---- per step --------------------------------------------------------------------------

    def _save_job(self, st: _Req, computed_tokens: int, block_ids: list[int] | None = None) -> SaveJob | None:
        req = st.request
        keys = block_keys(req, self.space.hash_stride, computed_tokens // self.block_size)
        if len(keys) <= st.saved:
            return None
        ids = list(block_ids if block_ids is not None else self._block_ids(req.request_id))
        if len(ids) < len(keys):
            return None
        job = SaveJob(req.request_id, b"".join(keys[st.saved:]), ids[st.saved:len(keys)])
        st.saved, st.saving = len(keys), True
        return job

    def build_connector_meta(self, scheduler_output) -> KVServerConnectorMetadata:
        meta = KVServerConnectorMetadata(key_bytes=KEY_BYTES, loads=self._loads, saves=self._finish_saves,
                                         preempted=set(scheduler_output.preempted_req_ids or ()))
        self._loads, self._finish_saves = [], []
        if not self.enabled or not self.saves:
            return meta
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            # The blocks this step's forward fills; stored after it (wait_for_save).
            job = self._save_job(st, st.request.num_computed_tokens + n)
            if job is not None:
                meta.saves.append(job)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.lookup is not None:  # a lookup still running: its pin is released when it answers
            st.lookup.add_done_callback(self._release_answer)
        self._set_lease(st, "")
        if self.enabled and self.saves:
            # Blocks whose KV is written but whose hash came after their step was scheduled
            # (decode tokens under async scheduling): stored by the next step's workers.
            computed = request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0) or 0)
            job = self._save_job(st, max(0, computed), block_ids)
            if job is not None:
                self._finish_saves.append(job)
        return st.saving, None

    def shutdown(self) -> None:
        for st in self._reqs.values():
            if st.lease:
                self._release(st.lease)
        self._reqs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.view.close()
