"""``KVServerLinker``: kvserver's node-wide cache as SGLang 0.5.23's UnifiedCacheLinker.

    python -m sglang.launch_server ... --enable-unified-cache-external-linker \\
        --unified-cache-external-linker-backend dynamic \\
        --unified-cache-external-linker-config '{"linker": "KVServerLinker",
            "linker_module_path": "kvclient.sglang.linker",
            "linker_extra_config": {"address": "unix:///run/kvserver/kvserver.sock"}}'

``linker_extra_config`` (all optional): ``address`` (default: the client's, KVSERVER_ADDRESS),
``token``, ``tenant_token``, ``model`` (the KV space's model name; default served_model_name or
model_path), ``num_layers`` (the space's layer count; default the pool's own, the whole model),
``tp_rank``/``tp_size`` (default: from the attention TP group),
``lookup_pin_ms`` (default 10000: a lookup pins its hit until the load, 0 for no pin),
``on_reset`` ("stop", the default: a cache reset turns the linker off for the rest of the process;
"keep": it goes on, for flushes that never come with new weights),
``lookup_timeout_s`` (a lookup on the scheduler's thread, default 1), ``timeout_s`` (each other
daemon call, default 5), ``load_timeout_s`` (a whole load, default 30),
``event_slots`` (CUDA: loads in flight, default 8), ``retry_register_s`` (default 5),
``disk_hits`` (default false: a lookup counts only pages in the daemon's host memory, never those
its disk tier would read back inside SGLang's load, which cannot fall back to a recompute).

What SGLang gives, what goes on the wire:
- The device pool is ``params.token_to_kv_pool_allocator.get_kvcache()``: MHATokenToKVPool
  (``k_buffer``/``v_buffer``) or MLATokenToKVPool (``kv_buffer``), one tensor per **local** layer
  of ``[size + page_size, heads, dim]``; its global layers are ``model_layer_ids`` (never
  ``end_layer``, which is inclusive when defaulted). The daemon sees global ids; only SGLang's
  ``layer_done_counter`` gets local ones.
- Pipeline parallelism is refused at construction: SGLang 0.5.23's PP stages each build their own
  batches and its linker wrapper reduces hits and load results over the attention TP group only,
  so stages could extend one request by different lengths. Its HiCache, with ``KVServerStorage``
  (``kvclient.sglang.storage``), reduces its storage hits and prefetches over the PP group too.
- TP: SGLang intersects the ranks' lookups and MIN-reduces their load results; ``load`` answers
  by its transfers alone when several ranks decide together (``KVServerLinker.load``), and
  ``offload`` always does.
- CUDA tensors are registered as they are (``CudaKVPool``: IPC handles of SGLang's own tensors).
  CPU tensors must already live in shared memory for the daemon to reach them, and a ShmKVPool
  cannot wrap memory torch allocated: ``share_cpu_pool(kvcache)`` rebuilds an SGLang CPU pool's
  buffers over a ShmKVPool (for CPU engines and the tests) and the linker registers that.
- Keys: SGLang's storage hashes (``PoolTransfer.keys``, 64-hex SHA-256 strings, chained) as their
  32 raw bytes. Device pages: ``device_indices`` are token slots; page = slot // page_size.
- No call on SGLang's scheduler thread waits longer than ``lookup_timeout_s``: after one that
  failed (the daemon away or stuck), lookups, loads and offloads miss at once while a background
  thread probes the daemon (and registers again if it must), until it answers (``AwayGate``).
- Every daemon failure (unreachable, restarted, registration lost, a copy that stops) is a miss:
  ``lookup`` returns [], ``load`` False (with one TP rank; with several it accepts, as every rank
  must, and the batch fails), a started load reports False from ``finish_layer_wise_loading``
  (SGLang then aborts those requests with 503; the seam has no way back to recomputing a load it
  already started), an offload's completion False. Configuration errors (a CPU pool not in shared
  memory, SWA/Mamba components, context or pipeline parallelism) raise at construction.
- ``reset`` (SGLang's cache flush, as after an in-place weight update) turns the cache off for the
  rest of the process: nothing is loaded or stored after it (``KVServerLinker.reset``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from kvclient.away import AwayGate
from kvclient.cuda_pool import CudaKVPool
from kvclient.sglang._common import KEY_BYTES, Registrar, _wire_dtype, sglang_weights, storage_keys
from kvclient.shm_pool import ShmKVPool
from kvclient.sync_client import KVClient
from kvserver.protocol.layout import KVLayout

logger = logging.getLogger("kvclient.sglang")

SHM_POOL_ATTR = "kvserver_shm_pool"

PP_REFUSED = (
    "KVServerLinker does not run under pipeline parallelism (--pp-size {pp_size}): SGLang 0.5.23's "
    "PP stages each build their own batches, and its linker wrapper agrees on hits and load results "
    "over the attention TP group only, never across stages, so stages could extend a request by "
    "different lengths. Under PP use SGLang's HiCache with kvserver's storage backend "
    "(--enable-hierarchical-cache --hicache-storage-backend dynamic, class KVServerStorage in "
    "kvclient.sglang.storage; SGLang reduces its hits and prefetches over the PP group too), or "
    "run without --pp-size"
)


class KVServerLoadError(RuntimeError):
    """Why a batch's load did not land (given to LayerWiseLoadCounter.fail)."""


