"""The worker-side connector: registers vLLM's per-layer KV cache views with the daemon as they
lie (``KVViewsPool``: every one of vLLM 0.33's six layouts, no copy), starts the step's loads
before the forward (one Get per KV cache group a step, each loading request a part of it:
``KVClient.get_parts``), waits for each layer as attention reaches it, stores the blocks a
step filled after its forward (one Put per request, ordered after the forward's KV writes by an
event on CUDA), and reports failed loads so that vLLM recomputes those blocks.

On CUDA a layer's wait is on the GPU (the compute stream waits for the daemon's per-layer
interprocess event); the CPU does not block per layer. On CPU pools (shared memory) the worker
blocks until the daemon reports the layer copied.

Asynchronous loads (hybrid models, or ``load`` "async") are started the same way but not waited
for: ``get_finished`` reports each request once all its Gets ended (``failed_recving`` if any did
not land), and vLLM schedules it then. Each KV cache group is registered as its own pool (its own
space and client); a hybrid model's Put or Get is one call per group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvclient.away import AwayGate
from kvclient.registrar import Registrar
from kvclient.sync_client import KVClient
from kvclient.vllm._meta import KVServerConnectorMetadata, KVServerWorkerMeta, LoadJob, SaveJob
from kvclient.vllm._space import Group, Space, layer_index

logger = logging.getLogger("kvclient.vllm")

# What the daemon takes in one Get (GetRequest.parts): a step's loads past it take more Gets.
MAX_GET_PARTS = 1024
MAX_GET_KEYS = 1 << 17


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


def _ranks(space: Space, cfg: dict) -> tuple[int, int]:
    """(tp_rank, pp_rank): from vLLM's process groups where they exist, else the config."""
    tp_rank = cfg.get("tp_rank")
    pp_rank = cfg.get("pp_rank")
    try:
        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():
            tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
            pp_rank = ps.get_pp_group().rank_in_group if pp_rank is None else pp_rank
    except Exception:  # no process groups (tests, a single CPU worker)
        pass
    if tp_rank is None and space.tp_size > 1 or pp_rank is None and space.pp_size > 1:
        raise ValueError("TP or PP above 1 without vLLM's process groups: set kv_connector_extra_config "
                         "tp_rank and pp_rank")
    return int(tp_rank or 0), int(pp_rank or 0)


@dataclass
class _Link:
    """One KV cache group's registration with the daemon."""

    group: Group
    client: KVClient
    registrar: Registrar | None = None
    pool: object | None = None
    layer_ids: tuple[int, ...] = ()


@dataclass
class _Batch:
    """One Get of a group: every load of one kind (synchronous or not) a step starts in it, one
    part each (``KVClient.get_parts``): one daemon call per group a step, not one per request."""

    group: int
    handle: object | None = None
    deadline: float = 0.0  # asynchronous: missed past it, reported failed past it twice
    slot: int | None = None  # asynchronous on CUDA: the event slot it holds until it ended
    ready: object = None  # asynchronous on CUDA: the event its Get waits on, kept alive with it
    failed: bool = False  # a layer did not land, or the Get was not started
    got: list[int] | None = None  # each part's loaded prefix, once known
    parts: int = 0
    single: bool = False  # one part: a plain Get (it may take the fast lane)


@dataclass
class _Load:
    job: LoadJob
    batch: _Batch
    part: int  # its part in the batch's Get
    asked: int  # blocks the Get was asked for (keys sent)

    def landed(self) -> bool:
        got = self.batch.got or []
        return self.part < len(got) and min(got[self.part], self.asked) >= len(self.job.block_ids)


def _chunks(jobs: list[LoadJob]):
    """``jobs`` in runs the daemon takes in one Get (MAX_GET_PARTS, MAX_GET_KEYS)."""
    chunk: list[LoadJob] = []
    keys = 0
    for job in jobs:
        n = len(job.keys) // job.key_bytes
        if chunk and (len(chunk) == MAX_GET_PARTS or keys + n > MAX_GET_KEYS):
            yield chunk
            chunk, keys = [], 0
        chunk.append(job)
        keys += n
    if chunk:
        yield chunk


