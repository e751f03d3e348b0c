"""``KVServerStorage``: kvserver's node-wide cache as SGLang 0.5.23's HiCache L3 storage backend.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvserver", "module_path": "kvclient.sglang.storage",
          "class_name": "KVServerStorage", "interface_v1": 1,
          "address": "unix:///run/kvserver/kvserver.sock"}'

SGLang parses that JSON into ``HiCacheStorageConfig.extra_config`` and the factory calls
``KVServerStorage(storage_config, {})``; the cache controller then calls
``register_mem_pool_host(host_pool)`` and ``on_host_pools_registered()``. Optional keys of the
JSON: ``address`` (default: the client's, KVSERVER_ADDRESS), ``token``, ``tenant_token``,
``model`` (the KV space's model name; default ``storage_config.model_name``), ``num_layers``
(the model's layer count; needed on every PP stage but the last, which knows it from its own
end), ``dtype`` (an fp8 host pool's logical dtype, ``fp8_e4m3``/``fp8_e5m2``; default SGLang's
``--kv-cache-dtype``), ``timeout_s`` (each daemon call, default 5), ``staging_pages`` (default
128, SGLang's STORAGE_BATCH_SIZE; longer calls go in chunks), ``retry_register_s`` (default 5).

The data path. The HiCache host pool lives in the engine's own memory (torch or mmap, or an
unsealed memfd), which the daemon will not map: a peer that could truncate its memfd could crash
it. So the backend owns a staging pool, a sealed ShmKVPool of ``staging_pages`` pages of the host
pool's geometry, registered as the engine's device pool (no host grant) over the host pool's
global layers. A store gathers the host pages into staging and Puts them; a load Gets into
staging and scatters the pages that landed into the host pool. One lock serialises the staging
pool between SGLang's prefetch and backup threads.

What goes on the wire: the storage hashes (64 hex digits) as their 32 raw bytes; the host pool's
layers ``[start_layer, start_layer + target_layer_num)`` as global ids (its ``end_layer`` is
inclusive when defaulted and exclusive under PP, so it is not used); TP/PP ranks from the
storage config. An MLA page is stored once for all TP ranks: only the writer rank
(``is_storage_writer``) stores, the others answer True without writing, and every rank reads.

Every daemon failure is a miss: ``batch_exists`` 0, ``batch_get_v1`` all False, ``batch_set_v1``
all False, never an exception into SGLang. A configuration error (a host layout or pool kind
kvserver cannot store, an unknown layer count) raises at registration.
"""

# SGLang's annotations are compared with these as strings (inspect.signature), so they keep its
# spelling (List, Optional) rather than the builtin generics ruff would ask for.
# ruff: noqa: UP006, UP035, UP045

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvclient.sglang._common import KEY_BYTES, Registrar, daemon_away, fp8_wire_dtype, sglang_weights
from kvclient.shm_pool import ShmKVPool
from kvclient.sync_client import KVClient
from kvserver.protocol.layout import KVLayout

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

logger = logging.getLogger("kvclient.sglang")

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DEFAULT_STAGING_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: one controller batch per chunk
_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
    "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
}


# ---- the host pool, read -----------------------------------------------------------------------