class KVServerLayerCounter(LayerWiseLoadCounter):
    """SGLang's counter, with the GPU in the wait on CUDA pools.

    SGLang's attention calls ``wait_until(local_layer)`` on the forward stream before it reads a
    layer. On the CPU path the load thread completes a layer once the daemon has copied it. On
    CUDA it completes every layer as soon as the daemon has *recorded* the batch's per-layer
    events (before the copies run), and ``wait_until`` makes the current stream wait on the GPU
    for that layer's event: the CPU never blocks per layer, and layer i's attention starts while
    later layers are still being copied. ``finish`` also reports a get that failed after its
    events were recorded (``late_fail``), so SGLang aborts those requests.
    """

    def __init__(self, layer_ids: tuple[int, ...]) -> None:
        super().__init__(len(layer_ids))
        self.layer_ids = layer_ids
        self.gpu_waits: dict[int, list] = {}  # batch index -> its CUDA LoadHandles
        self.late_failures: set[int] = set()

    def wait_until(self, threshold: int) -> None:
        super().wait_until(threshold)
        handles = self.gpu_waits.get(self.consumer_index)
        if not handles:
            return
        futures = self.futures.get(self.consumer_index)
        if futures is None or futures[threshold].exception() is not None:
            return  # failed: finish() says so, and the forward's output is not used
        layer = self.layer_ids[threshold]
        for handle in handles:
            try:
                handle.stream_wait_layer(layer)
            except Exception as exc:  # never into the forward: finish() reports it
                logger.warning("kvserver: layer %d of load batch %d failed (%s)", layer,
                               self.consumer_index, exc)
                self.late_fail(self.consumer_index)

    def late_fail(self, index: int) -> None:
        self.late_failures.add(index)

    def finish(self, index: int) -> bool:
        landed = super().finish(index)
        self.gpu_waits.pop(index, None)
        if index in self.late_failures:
            self.late_failures.discard(index)
            return False
        return landed

    def reset(self) -> None:
        super().reset()
        self.gpu_waits.clear()
        self.late_failures.clear()


# ---- SGLang's objects, read ------------------------------------------------------------------


# The token pools whose every buffer the linker stores. Subclasses (MHATokenToKVPoolMXFP8 with its
# scales, DSATokenToKVPool with its indexer cache, ...) hold more than K/V or the latent, which a
# load would leave stale: silently wrong attention, so they are refused. Matched by name, so that
# the GPU check's stand-in pools (scripts/gpu_check_sglang.py) are held to the same rule.
STORABLE_POOLS = ("MHATokenToKVPool", "MLATokenToKVPool")