class WorkerSide:
    def __init__(self, groups: Space | tuple[Group, ...], cfg: dict, enabled: bool) -> None:
        if isinstance(groups, Space):  # one group holding every layer the worker registers
            groups = (Group(index=0, space=groups, layer_names=()),)
        self.groups = groups
        self.space = groups[0].space
        self.cfg = cfg
        self.enabled = enabled
        # Default off: layer-by-layer waits cost every decode step vLLM's full CUDA graphs.
        self.layerwise = bool(cfg.get("layerwise", False))
        self.load_timeout = float(cfg.get("load_timeout_s", 30.0))
        self.timeout = float(cfg.get("timeout_s", 5.0))
        self.links = [_Link(g, KVClient(cfg.get("address"), timeout=self.timeout, token=cfg.get("token"),
                                        tenant_token=cfg.get("tenant_token"))) for g in groups]
        self.client = self.links[0].client
        # Puts wait in one queue, at most this many, each at most put_queue_s before it starts:
        # past either it is dropped (not stored) and its blocks go back to vLLM at once.
        self.max_queued_puts = int(cfg.get("max_queued_puts", 64))
        queue_s = cfg.get("put_queue_s")
        self.put_queue_s = self.timeout if queue_s is None else float(queue_s)
        self.dropped_puts = 0
        # After a call that failed (the daemon away or stuck), loads and Puts miss at once, and
        # Register is tried again, from a probe thread, never from the forward's thread.
        self.away = AwayGate(self._probe, name="kvserver-vllm-probe")
        self.layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, layer id in its space)
        self.cuda = False
        self.event_slots = 0
        self._loads: list[_Load] = []
        self._async: dict[str, list[_Load]] = {}  # asynchronous loads in flight, by request
        self._slots: list[set[int]] = []  # CUDA: each group's event slots free for them
        self._inflight: dict[int, SaveJob] = {}  # Puts queued or running, by sequence number
        self._dropped_seqs: set[int] = set()  # queued Puts dropped before they start
        self._seq = 0
        self._warned_parts = False
        self._deadline = 0.0
        self._ready = None  # CUDA: the step's slots-ready event, alive until its Gets end
        self._failed: set[int] = set()
        self._report: dict[str, bool] = {}  # this step's loads: landed or not
        self._cancelled: set[str] = set()  # preempted requests whose queued Puts are dropped
        self._bound: KVServerConnectorMetadata | None = None  # the step's, once its Puts count
        self._lock = threading.Condition()
        self._pending: dict[str, int] = {}  # req_id -> Puts queued or running
        self._saving: set[str] = set()  # requests with a Put asked for, until reported finished
        self._finishing: set[str] = set()
        self._puts: queue.Queue = queue.Queue()
        self._putter = threading.Thread(target=self._put_loop, name="kvserver-put", daemon=True)
        self._putter.start()

    # ---- registration ----------------------------------------------------------------------

    @property
    def registrar(self) -> Registrar | None:
        return self.links[0].registrar

    @property
    def pool(self):
        return self.links[0].pool

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.links[0].layer_ids

    def _group_layers(self, kv_caches: dict[str, torch.Tensor]) -> list[list[tuple[int, str]]]:
        """Per group: (layer id in its space, layer name), in model order."""
        if len(self.links) == 1:
            by_layer = sorted((_layer_index(name), name) for name in kv_caches)
            ids = tuple(i for i, _ in by_layer)
            if len(set(ids)) != len(ids) or ids != tuple(range(ids[0], ids[0] + len(ids))):
                raise ValueError(f"KVServerConnector needs one KV cache per layer of one contiguous range; "
                                 f"got {ids}")
            return [by_layer]
        out = []
        grouped = set()
        for link in self.links:
            names = link.group.layer_names
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise ValueError(f"KV cache group {link.group.index} names layers this worker has no KV "
                                 f"cache for: {missing[:4]}")
            out.append(list(enumerate(names)))
            grouped.update(names)
        stray = sorted(set(kv_caches) - grouped, key=layer_index)
        if stray:
            raise ValueError(f"KV caches of no KV cache group (shared KV layers are not stored): {stray[:4]}")
        return out

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvclient.views_pool import KVViewsPool

        tp_rank, pp_rank = _ranks(self.space, self.cfg)
        for gi, (link, layers) in enumerate(zip(self.links, self._group_layers(kv_caches), strict=True)):
            space = link.group.space
            hs = space.layout.head_dim
            buffers = []
            for layer_id, name in layers:
                t = kv_caches[name]
                if t.dim() != 4:
                    raise ValueError(f"{name}: a {t.dim()}D KV cache; vLLM 0.33 gives "
                                     "[blocks, heads, block, content]")
                view = t.view(space.dtype) if t.dtype != space.dtype else t
                buffers.append([view] if space.layout.is_mla else [view[..., :hs], view[..., hs:]])
                self.layer_of[name] = (gi, layer_id)
            ids = tuple(i for i, _ in layers)
            link.layer_ids = ids
            link.pool = KVViewsPool(space.layout, space.dtype, buffers)
            self.cuda = buffers[0][0].device.type == "cuda"
            self.event_slots = int(self.cfg.get("event_slots", 16)) if self.cuda else 0
            kwargs = dict(model=space.model, pool=link.pool, start_layer=ids[0], end_layer=ids[-1] + 1,
                          num_layers=space.num_layers, host_tokens=0, page_size=space.page_size,
                          tp_rank=tp_rank, tp_size=space.tp_size, pp_rank=pp_rank, pp_size=space.pp_size,
                          event_slots=self.event_slots, weights=space.weights)
            link.registrar = Registrar(link.client, float(self.cfg.get("retry_register_s", 5.0)), kwargs)
        self._slots = [set(range(self.event_slots)) for _ in self.links]
        if self.enabled and not all(link.registrar.ensure(strict=True) for link in self.links):
            self.away.failed()  # the daemon is away at startup: the probe thread registers

    def _registered(self) -> bool:
        """Registered and answering, known without a call on this thread."""
        if not self.enabled or self.registrar is None or not self.away.open:
            return False
        if not all(link.registrar.registered for link in self.links):
            self.away.failed()  # registered again by the probe thread
            return False
        return True

    def _probe(self) -> bool:
        if self.registrar is None:
            return True
        for link in self.links:
            # ensure: at most every retry_register_s
            if not link.registrar.registered and not link.registrar.ensure():
                return False
        return self.client.ping()

    # ---- loads -----------------------------------------------------------------------------

    def _ready_event(self):
        """CUDA: an interprocess event past the work queued so far on the current stream (what
        last used the blocks, and the step's own KV writes for a Put)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream())
        return event

    def start_load_kv(self, meta: KVServerConnectorMetadata | None) -> None:
        self._loads = []
        if meta is None or not meta.loads:
            return
        usable = self._registered()
        ready = self._ready_event() if usable else None
        self._deadline = time.monotonic() + self.load_timeout
        batches: dict[tuple[int, bool], list[LoadJob]] = {}
        for job in meta.loads:
            batches.setdefault((job.group, job.asynchronous), []).append(job)
        sync_slots = [0] * len(self.links)  # synchronous Gets of the step: slots 0.. of their group
        for (group, asynchronous), all_jobs in batches.items():
            for jobs in _chunks(all_jobs):
                slot = None
                if not asynchronous:
                    slot = sync_slots[group] if self.cuda else 0
                    sync_slots[group] += 1
                batch = self._start(group, jobs, asynchronous, usable, ready, slot)
                for i, job in enumerate(jobs):
                    load = _Load(job, batch, i, len(job.keys) // job.key_bytes)
                    if asynchronous:
                        self._async.setdefault(job.req_id, []).append(load)
                    else:
                        self._loads.append(load)
        if self._loads:
            self._ready = ready  # kept until the step's Gets end: the daemon waits on it
        if self._loads and not self.layerwise:  # the forward starts once every layer is in (CUDA: on the GPU)
            for gi, link in enumerate(self.links):
                for layer in link.layer_ids:
                    self._wait_layer(gi, layer)

    def _start(self, group: int, jobs: list[LoadJob], asynchronous: bool, usable: bool, ready,
               slot: int | None) -> _Batch:
        """One Get of ``jobs``' parts in group ``group``'s space (a synchronous one in event slot
        ``slot``; an asynchronous one takes a free slot, held until it ended)."""
        link = self.links[group]
        batch = _Batch(group, deadline=self._deadline, parts=len(jobs), single=len(jobs) == 1)
        rids = sorted({job.req_id for job in jobs})
        if asynchronous:
            slot = 0  # CPU pools record no events
        if usable and self.cuda and asynchronous:  # held across steps: one of the free ones
            slot = min(self._slots[group], default=None)
            if slot is None:
                logger.warning("kvserver: more asynchronous loads in flight than event_slots %d: %s are "
                               "recomputed", self.event_slots, rids)
            else:
                self._slots[group].discard(slot)
        elif usable and self.cuda and slot is not None and slot >= self.event_slots:
            logger.warning("kvserver: more Gets in one step than event_slots %d: %s are recomputed",
                           self.event_slots, rids)
            slot = None
        if usable and slot is not None and any(len(job.keys) for job in jobs):
            try:
                kw = dict(layers=link.layer_ids, event_slot=slot, ready_event=ready,
                          key_bytes=jobs[0].key_bytes)
                parts = [(job.keys, job.block_ids[:len(job.keys) // job.key_bytes], job.lease)
                         for job in jobs]
                if batch.single:
                    keys, blocks, lease = parts[0]
                    batch.handle = link.client.get(keys, blocks, lease_id=lease, **kw)
                else:
                    batch.handle = link.client.get_parts(parts, **kw)
            except Exception as exc:
                logger.warning("kvserver: get for %s failed (%s): their blocks are recomputed", rids, exc)
        if batch.handle is None:
            batch.failed = True
            if usable:
                for job in jobs:
                    if job.lease:
                        self._release(job.lease, link)  # no Get to end it
            if asynchronous and self.cuda and slot is not None and usable:
                self._slots[group].add(slot)
        elif asynchronous:
            batch.slot = slot if self.cuda else None
            batch.ready = ready
        return batch

    def _got(self, batch: _Batch, timeout: float) -> list[int]:
        """Each part's loaded prefix (blocks until the Get's first answer, within ``timeout``)."""
        if batch.single:
            return [batch.handle.pages(timeout=timeout)]
        got = batch.handle.part_pages(timeout=timeout)
        if len(got) != batch.parts:
            if not self._warned_parts:
                self._warned_parts = True
                logger.error("kvserver: the daemon answered a Get of %d parts with %d part sizes (a daemon "
                             "older than this client?): multi-request loads miss", batch.parts, len(got))
            return []
        return got

    def _release(self, lease: str, link: _Link | None = None) -> None:
        try:
            (link or self.links[0]).client.release(lease)
        except Exception:
            pass  # it ends by itself at its pin's end

    def _step_batches(self, group: int | None = None) -> list[_Batch]:
        seen: dict[int, _Batch] = {}
        for load in self._loads:
            if group is None or load.batch.group == group:
                seen.setdefault(id(load.batch), load.batch)
        return list(seen.values())

    def _wait_layer(self, group: int, layer: int) -> None:
        for batch in self._step_batches(group):
            if batch.failed:
                continue
            try:
                if self.cuda:
                    ok = batch.handle.stream_wait_layer(layer)
                else:
                    ok = batch.handle.wait_layer(layer, timeout=max(0.0, self._deadline - time.monotonic()))
            except Exception as exc:
                logger.warning("kvserver: layer %d of a load did not land (%s)", layer, exc)
                ok = False
            if not ok:
                batch.failed = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.layerwise or not self._loads:
            return
        where = self.layer_of.get(layer_name)
        if where is not None:
            self._wait_layer(*where)

    # ---- asynchronous loads ----------------------------------------------------------------

    def _ended(self, batch: _Batch, now: float) -> bool:
        """An asynchronous batch: True once its Get ended (``batch.got`` known), else False."""
        if batch.got is not None:
            return True
        got: list[int] = []
        handle = batch.handle
        if handle is not None:
            try:
                if not handle.ended():
                    raise TimeoutError
                handle.wait(timeout=0)
                got = [] if handle.missed else self._got(batch, 0)
                if handle.missed:
                    self.away.failed()
            except TimeoutError:
                # Past load_timeout_s it misses (the step's synchronous loads too), and is waited
                # out as long again (bounded by the daemon's own deadline for it), as a failed
                # synchronous load is: vLLM frees or recomputes its blocks once it is reported.
                if now >= batch.deadline:
                    self.away.failed()
                if now < batch.deadline + self.load_timeout:
                    return False
                logger.error("kvserver: a load did not end within twice load_timeout_s %.0f s: reported "
                             "failed (recomputed); its blocks may still be written for a while",
                             self.load_timeout)
            except Exception as exc:
                logger.warning("kvserver: a load failed (%s): its blocks are recomputed", exc)
            if not handle.confirmed:
                logger.error("kvserver: the daemon could not confirm that a load stopped; its blocks may "
                             "still be written for a while")
            if any(got) and self.cuda:  # the requests' next forward, on this stream, reads them after
                for layer in self.links[batch.group].layer_ids:
                    if not handle.stream_wait_layer(layer):
                        got = []
        if batch.slot is not None:
            self._slots[batch.group].add(batch.slot)
            batch.slot = None
        batch.got, batch.ready = got, None
        return True

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads all ended since the last call, and those of them
        whose blocks did not all land (vLLM recomputes them). Each is reported once."""
        done: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for rid, loads in list(self._async.items()):
            if not all([self._ended(load.batch, now) for load in loads]):
                continue
            del self._async[rid]
            done.add(rid)
            if not all(load.landed() for load in loads):
                failed.add(rid)
        if failed:
            logger.info("kvserver: the loads of %d requests did not land; vLLM recomputes them", len(failed))
        return done, failed

    def load_errors(self) -> set[int]:
        """Blocks of this step's loads that did not land (all of a failed Get's, or those past the
        prefix a Get found); called after the forward, when vLLM asks. Every Get of the step has
        ended when this returns (or the daemon could not say it stopped, which is logged): vLLM
        may give the blocks of a failed one to a recompute at once. The step's report
        (``worker_meta``) says which requests' loads landed."""
        deadline = time.monotonic() + self.load_timeout  # one bound for the whole step
        for batch in self._step_batches():
            got: list[int] = []
            if batch.handle is not None:
                try:
                    if not batch.failed:
                        got = self._got(batch, max(0.0, self._deadline - time.monotonic()))
                    # A Get whose layer wait failed (a timeout, say) may still be writing: it is
                    # waited out too, bounded by the daemon's own deadline for it.
                    batch.handle.wait(timeout=max(0.0, deadline - time.monotonic()))
                    if batch.handle.missed:
                        got = []
                        self.away.failed()  # the next steps' loads and Puts miss without waiting
                except Exception as exc:
                    logger.warning("kvserver: a load failed (%s): its blocks are recomputed", exc)
                    got = []
                if not batch.handle.confirmed:
                    logger.error("kvserver: the daemon could not confirm that a load stopped; its blocks "
                                 "may still be written for a while")
            batch.got = [] if batch.failed else got
        for load in self._loads:
            got = min(load.batch.got[load.part], load.asked) if load.part < len(load.batch.got) else 0
            landed = got >= len(load.job.block_ids)
            self._report[load.job.req_id] = self._report.get(load.job.req_id, True) and landed
            if not landed:
                self._failed.update(load.job.block_ids[got:])
        self._loads = []
        self._ready = None
        failed, self._failed = self._failed, set()
        if failed:
            logger.info("kvserver: %d blocks did not load; vLLM recomputes them", len(failed))
        return failed

    def worker_meta(self) -> KVServerWorkerMeta | None:
        """The step's report to the scheduler: which loads landed (None: no load this step)."""
        report, self._report = self._report, {}
        return KVServerWorkerMeta(loads=report) if report else None

    # ---- saves -----------------------------------------------------------------------------

    def bind(self, meta: KVServerConnectorMetadata | None) -> None:
        """The step's metadata arrived: its Puts count as pending from now on, so a request
        finished in this step is not reported done before they run (vLLM calls wait_for_save
        after get_finished under speculative decoding)."""
        self._bound = meta
        if meta is not None and meta.finished:
            with self._lock:  # finished already: reported once their Puts below (if any) end
                self._saving |= meta.finished
                self._finishing |= meta.finished
        if meta is None or not meta.saves:
            return
        with self._lock:
            for job in meta.saves:
                self._saving.add(job.req_id)
                self._pending[job.req_id] = self._pending.get(job.req_id, 0) + 1
                self._cancelled.discard(job.req_id)

    def wait_for_save(self, meta: KVServerConnectorMetadata | None) -> None:
        if meta is not self._bound:  # called without vLLM's bind (the GPU check, benchmarks)
            self.bind(meta)
        self._bound = None
        if meta is None or not meta.saves:
            return
        usable = self._registered()
        ready = self._ready_event() if usable else None
        now = time.monotonic()
        for job in meta.saves:
            if not usable:
                self._drop_put(job, "the daemon is away or not answering")
            elif self._puts.qsize() >= self.max_queued_puts:
                self._drop_put(job, f"{self.max_queued_puts} Puts already queued")
            else:
                with self._lock:
                    self._seq += 1
                    self._inflight[self._seq] = job
                self._puts.put((self._seq, job, ready, now))

    def _drop_put(self, job: SaveJob, why: str, seq: int = 0) -> None:
        """The Put is not stored: its blocks are vLLM's again at once."""
        self.dropped_puts += 1
        if self.dropped_puts == 1 or self.dropped_puts % 100 == 0:
            logger.warning("kvserver: Put of %s dropped (%s); %d dropped so far", job.req_id, why,
                           self.dropped_puts)
        with self._lock:
            self._pending[job.req_id] -= 1
            self._inflight.pop(seq, None)
            self._lock.notify_all()

    def _put_loop(self) -> None:
        while True:
            task = self._puts.get()
            if task is None:
                return
            seq, job, ready, queued_at = task
            with self._lock:
                # Preempted, or reading a block given out again: its blocks are reused.
                cancelled = job.req_id in self._cancelled or seq in self._dropped_seqs
                self._dropped_seqs.discard(seq)
            waited = time.monotonic() - queued_at
            if not cancelled and not self.away.open:
                self._drop_put(job, "the daemon did not answer the Put before it", seq)
                continue
            if not cancelled and waited > self.put_queue_s:
                self._drop_put(job, f"it waited {waited:.1f} s for the Puts before it", seq)
                continue
            if not cancelled:
                self._put(job, ready)
            with self._lock:
                self._pending[job.req_id] -= 1
                self._inflight.pop(seq, None)
                self._lock.notify_all()

    def _put(self, job: SaveJob, ready) -> None:
        client = self.links[job.group].client
        misses = client.misses
        try:
            result = client.put(job.keys, job.block_ids, ready_event=ready, key_bytes=job.key_bytes)
            if result.dropped:
                logger.info("kvserver: %d blocks of %s not stored (cache full)", result.dropped, job.req_id)
        except Exception as exc:
            logger.warning("kvserver: put for %s failed (%s)", job.req_id, exc)
        if client.misses > misses:  # away or stuck: the Puts queued behind it miss at once
            self.away.failed()

    def handle_preemptions(self, meta: KVServerConnectorMetadata | None) -> None:
        """A preempted request's blocks are freed and may be reused by this very step: its Puts
        must have read them first. Likewise (hybrid models) the Puts that read a block this step
        gives out again: a sliding window's blocks are freed while their request runs. Puts still
        queued past the bound are dropped."""
        if meta is None:
            return
        if meta.reused:
            self._flush_reused(meta.reused)
        if not meta.preempted:
            return
        with self._lock:
            done = self._lock.wait_for(lambda: all(self._pending.get(r, 0) == 0 for r in meta.preempted),
                                       timeout=self.load_timeout)
            # Its blocks went back to vLLM: a finish no longer waits for these Puts.
            self._saving -= meta.preempted
            self._finishing -= meta.preempted
            for r in meta.preempted:
                if not self._pending.get(r, 0):
                    self._pending.pop(r, None)
            if not done:
                late = {r for r in meta.preempted if self._pending.get(r, 0)}
                self._cancelled |= late
                logger.error("kvserver: Puts of preempted %s did not end within %.0f s; those not started "
                             "are dropped, and one running may read reused blocks", sorted(late),
                             self.load_timeout)

    def _flush_reused(self, reused: set[int]) -> None:
        def reading() -> list[SaveJob]:
            return [job for job in self._inflight.values() if not reused.isdisjoint(job.block_ids)]

        with self._lock:
            if self._lock.wait_for(lambda: not reading(), timeout=self.load_timeout):
                return
            late = {job.req_id for job in reading()}
            self._dropped_seqs |= {seq for seq, job in self._inflight.items()
                                   if not reused.isdisjoint(job.block_ids)}
        logger.error("kvserver: Puts of %s reading blocks given out again did not end within %.0f s; those "
                     "not started are dropped, and one running may read reused blocks", sorted(late),
                     self.load_timeout)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(Puts of finished requests all ended, asynchronous loads ended, those that failed)."""
        sending, _ = self.get_finished(finished_req_ids)
        recving, failed = self.finished_loads()
        return set(sending or ()), recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._saving)
            done = {r for r in self._finishing if self._pending.get(r, 0) == 0}
            self._finishing -= done
            self._saving -= done
            for r in done:
                self._pending.pop(r, None)
                self._cancelled.discard(r)
        return (done or None), None

    def shutdown(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: not any(self._pending.values()), timeout=self.load_timeout)
        self._puts.put(None)
        self._putter.join(timeout=self.load_timeout)
        batches = {id(load.batch): load.batch for loads in self._async.values() for load in loads}
        for batch in batches.values():  # loads still writing end before the pools go
            if batch.handle is not None:
                try:
                    batch.handle.wait(timeout=self.load_timeout)
                except Exception:
                    pass
        self._async.clear()
        self.away.close()
        for link in self.links:
            self._close_link(link)

    def _close_link(self, link: _Link) -> None:
        try:
            if link.registrar is not None and link.registrar.registered:
                # Confirmed: the daemon has let go of the pool (on CUDA its IPC exports go back
                # to torch's allocator).
                link.client.unregister()
        except Exception as exc:
            logger.warning("kvserver: unregister failed (%s)", exc)
        try:
            link.client.close()
        except Exception:
            pass