@dataclass(frozen=True)
class HostGeometry:
    """What the backend reads off an SGLang host pool: the KV layout, the host layout, the page
    grid and the layers. Every host layout is seen through ``pages_view`` as one shape,
    ``[layers, parts, pages, page_size, heads, dim]`` (parts: K and V, or the MLA latent)."""

    kv_layout: KVLayout
    host_layout: str
    page_size: int
    num_pages: int
    start_layer: int  # global id of the host pool's layer 0
    num_layers: int  # this stage's layers
    store_dtype: torch.dtype

    @property
    def parts(self) -> int:
        return self.kv_layout.num_parts

    @property
    def page_numel(self) -> int:
        heads, dim = self.kv_layout.token_shape
        return self.num_layers * self.parts * self.page_size * heads * dim

    def pages_view(self, buf: torch.Tensor, pages: int) -> torch.Tensor:
        """``buf`` (a contiguous tensor of ``pages`` pages in the host layout: the host pool's
        ``kv_buffer``, or one page as SGLang's ``get_data_page`` flattens it) as
        ``[layers, parts, pages, page_size, heads, dim]``, without a copy. MLA's buffers have
        no parts dimension; it is 1 here, as is their head count."""
        p, n, ps, layers = self.parts, pages, self.page_size, self.num_layers
        heads, dim = self.kv_layout.token_shape
        if self.host_layout == "layer_first":  # [parts, layers, tokens, heads, dim]
            return buf.view(p, layers, n, ps, heads, dim).permute(1, 0, 2, 3, 4, 5)
        if self.host_layout == "page_first":  # [parts, tokens, layers, heads, dim]
            return buf.view(p, n, ps, layers, heads, dim).permute(3, 0, 1, 2, 4, 5)
        # page_first_direct: [parts, pages, layers, page_size, heads, dim]
        return buf.view(p, n, layers, ps, heads, dim).permute(2, 0, 1, 3, 4, 5)