def pool_layout(kvcache) -> tuple[KVLayout, list[list[torch.Tensor]]]:
    """(layout, buffers per local layer) of an SGLang MHA or MLA token pool."""
    if type(kvcache).__name__ not in STORABLE_POOLS:
        raise ValueError(f"kvserver stores SGLang's {' and '.join(STORABLE_POOLS)} only, whose buffers "
                         f"are all K/V or the MLA latent; not {type(kvcache).__name__}")
    if hasattr(kvcache, "kv_buffer") and hasattr(kvcache, "kv_lora_rank"):
        layout = KVLayout.mla(kvcache.kv_lora_rank, kvcache.qk_rope_head_dim)
        buffers = [[buf] for buf in kvcache.kv_buffer]
    elif hasattr(kvcache, "k_buffer") and hasattr(kvcache, "v_buffer"):
        head_dim = kvcache.head_dim
        if getattr(kvcache, "v_head_dim", head_dim) != head_dim:
            raise ValueError(f"K and V head sizes differ ({head_dim}, {kvcache.v_head_dim}): "
                             "kvserver's MHA layout has one head size")
        layout = KVLayout.mha(kvcache.head_num, head_dim)
        buffers = [[k, v] for k, v in zip(kvcache.k_buffer, kvcache.v_buffer, strict=True)]
    else:
        raise ValueError(f"{type(kvcache).__name__} is neither an MHA nor an MLA token pool")
    ids = tuple(kvcache.model_layer_ids)
    if len(buffers) != len(ids):
        raise ValueError(f"{len(buffers)} layer buffers for layers {ids}")
    if ids != tuple(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"the pool's layers {ids} are not one contiguous range")
    return layout, buffers


def share_cpu_pool(kvcache) -> ShmKVPool:
    """CPU only: moves an SGLang token pool's buffers into a ShmKVPool (contents copied) so the
    daemon can reach them, and refreshes the pool's pointer tables. The linker registers it."""
    layout, buffers = pool_layout(kvcache)
    first = buffers[0][0]
    if first.device.type != "cpu":
        raise ValueError("share_cpu_pool is for CPU pools; CUDA pools are registered as they are")
    dtype = _wire_dtype(kvcache, first)
    shm = ShmKVPool(layout, dtype, len(buffers), first.shape[0])

    def store(t: torch.Tensor) -> torch.Tensor:  # the dtype SGLang stores in (uint8 for fp8)
        return t.view(first.dtype) if t.dtype != first.dtype else t

    for layer, parts in enumerate(buffers):
        for part, old in enumerate(parts):
            store(shm.buffers[layer][part]).copy_(old)
    if layout.is_mla:
        kvcache.kv_buffer = [store(shm.buffers[layer][0]) for layer in range(len(buffers))]
        if hasattr(kvcache, "data_ptrs"):
            kvcache.data_ptrs = torch.tensor([b.data_ptr() for b in kvcache.kv_buffer],
                                             dtype=torch.uint64, device=kvcache.device)
    else:
        kvcache.k_buffer = [store(shm.buffers[layer][0]) for layer in range(len(buffers))]
        kvcache.v_buffer = [store(shm.buffers[layer][1]) for layer in range(len(buffers))]
        if hasattr(kvcache, "_init_data_ptrs_and_strides"):
            kvcache._init_data_ptrs_and_strides()
    setattr(kvcache, SHM_POOL_ATTR, shm)
    return shm


def _registrable(kvcache, layout: KVLayout, buffers: list[list[torch.Tensor]]):
    first = buffers[0][0]
    if first.device.type == "cuda":
        dtype = _wire_dtype(kvcache, first)
        return CudaKVPool(layout, dtype, [[b.view(dtype) for b in parts] for parts in buffers])
    shm = getattr(kvcache, SHM_POOL_ATTR, None)
    if isinstance(shm, ShmKVPool) and all(
        buf.data_ptr() == shm.buffers[layer][part].data_ptr()
        for layer, parts in enumerate(buffers) for part, buf in enumerate(parts)
    ):
        return shm
    raise ValueError("the KV pool is on the CPU but not in shared memory: the daemon cannot reach "
                     "it; build it over a ShmKVPool (kvclient.sglang.linker.share_cpu_pool)")


def _dcp_size() -> int:
    """SGLang's decode-context-parallel size, where its runtime context says (1 elsewhere)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except Exception:  # no published context (tests, the GPU check's stand-in): no DCP
        return 1


def _group_rank(group) -> tuple[int, int] | None:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _group_size(group) -> int:
    ranks = _group_rank(group)
    return ranks[1] if ranks else 1


def _kv_transfer(transfers: list[PoolTransfer]) -> PoolTransfer | None:
    for transfer in transfers:
        if transfer.name == PoolName.KV:
            return transfer
    return None


# ---- the linker ------------------------------------------------------------------------------


class KVServerLinker(UnifiedCacheLinker):
    def __init__(self, server_args, params, *, components, extra_config, forward_stream=None):
        cfg = dict(extra_config or {})
        self.forward_stream = forward_stream
        extra = set(components) - {ComponentType.FULL}
        if extra:
            raise ValueError(f"KVServerLinker stores full-attention KV only; not {sorted(map(str, extra))}")
        if int(getattr(params, "attn_cp_size", 1) or 1) > 1 or _dcp_size() > 1:
            raise ValueError("KVServerLinker does not store context-parallel KV (attention CP or DCP "
                             "above 1): the ranks hold different tokens of one page")
        pp_size = max(int(getattr(params, "pp_size", 1) or 1), int(getattr(server_args, "pp_size", 1) or 1))
        if pp_size > 1:
            raise ValueError(PP_REFUSED.format(pp_size=pp_size))
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.kvcache = kvcache
        self.page_size = int(params.page_size)
        self.layer_ids = tuple(int(i) for i in kvcache.model_layer_ids)  # global ids
        self.layer_done_counter = KVServerLayerCounter(self.layer_ids)
        self.pools = {PoolName.KV: kvcache}
        layout, buffers = pool_layout(kvcache)
        self.cuda = buffers[0][0].device.type == "cuda"
        self.device_pool = _registrable(kvcache, layout, buffers)

        start, end = self.layer_ids[0], self.layer_ids[-1] + 1
        num_layers = int(cfg.get("num_layers") or end)
        tp = _group_rank(getattr(params, "attn_tp_cache_group", None)
                         or getattr(params, "tp_cache_group", None))
        tp_rank = int(cfg.get("tp_rank", tp[0] if tp else 0))
        tp_size = int(cfg.get("tp_size", tp[1] if tp else 1))
        server_tp = int(getattr(server_args, "tp_size", 1) or 1)
        if tp is None and "tp_size" not in cfg and server_tp > 1:
            raise ValueError("TP > 1 without a TP group in CacheInitParams: set "
                             "linker_extra_config.tp_rank and tp_size")
        # The ranks SGLang's wrapper reduces a load's verdict over (finish_loads' MIN all-reduce
        # over the attention TP group, else the TP group). With more than one, load() must answer
        # by its transfers alone, as every rank has to take the same branch (see load()).
        self.shared_verdict = tp_size > 1
        model = cfg.get("model") or getattr(server_args, "served_model_name", None) or server_args.model_path
        register_kwargs = dict(
            model=str(model), pool=self.device_pool, start_layer=start, end_layer=end,
            num_layers=int(num_layers), host_tokens=0, page_size=self.page_size, tp_rank=tp_rank,
            tp_size=tp_size, pp_rank=0, pp_size=1,
            event_slots=int(cfg.get("event_slots", 8)) if self.cuda else 0,
            weights=sglang_weights(cfg, server_args),
        )
        self.event_slots = register_kwargs["event_slots"]
        self.pin_ms = int(cfg.get("lookup_pin_ms", 10_000))
        self.load_timeout = float(cfg.get("load_timeout_s", 30.0))
        self.retry_register_s = float(cfg.get("retry_register_s", 5.0))
        self.lookup_timeout = float(cfg.get("lookup_timeout_s", 1.0))
        # A load SGLang started cannot fall back to a recompute (it is an HTTP 503): by default only
        # hits in the daemon's host memory count, never pages its disk tier would read back first.
        self.disk_hits = bool(cfg.get("disk_hits", False))
        # "stop" (default): a cache reset turns the linker off for good (see reset()); "keep": the
        # operator knows its flushes never come with new weights (benchmarks' /flush_cache).
        self.on_reset = str(cfg.get("on_reset", "stop"))
        if self.on_reset not in ("stop", "keep"):
            raise ValueError(f"linker_extra_config.on_reset is 'stop' or 'keep', not {self.on_reset!r}")
        self.client = KVClient(cfg.get("address"), timeout=float(cfg.get("timeout_s", 5.0)),
                               token=cfg.get("token"), tenant_token=cfg.get("tenant_token"))
        self._lock = threading.Lock()
        self._registrar = Registrar(self.client, self.retry_register_s, register_kwargs)
        self._leases: dict[str, tuple[str, float]] = {}  # rid -> (lease of its lookup, taken at)
        # Queued loads: rid -> (keys, device pages, lease, servable: False fails the batch).
        self._pending: dict[str, tuple[bytes, list[int], str, bool]] = {}
        self._loading: dict[int, threading.Thread] = {}
        self._next_slot = 0
        self._side_stream = None  # CUDA: where the slots-ready event is recorded
        self._offloads: queue.Queue = queue.Queue()
        self._completed: deque[bool] = deque()
        self._offloads_open = 0  # queued or running
        self._generation = 0  # bumped by reset: queued offloads of an older one are dropped
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._stopped = False  # reset: the cache is off for the rest of the process (see reset())
        # After one call that failed, no call on the scheduler's thread waits until a probe (off
        # that thread: a ping, or the Register the linker still needs) finds the daemon answering.
        self.away = AwayGate(self._probe, name="kvserver-sglang-probe")
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="kvserver-release")  # off SGLang's threads
        try:
            if not self._ensure_registered(strict=True):
                self.away.failed()  # started without the daemon: registered from the probe thread
        except BaseException:
            self.client.close()
            raise
        self._offloader = threading.Thread(target=self._offload_loop, name="kvserver-offload", daemon=True)
        self._offloader.start()

    # ---- registration ----------------------------------------------------------------------

    def _ensure_registered(self, strict: bool = False) -> bool:
        """Registered, or (at most every retry_register_s) tries again; False means miss.
        ``strict`` (construction): a refusal that is not the daemon being away raises."""
        return self._registrar.ensure(strict=strict, closed=self._closed)

    @property
    def _register_kwargs(self) -> dict:
        return self._registrar.kwargs

    def _usable(self) -> bool:
        """Registered and answering, known without a call: the scheduler's thread never waits on
        a Register or on a daemon that did not answer last time."""
        if self._closed or self._stopped or not self.away.open:
            return False
        if not self._registrar.registered or not self.client.connected:
            # Registration lost (a renew, or the client found the daemon gone): the probe thread
            # registers; a load accepted now would fail and SGLang abort its requests.
            self.away.failed()
            return False
        return True

    def _probe(self) -> bool:
        if not self._registrar.registered:
            return self._registrar.ensure(closed=self._closed)  # at most every retry_register_s
        return self.client.ping(timeout=self.lookup_timeout)

    # ---- lookup and load -------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = _kv_transfer(transfers)
        if kv is None or not kv.keys or not self._usable():
            return []
        misses = self.client.misses
        try:
            keys = storage_keys(kv.keys)
            found = self.client.lookup(keys, pin_ms=self.pin_ms, key_bytes=KEY_BYTES,
                                       timeout=self.lookup_timeout, memory_only=not self.disk_hits)
        except Exception as exc:
            logger.warning("kvserver: lookup failed (%s): a miss", exc)
            self.away.failed()
            return []
        if self.client.misses > misses:  # away or stuck: no further call on this thread waits
            self.away.failed()
            return []
        old = self._leases.pop(rid, None)
        if old and old[0]:
            self._release(old[0])
        self._forget_expired_leases()
        if found.lease_id:
            self._leases[rid] = (found.lease_id, time.monotonic())
        # One contiguous pool: every prefix up to the stored one is restorable.
        return list(range(1, min(found.pages, len(kv.keys)) + 1))

    def _forget_expired_leases(self) -> None:
        """Leases of requests that never loaded (aborted, refused a slot, missed on another rank):
        past their pin the daemon has ended them. Their time is kept a while longer (a load of one
        is refused: its pages may be gone), then forgotten."""
        now = time.monotonic()
        for rid, (lease, at) in list(self._leases.items()):
            if now - at > 10 * self.pin_ms / 1000:
                del self._leases[rid]
            elif lease and now - at > self.pin_ms / 1000:
                self._leases[rid] = ("", at)

    def _pages(self, transfer: PoolTransfer) -> list[int] | None:
        slots = transfer.device_indices
        n = len(transfer.keys)
        if slots is None or slots.numel() != n * self.page_size:
            return None
        grid = slots.to("cpu", torch.int64).view(n, self.page_size)
        first = grid[:, 0]
        expect = first[:, None] + torch.arange(self.page_size)
        if bool((first % self.page_size).any()) or not torch.equal(grid, expect):
            return None  # not whole, aligned pages
        return (first // self.page_size).tolist()

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Queues a Get for the next batch. False for transfers it cannot load (no KV transfer,
        slots that are not whole pages, keys that are not storage hashes): the same on every rank.

        SGLang's wrapper needs the answer to depend on the transfers alone when several ranks
        decide together (``shared_verdict``: TP above 1): each rank keeps its own in-flight loads
        and enters finish_loads' MIN all-reduce only with one, and a prefix that grew on some
        ranks only would be computed differently on the others. There a rank that cannot serve
        the load (the daemon away or not answering, the linker reset or closed) still accepts it
        and fails its batch: ``finish_layer_wise_loading`` answers False, and SGLang's MIN over
        the ranks aborts the request on every one (HTTP 503). A lookup's pin that ran out is no
        reason to refuse there: the Get runs, and its pages are usually still stored.

        With one rank its own answer is SGLang's: a load that may fail (the daemon away, or the
        lookup's pin run out or nearly, so its pages may go before the Get) is refused now, and
        SGLang recomputes those pages rather than abort the request."""
        kv = _kv_transfer(transfers)
        if kv is None or not kv.keys:
            return False
        pages = self._pages(kv)
        if pages is None:
            logger.warning("kvserver: load of %s: device slots are not whole pages; not loaded", rid)
            return False
        try:
            keys = storage_keys(kv.keys)
        except ValueError as exc:
            logger.warning("kvserver: load of %s: %s", rid, exc)
            return False
        lease, taken = self._leases.pop(rid, ("", 0.0))
        if not self._usable():
            if lease:
                self._release(lease)
            if not self.shared_verdict:
                return False
            logger.warning("kvserver: load of %s accepted as on every TP rank, but this rank cannot serve it "
                           "(the daemon away, or the linker reset or closed): its batch fails and SGLang "
                           "aborts the request on every rank", rid)
            self._pending[rid] = (keys, pages, "", False)
            return True
        if not self.shared_verdict and self.pin_ms and taken \
                and self._pin_left(taken) < min(1.0, self.pin_ms / 2000):
            # SGLang cannot take back a load it started (a failure is a 503): one whose pages may
            # go before its Get (the lookup's pin gone, or nearly) is refused now, and recomputed.
            if lease:
                self._release(lease)
            logger.info("kvserver: load of %s refused: its lookup's pin has run out; recomputed", rid)
            return False
        self._pending[rid] = (keys, pages, lease, True)
        return True

    def _pin_left(self, taken: float) -> float:
        """Seconds left of a pin taken at ``taken``."""
        return self.pin_ms / 1000 - (time.monotonic() - taken)

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        pending, self._pending = self._pending, {}
        index = self.layer_done_counter.update_producer()
        ready = self._slots_ready() if self.cuda else None
        gets = []
        for rid, (keys, pages, lease, servable) in pending.items():
            handle = None
            if servable:
                slot = 0
                if self.event_slots:
                    slot, self._next_slot = self._next_slot, (self._next_slot + 1) % self.event_slots
                try:
                    handle = self.client.get(keys, pages, layers=self.layer_ids, event_slot=slot,
                                             ready_event=ready, lease_id=lease, key_bytes=KEY_BYTES)
                except Exception as exc:
                    logger.warning("kvserver: get for %s failed (%s)", rid, exc)
            gets.append((rid, len(pages), handle))
        if self.cuda:
            self.layer_done_counter.gpu_waits[index] = [h for _, _, h in gets if h is not None]
        # ``ready`` travels to the daemon as an IPC handle only: it must outlive every get of the
        # batch (an event destroyed before the daemon opens and waits on it orders nothing).
        thread = threading.Thread(target=self._land, args=(index, gets, ready), name=f"kvserver-load-{index}",
                                  daemon=True)
        self._loading[index] = thread
        thread.start()
        return index

    def _slots_ready(self):
        """CUDA: an interprocess event after which the daemon may write the batch's slots: past
        the work queued so far on the current stream (which allocated them) and on the forward
        stream (which may still read their previous contents). Recorded on a side stream, so
        neither stream waits for the other."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        if self.forward_stream is not None:
            side.wait_stream(self.forward_stream)
        ready = torch.cuda.Event(interprocess=True)
        ready.record(side)
        return ready

    def _land(self, index: int, gets, ready=None) -> None:
        """Releases SGLang's counter layer by layer (local ids): on the CPU path as every get of
        the batch lands the layer; on CUDA all at once when the daemon has recorded the layer
        events (the wait per layer is then on the GPU, in KVServerLayerCounter.wait_until). The
        first get that misses fails the rest of the batch."""
        counter = self.layer_done_counter
        deadline = time.monotonic() + self.load_timeout
        completed = False
        try:
            for rid, want, handle in gets:
                if handle is None:
                    raise KVServerLoadError(f"{rid}: the get could not start")
                got = handle.pages(timeout=max(0.0, deadline - time.monotonic()))
                if got < want:
                    raise KVServerLoadError(f"{rid}: {got} of {want} pages stored")
            if self.cuda:
                for rid, _, handle in gets:
                    if not handle.wait_recorded(timeout=max(0.0, deadline - time.monotonic())):
                        raise KVServerLoadError(f"{rid}: the load's layer events were not recorded")
                for local in range(len(self.layer_ids)):
                    counter.complete(index, local)
            else:
                for local, layer in enumerate(self.layer_ids):
                    for rid, _, handle in gets:
                        if not handle.wait_layer(layer, timeout=max(0.0, deadline - time.monotonic())):
                            raise KVServerLoadError(f"{rid}: layer {layer} did not land")
                    counter.complete(index, local)
            completed = True
        except Exception as exc:
            logger.warning("kvserver: load batch %d failed (%s); SGLang aborts its requests", index, exc)
            counter.fail(index, exc if isinstance(exc, KVServerLoadError) else KVServerLoadError(str(exc)))
        finally:
            # Nothing may write the slots once finish_layer_wise_loading returns; a get that
            # fails now (its events already given to the forward) fails the batch too.
            for rid, _, handle in gets:
                if handle is None:
                    continue
                try:  # the daemon ends a get by its own deadline; this bound is for a silent one
                    handle.wait(timeout=self.load_timeout)
                    ok = not handle.missed
                except Exception as exc:
                    logger.warning("kvserver: load batch %d: %s did not finish (%s)", index, rid, exc)
                    ok = False
                if not handle.confirmed:
                    logger.error("kvserver: load batch %d: the daemon could not confirm that the copy "
                                 "for %s stopped; its device slots may still be written for a while",
                                 index, rid)
                if completed and not ok:
                    counter.late_fail(index)
            del ready  # every get has ended: the daemon no longer waits on it

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        thread = self._loading.pop(counter_index, None)
        if thread is not None:
            thread.join()
        return self.layer_done_counter.finish(counter_index)  # True for an index with no loads

    def cancel_queued_load(self, rid: str) -> bool:
        entry = self._pending.pop(rid, None)
        lease = self._leases.pop(rid, ("", 0.0))[0]
        if entry is not None:
            lease = entry[2] or lease
        if lease:
            self._release(lease)
        return entry is not None

    def _release(self, lease: str) -> None:
        """Ends a lease from a thread of its own: never a wait on SGLang's scheduler thread."""
        try:
            self._releaser.submit(self._release_now, lease)
        except RuntimeError:  # closed: the lease ends by itself at its pin's end
            pass

    def _release_now(self, lease: str) -> None:
        try:
            self.client.release(lease)
        except Exception:
            pass  # it ends by itself at its pin's end

    # ---- offload ---------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:  # noqa: UP045 (SGLang's own annotation: the contract test compares signatures)
        """Queues a Put. The answer depends on the transfers alone, as SGLang's wrapper needs (each
        TP rank keeps its own queue of pending offloads, paired by position across ranks): a
        linker that is not registered (or closed) still queues it, and it completes False."""
        kv = _kv_transfer(transfers)
        if kv is None or not kv.keys:
            return False
        pages = self._pages(kv)
        if pages is None:
            return False
        try:
            keys = storage_keys(kv.keys)
        except ValueError:
            return False
        usable = self._usable()
        events = self.record_offload_ready() if usable else []  # before the pages are read
        with self._lock:
            self._offloads_open += 1
            self._offloads.put((keys, pages, events, usable, self._generation))
        return True

    def _offload_loop(self) -> None:
        while True:
            task = self._offloads.get()
            if task is None:
                return
            keys, pages, events, usable, generation = task
            ok = False
            with self._lock:
                stale = generation != self._generation  # queued before a reset: its slots are gone
            if usable and not stale:
                try:
                    for event in events:
                        event.synchronize()
                    result = self.client.put(keys, pages, key_bytes=KEY_BYTES)
                    ok = result.dropped == 0 and result.stored + result.present == len(pages)
                except Exception as exc:
                    logger.warning("kvserver: put failed (%s)", exc)
            with self._lock:
                if generation == self._generation:
                    self._completed.append(ok)
                self._offloads_open -= 1
                self._idle.notify_all()

    def num_completed_offloads(self) -> int:
        with self._lock:
            return len(self._completed)

    def pop_completed_offload(self) -> bool:
        with self._lock:
            return self._completed.popleft() if self._completed else False

    # ---- lifecycle -------------------------------------------------------------------------

    def _quiesce(self) -> None:
        for rid in list(self._pending):
            self.cancel_queued_load(rid)
        for index in list(self._loading):
            self._loading.pop(index).join()
        with self._lock:
            # Offloads not started are dropped (SGLang releases their nodes once this returns,
            # and their slots may be reused); the one running is waited for: its Put is bounded
            # by the client's deadline. Nothing completes for the old generation afterwards.
            self._generation += 1
            self._idle.wait_for(lambda: self._offloads_open == 0)
            self._completed.clear()
        for lease, _ in self._leases.values():
            if lease:
                self._release(lease)
        self._leases.clear()
        self.layer_done_counter.reset()

    def reset(self) -> None:
        """Quiesces every transfer, then turns the cache off for the rest of the process: lookups
        miss (so nothing loads) and offloads complete False, logged once at WARNING.

        SGLang resets the cache when it flushes it (``Scheduler.flush_cache``), which it does on
        every TP rank at the same point of its loop, and after an in-place weight update
        (``update_weights_from_*`` with ``flush_cache``, the default): the daemon's pages were
        computed by the old weights, under a KV space whose identity (``weights``) does not
        change, and KV the new weights compute stored there would be taken as theirs by engines
        still on the old weights. Nothing tells a reset for a weight update from another one, so
        every reset ends the linker's use of the cache; a restart with a new ``weights`` (or
        with the new checkpoint's path) uses it again. ``on_reset`` "keep" (an operator whose
        flushes never come with new weights: benchmarks' ``/flush_cache``) only quiesces."""
        self._quiesce()
        if self.on_reset == "keep":
            logger.info("kvserver: SGLang reset its cache; the linker goes on (on_reset \"keep\")")
            return
        if not self._stopped:
            self._stopped = True
            logger.warning("kvserver: SGLang reset its cache (a flush, as after an in-place weight update): "
                           "the linker no longer loads or stores for the rest of this process, since the "
                           "node cache's pages were computed under this engine's weights identity before "
                           "the reset; restart the engine (with a new \"weights\" if its weights changed) "
                           "to use the cache again, or set linker_extra_config.on_reset \"keep\" where "
                           "flushes never come with new weights (benchmarks' /flush_cache)")

    def close(self) -> None:
        if self._closed:
            return
        self._quiesce()
        self._closed = True
        self.away.close()
        self._releaser.shutdown(wait=True)  # the leases _quiesce let go of, before the channel closes
        self._offloads.put(None)
        self._offloader.join(timeout=self.load_timeout)
        try:
            self.client.close()
        except Exception:
            pass