def host_geometry(host) -> HostGeometry:
    """The geometry of a host pool kvserver can store, or a ValueError saying why not."""
    kind = type(host)
    if kind not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        raise ValueError(f"kvserver stores SGLang's MHATokenToKVPoolHost and MLATokenToKVPoolHost "
                         f"pages; not {kind.__name__}")
    layout = getattr(host, "layout", None)
    if layout not in LAYOUTS:
        raise ValueError(f"HiCache host layout {layout!r} is not supported by kvserver; use "
                         f"--hicache-mem-layout {' or '.join(LAYOUTS)}")
    buf = getattr(host, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError("the HiCache host pool has no contiguous CPU kv_buffer for kvserver to copy")
    if getattr(host, "storage_format_tag", None) is not None:
        raise ValueError(f"host pages in the {host.storage_format_tag!r} format are not supported")
    if host.layer_num != host.target_layer_num:
        raise ValueError(f"the host pool packs {host.layer_num - host.target_layer_num} MTP draft layers "
                         "after the model's; kvserver stores the model's layers only")
    if kind is MLATokenToKVPoolHost:
        if getattr(host, "_layer_shard_enabled", False) or getattr(host, "dcp_size", 1) != 1:
            raise ValueError("layer-sharded or DCP-sharded MLA host pools are not supported")
        if host.kv_cache_dim != host.kv_lora_rank + host.qk_rope_head_dim:
            raise ValueError(f"MLA rows of {host.kv_cache_dim} are not kv_lora_rank + qk_rope_head_dim "
                             f"({host.kv_lora_rank} + {host.qk_rope_head_dim})")
        kv_layout = KVLayout.mla(host.kv_lora_rank, host.qk_rope_head_dim)
    else:
        kv_layout = KVLayout.mha(host.head_num, host.head_dim)
    geo = HostGeometry(kv_layout, layout, int(host.page_size), int(host.page_num), int(host.start_layer),
                       int(host.target_layer_num), buf.dtype)
    if buf.numel() != geo.page_numel * geo.num_pages:
        raise ValueError(f"kv_buffer {tuple(buf.shape)} does not hold {geo.num_pages} pages of "
                         f"{geo.num_layers} layers")
    return geo


def wire_dtype(store: torch.dtype, configured: str | None) -> torch.dtype:
    """The dtype the daemon is told. SGLang keeps fp8 KV in uint8, and nothing in a host pool
    says which fp8: ``configured`` (extra_config ``dtype``), else SGLang's published
    ``--kv-cache-dtype``, must."""
    if configured is not None:
        logical = _DTYPES.get(str(configured).lower())
        if logical is None:
            raise ValueError(f"extra_config dtype {configured!r}: use one of {sorted(_DTYPES)}")
        if logical.itemsize != store.itemsize or (store != torch.uint8 and logical != store):
            raise ValueError(f"extra_config dtype {configured!r} does not match the host pool's {store}")
        return fp8_wire_dtype(store, logical)
    if store != torch.uint8:
        return store
    logical = _sglang_kv_cache_dtype()
    if logical is None:
        raise ValueError("the host pool stores fp8 KV as uint8: set extra_config dtype "
                         "(fp8_e4m3 or fp8_e5m2)")
    return fp8_wire_dtype(store, logical)


def _sglang_kv_cache_dtype() -> torch.dtype | None:
    """SGLang's --kv-cache-dtype, where the engine published it and it names an fp8 dtype."""
    try:
        from sglang.srt.runtime_context import get_model

        named = get_model().kv_cache_dtype
    except Exception:  # not running inside an engine that published its configuration
        return None
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(named)


def page_keys(hashes) -> bytes:
    """SGLang's storage hashes as 32-byte keys: a 64-hex hash is its own bytes; any other string
    key (a caller that tags its keys, say) is named by the SHA-256 of its UTF-8 bytes, so it is
    stored and found as consistently as the hashes are."""
    out = bytearray()
    for h in hashes:
        if not isinstance(h, str):
            raise ValueError(f"a storage key must be a string, not {type(h).__name__}")
        try:
            key = bytes.fromhex(h) if len(h) == 2 * KEY_BYTES else b""
        except ValueError:
            key = b""
        out += key or hashlib.sha256(b"kvclient.sglang.storage:" + h.encode()).digest()
    return bytes(out)


def host_pages(host_indices, n: int, geo: HostGeometry) -> torch.Tensor | None:
    """The host page of each of ``n`` keys from the token indices SGLang passes (whole, aligned,
    distinct pages of the pool), or None if they are not that."""
    if not isinstance(host_indices, torch.Tensor):
        return None
    ps = geo.page_size
    idx = host_indices.to("cpu", torch.int64).reshape(-1)
    if idx.numel() != n * ps:
        return None
    grid = idx.view(n, ps)
    first = grid[:, 0]
    if bool((first % ps).any()) or not torch.equal(grid, first[:, None] + torch.arange(ps)):
        return None
    pages = first // ps
    if n and (int(pages.min()) < 0 or int(pages.max()) >= geo.num_pages):
        return None
    if torch.unique(pages).numel() != n:
        return None
    return pages


# ---- the staging pool ----------------------------------------------------------------------------


@functools.cache
def _strided_out_ok() -> bool:
    """Whether this torch's index_select writes a non-contiguous ``out`` where its strides say
    (2.13 does; a version that wrote it as if contiguous would corrupt stored pages)."""
    src = torch.arange(2 * 3 * 5 * 4, dtype=torch.int16).view(2, 5, 3, 4).permute(2, 0, 1, 3)
    out = torch.zeros(3, 2, 6, 4, dtype=torch.int16)[:, :, :3]
    idx = torch.tensor([4, 0, 2])
    torch.index_select(src, 2, idx, out=out)
    return torch.equal(out, src[:, :, idx])


class Staging:
    """The sealed memfd the daemon copies from and into: ``pages`` pages of the host pool's
    geometry, layer-first (a ShmKVPool), seen as ``view`` = ``[layers, parts, pages, page_size,
    heads, dim]`` in the host pool's store dtype. Device page i of the registration is page i."""

    def __init__(self, geo: HostGeometry, dtype: torch.dtype, pages: int) -> None:
        self.pages = pages
        self.pool = ShmKVPool(geo.kv_layout, dtype, geo.num_layers, pages * geo.page_size)
        heads, dim = geo.kv_layout.token_shape
        shape = (geo.num_layers, geo.parts, pages, geo.page_size, heads, dim)
        first = self.pool.buffers[0][0].view(geo.store_dtype)
        strides, step = [], 1
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
        self.view = torch.as_strided(first, shape, strides, first.storage_offset())
        self._check(geo)

    def _check(self, geo: HostGeometry) -> None:
        """The ShmKVPool is packed layer, part, token as the view assumes."""
        for layer in range(geo.num_layers):
            for part in range(geo.parts):
                if self.pool.buffers[layer][part].data_ptr() != self.view[layer, part].data_ptr():
                    raise RuntimeError("the staging pool is not laid out layer-first")

    def gather(self, host_view: torch.Tensor, pages: torch.Tensor) -> None:
        """Host pages ``pages`` into staging pages 0..n-1, in one vectorised copy (straight into
        the strided staging chunk: no temporary, unlike advanced indexing, which measured 7x
        slower). Should this torch not honour a strided ``out``, one copy per (layer, part)."""
        n = pages.numel()
        if _strided_out_ok():
            torch.index_select(host_view, 2, pages, out=self.view[:, :, :n])
            return
        for layer in range(self.view.shape[0]):
            for part in range(self.view.shape[1]):
                torch.index_select(host_view[layer, part], 0, pages, out=self.view[layer, part, :n])

    def scatter(self, host_view: torch.Tensor, pages: torch.Tensor) -> None:
        """Staging pages 0..n-1 into host pages ``pages``, in one vectorised copy (indexing the
        outermost dimension, which torch's index_copy_ runs about a third faster)."""
        src = self.view[:, :, : pages.numel()].movedim(2, 0)
        host_view.movedim(2, 0).index_copy_(0, pages, src)

    def close(self) -> None:
        self.view = None
        self.pool.close()


# ---- the backend ---------------------------------------------------------------------------------


class KVServerStorage(HiCacheStorage):
    """kvserver as SGLang's HiCache L3 storage (``interface_v1``); see the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        cfg = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        if storage_config.attn_cp_size > 1 or storage_config.dcp_size > 1:
            raise ValueError("kvserver stores whole pages per TP rank; attention context parallelism "
                             "(attn_cp_size, dcp_size > 1) splits them: not supported")
        if storage_config.should_split_heads:
            raise ValueError("tp_lcm_size head splitting is not supported by kvserver")
        self.model = cfg.get("model") or storage_config.model_name
        if not self.model:
            raise ValueError("no model name for the KV space: set extra_config model")
        self.num_layers = cfg.get("num_layers")
        self.dtype_name = cfg.get("dtype")
        self.staging_pages = int(cfg.get("staging_pages", DEFAULT_STAGING_PAGES))
        if self.staging_pages < 1:
            raise ValueError(f"staging_pages must be at least 1, not {self.staging_pages}")
        self.timeout = float(cfg.get("timeout_s", 5.0))
        # A Get's stream ends by its own deadline, plus the time to confirm a stopped copy.
        self._wait_s = 3 * self.timeout + 2.0
        self.writer = storage_config.is_storage_writer
        self.client = KVClient(cfg.get("address"), timeout=self.timeout, token=cfg.get("token"),
                               tenant_token=cfg.get("tenant_token"))
        self._registrar = Registrar(self.client, float(cfg.get("retry_register_s", 5.0)))
        self._lock = threading.Lock()  # the staging pool: one call at a time
        self.geometry: HostGeometry | None = None
        self.staging: Staging | None = None
        self._host_view: torch.Tensor | None = None
        self._wire_dtype: torch.dtype | None = None
        self._closed = False
        self._side_pools: list[str] = []  # host pools beside the KV pool (a hybrid model's)
        self._pools_known = False  # on_host_pools_registered came
        self._warned: set[str] = set()
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}

    # ---- registration ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostKVCache):
        """Reads the host pool, builds the staging pool and registers it. Raises for a pool kvserver
        cannot store or an unknown layer count; a daemon that is away only makes calls miss."""
        super().register_mem_pool_host(mem_pool_host)
        geo = host_geometry(mem_pool_host)
        cfg = self.storage_config
        start, end = geo.start_layer, geo.start_layer + geo.num_layers
        num_layers = self.num_layers
        if num_layers is None:
            if cfg.pp_rank != cfg.pp_size - 1:
                raise ValueError(f"PP stage {cfg.pp_rank} of {cfg.pp_size} (layers [{start}, {end})) cannot "
                                 "know the model's layer count: set extra_config num_layers")
            num_layers = end
        if int(num_layers) < end:
            raise ValueError(f"num_layers {num_layers} is below this stage's layers [{start}, {end})")
        self.geometry = geo
        self._wire_dtype = wire_dtype(geo.store_dtype, self.dtype_name)
        self._host_view = geo.pages_view(mem_pool_host.kv_buffer, geo.num_pages)
        self.staging = Staging(geo, self._wire_dtype, self.staging_pages)
        self._registrar.renew(
            model=str(self.model), pool=self.staging.pool, start_layer=start, end_layer=end,
            num_layers=int(num_layers), host_tokens=0, page_size=geo.page_size, tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            weights=sglang_weights(dict(cfg.extra_config or {})),
        )
        if self._registrar.ensure(strict=True):
            self._probe()

    def _probe(self) -> None:
        """An empty Lookup, so that what the daemon checks at an engine's first cache call is
        checked at startup: a KV space it refuses (too many layers, say) raises here; a part
        whose layer range another engine fixed differently is a miss, which kvclient logs naming
        both ranges (the cache is best effort; this engine recomputes)."""
        try:
            self.client.lookup(b"", key_bytes=KEY_BYTES)
        except Exception as exc:
            if not daemon_away(exc):
                self.close()
                raise
            logger.warning("kvserver: the first lookup failed (%s)", exc)

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool is not getattr(self, "mem_pool_host", None) and host_pool_name != PoolName.KV:
            self._side_pools.append(str(host_pool_name))
            if self._pools_known:  # a sidecar added while serving: nothing more is stored
                self._warn_once(f"pool:{host_pool_name}", "kvserver stores full-attention KV only; "
                                "the %s pool added now cannot be stored, so no prefetch of this model "
                                "could hit: its KV pages are no longer stored either", host_pool_name)

    def on_host_pools_registered(self) -> None:
        """SGLang's pools are all known: a hybrid model's (sliding-window or Mamba state pools
        beside the KV pool) is refused, failing the attach at startup (docs/integrations.md,
        "Limits"): no prefetch of it could hit, and its KV pages would only take the node cache's
        memory from other engines."""
        super().on_host_pools_registered()
        self._pools_known = True
        if self._side_pools:
            self.close()  # (SGLang drops a backend whose attach failed without closing it)
            raise ValueError(f"kvserver's HiCache backend stores full-attention KV only; this model also "
                             f"has {', '.join(self._side_pools)} pools (sliding-window or Mamba state), "
                             "which it cannot store, so none of its prefetches could hit: run it without "
                             "--hicache-storage-backend dynamic (kvserver)")

    def _ready(self) -> bool:
        """Registered (or registered again now); False: miss. Call with the staging lock held."""
        if self._closed or self.staging is None:
            return False
        return self._registrar.ensure()

    def _renew_staging(self, why: str) -> None:
        """A Get the daemon could not confirm stopped may still write the staging pool: use a new
        one (a new registration, which replaces and so stops the old one) from now on."""
        logger.warning("kvserver: %s; the staging pool is replaced", why)
        old, self.staging = self.staging, Staging(self.geometry, self._wire_dtype, self.staging_pages)
        self._registrar.renew(pool=self.staging.pool)
        old.close()  # our mapping only: a copy still running writes the daemon's own

    # ---- the v1 interface --------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading keys the daemon holds for this engine's part (no pin); 0 on any failure."""
        if not keys or self.staging is None:
            return 0
        try:
            packed = page_keys(keys)
            if self._closed or not self._registrar.ensure():
                return 0
            return min(self.client.lookup(packed, key_bytes=KEY_BYTES).pages, len(keys))
        except Exception as exc:
            self._warn_once(f"exists:{type(exc).__name__}", "kvserver: lookup failed (%s): a miss", exc)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Loads the longest stored prefix of ``keys`` into the host pool at ``host_indices``:
        True for each page of it (fully written into the host pool), False after; the host pages
        after the prefix are not touched."""
        pages = self._pages(keys, host_indices, "get")
        if pages is None:
            return [False] * len(keys)
        began = time.perf_counter()
        loaded = self._load(keys, lambda at, n: self.staging.scatter(self._host_view, pages[at:at + n]))
        self._record("prefetch", loaded, began)
        return [True] * loaded + [False] * (len(keys) - loaded)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Stores the host pages at ``host_indices`` under ``keys``: True for each page the cache
        now holds (stored, or already there), False for the rest. An MLA rank that is not the
        storage writer answers True and writes nothing (the writer stores the same pages)."""
        if self._side_pools:  # a hybrid model's sidecar came while serving: nothing could hit
            return [False] * len(keys)
        if not self.writer:
            return [True] * len(keys)
        pages = self._pages(keys, host_indices, "set")
        if pages is None:
            return [False] * len(keys)
        began = time.perf_counter()
        stored = self._store(keys, lambda at, n: self.staging.gather(self._host_view, pages[at:at + n]))
        self._record("backup", stored, began)
        return [True] * stored + [False] * (len(keys) - stored)

    def _pages(self, keys: List[str], host_indices, what: str) -> torch.Tensor | None:
        if not keys or self.geometry is None:
            return None
        pages = host_pages(host_indices, len(keys), self.geometry)
        if pages is None:
            self._warn_once(f"indices:{what}", "kvserver: batch_%s_v1 host indices are not %d whole, "
                            "distinct host pages: not done", what, len(keys))
        return pages

    # ---- chunks through the staging pool -----------------------------------------------------

    def _chunks(self, keys: List[str], run: Callable[[int, bytes, int], int]) -> int:
        """Runs ``run(start, packed keys, n)`` chunk by chunk of at most staging_pages keys while
        each chunk is done whole; returns how many leading keys were done. Never raises."""
        done = 0
        try:
            packed = page_keys(keys)
            for start in range(0, len(keys), self.staging_pages):
                n = min(self.staging_pages, len(keys) - start)
                got = run(start, packed[start * KEY_BYTES:(start + n) * KEY_BYTES], n)
                done += got
                if got < n:
                    break
        except Exception as exc:
            self._warn_once(f"chunk:{type(exc).__name__}", "kvserver: a cache call failed (%s): a miss", exc)
        return done

    def _load(self, keys: List[str], land: Callable[[int, int], None]) -> int:
        """Gets ``keys`` into staging chunk by chunk; ``land(start, n)`` takes the n leading pages
        of a chunk that fully arrived. Returns how many leading keys landed."""

        def run(start: int, packed: bytes, n: int) -> int:
            with self._lock:
                got = self._get_chunk(packed, n)
                if got:
                    land(start, got)
                return got

        return self._chunks(keys, run)

    def _get_chunk(self, packed: bytes, n: int) -> int:
        """One Get of n keys into staging pages 0..n-1: how many leading pages fully arrived (0 if
        the Get missed or failed at any point). With the staging lock held."""
        if not self._ready():
            return 0
        handle = None
        try:
            handle = self.client.get(packed, list(range(n)), key_bytes=KEY_BYTES)
            got = min(handle.pages(timeout=self._wait_s), n)
            handle.wait(timeout=self._wait_s)
        except Exception as exc:
            if isinstance(exc, TimeoutError) or (handle is not None and not handle.confirmed):
                self._renew_staging(f"a get did not end in time ({exc})")
            else:
                self._warn_once(f"get:{type(exc).__name__}", "kvserver: get failed (%s): a miss", exc)
            return 0
        if handle.missed:
            if not handle.confirmed:
                self._renew_staging("a get failed and the daemon did not confirm that its copy stopped")
            return 0
        return got

    def _store(self, keys: List[str], fill: Callable[[int, int], None]) -> int:
        """``fill(start, n)`` puts a chunk's pages into staging pages 0..n-1, which are then Put;
        returns how many leading keys the cache holds afterwards."""

        def run(start: int, packed: bytes, n: int) -> int:
            with self._lock:
                if not self._ready():
                    return 0
                fill(start, n)
                result = self.client.put(packed, list(range(n)), key_bytes=KEY_BYTES)
            # A Put stores the leading keys it can and drops the last ones.
            return max(0, min(n - result.dropped, result.stored + result.present))

        return self._chunks(keys, run)

    # ---- the old interface (tensors of one page each, as SGLang's get_data_page flattens it) --

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Loads one page into ``target_location`` (a flat page tensor); None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None] | int:
        """Loads the longest stored prefix of ``keys`` into their flat page tensors: each loaded
        target, then None. Targets that are not flat page tensors (raw pointers, as Mooncake's
        zero-copy callers pass) cannot be served: all None."""
        targets = self._flat_pages(keys, target_locations, "batch_get")
        if targets is None:
            return [None] * len(keys)

        def land(start: int, n: int) -> None:
            for i in range(n):
                targets[start + i][:, :, 0].copy_(self.staging.view[:, :, i])

        loaded = self._load(keys, land)
        return list(target_locations[:loaded]) + [None] * (len(keys) - loaded)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Stores one flat page tensor under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Stores flat page tensors under ``keys``; True if the cache holds them all afterwards."""
        if not keys or self._side_pools:  # (a hybrid model's sidecar came while serving)
            return False
        if not self.writer:
            return True
        sources = self._flat_pages(keys, values, "batch_set")
        if sources is None:
            return False

        def fill(start: int, n: int) -> None:
            for i in range(n):
                self.staging.view[:, :, i].copy_(sources[start + i][:, :, 0])

        return self._store(keys, fill) == len(keys)

    def _flat_pages(self, keys: List[str], tensors, what: str) -> list[torch.Tensor] | None:
        """Each flat page tensor as ``[layers, parts, 1, page_size, heads, dim]``, or None if they
        are not one contiguous page each in the host pool's dtype."""
        geo = self.geometry
        ok = (geo is not None and isinstance(tensors, list | tuple) and len(tensors) == len(keys)
              and all(isinstance(t, torch.Tensor) and t.is_contiguous() and t.numel() == geo.page_numel
                      and t.dtype == geo.store_dtype and t.device.type == "cpu" for t in tensors))
        if not ok:
            self._warn_once(f"flat:{what}", "kvserver: %s needs one flat host page tensor per key (as "
                            "get_data_page gives); anything else misses", what)
            return None
        return [geo.pages_view(t, 1) for t in tensors]

    # ---- v2 (the hybrid controller's side pools): not stored ---------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        if not pool_transfers:
            hit = self.batch_exists(keys, extra_info)
            return PoolTransferResult(hit, {PoolName.KV: hit} if hit else {}, list(range(1, hit + 1)))
        self._warn_once("v2", "kvserver stores the KV pool only: requests with side pools miss")
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        self._warn_once("v2", "kvserver stores the KV pool only: requests with side pools miss")
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        self._warn_once("v2", "kvserver stores the KV pool only: requests with side pools miss")
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # ---- lifecycle and stats -----------------------------------------------------------------

    def clear(self) -> None:
        """Nothing: the node-wide cache is shared by every engine of the model (replicas, TP ranks,
        PP stages, restarts) and has no per-engine clear; the daemon evicts it under its budget.
        Serve a changed model under another model name instead."""
        self._warn_once("clear", "kvserver: clear() leaves the node-wide cache as it is (other engines "
                        "share it); it is evicted by the daemon")

    def get_stats(self):
        """Pages and bandwidth (GB/s) of each get and set since the last call, as SGLang's
        StorageMetrics (None unless --enable-storage-metrics)."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            metrics = StorageMetrics(**{k: list(v) for k, v in self._metrics.items()})
            for values in self._metrics.values():
                values.clear()
        return metrics

    def _record(self, what: str, pages: int, began: float) -> None:
        if not self.storage_config.enable_storage_metrics or not pages or self.geometry is None:
            return
        seconds = max(time.perf_counter() - began, 1e-9)
        gb = pages * self.geometry.page_numel * self.geometry.store_dtype.itemsize / 1e9
        with self._metrics_lock:
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bandwidth"].append(gb / seconds)

    def close(self) -> None:
        """Unregisters and closes the staging pool (the cached pages stay, for other engines)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for step in (self.client.unregister, self.client.close):
                try:
                    step()
                except Exception as exc:
                    logger.debug("kvserver: close: %s", exc)
            if self.staging is not None:
                self.staging.close()
                self.staging = None

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)
