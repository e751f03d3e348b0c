"""Copy planning and execution between a client's host region and its device pool.

A request is validated and turned into a ``CopyPlan`` once; the plan is then applied layer by
layer. Host memory is page-first (a page holds every layer of the client's range), so each
(layer, part) of a host page is one contiguous chunk of ``page_size`` tokens. Rows are pages
whenever the device indices are whole aligned pages too, else device tokens.

A whole job (every layer and part) is one call of the ``_kvcopy`` C kernel: one pass, one memcpy
per row, no temporary, no thread pool of its own, and the GIL released from the first byte to the
last, so the event loop keeps serving while it runs. Per-layer progress comes out through a
counter and an eventfd. Without the compiled kernel the copy falls back to torch, per (layer,
part): ``index_select(out=scratch)`` then ``index_copy_`` (two passes), over the same memory; such a
daemon imports torch at its start (``load_torch``; its copy threads: ``--torch-threads``), as does
one where CuPy is installed. Views are numpy arrays over mapped memory
(``kvserver.protocol.raw_memory``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from kvserver.copies.geometry import Geometry
from kvserver.errors import InvalidArgument, OutOfRange, Unimplemented
from kvserver.protocol import compiled
from kvserver.protocol.raw_memory import address

logger = logging.getLogger(__name__)

# The copy kernel (csrc/kvcopy.c); None where not built (e.g. run from a source tree without a
# build) or built from other sources: torch's indexing below.
_kvcopy = compiled.extension("kvserver.copies._kvcopy")
if _kvcopy is not None:
    # STREAM_MIN_JOB: from this many bytes a job's rows are copied with streaming stores (stream.h)
    STREAM_MIN_JOB, copy_layers, copy_rows, _streams = (_kvcopy.STREAM_MIN_JOB, _kvcopy.copy_layers,
                                                        _kvcopy.copy_rows, _kvcopy.streams)
else:
    copy_layers = copy_rows = _streams = None
    STREAM_MIN_JOB = 0


def streams(to_device: bool, job_bytes: int) -> bool:
    """Whether the kernel copies a job with streaming stores (stream.h's kv_streams): every write
    to host memory, and loads of ``STREAM_MIN_JOB`` bytes or more. The whole job's size decides,
    though a piece of it copies less."""
    return _streams is not None and _streams(to_device, job_bytes)  # the data plane's own rule


@dataclass(frozen=True, slots=True)
class BufferTable:
    """Where every (layer, part) buffer of one pool starts, viewed as rows of ``row_bytes``."""

    bases: np.ndarray  # uint64 [layers, parts]: address of row 0
    row_stride: int | None  # bytes between rows; None when the buffers' strides differ
    row_bytes: int
    # The buffers' shared addressing where it is not plain rows (blocks or strided heads,
    # docs/layouts.md): rows are then tokens, or (token, head) segments of ``row_bytes``.
    geometry: Geometry | None = None

    @classmethod
    def of(cls, views: list[list[np.ndarray]]) -> BufferTable:
        strides = {v.strides[0] for layer in views for v in layer}
        return cls(
            bases=np.array([[address(v) for v in layer] for layer in views], dtype=np.uint64),
            row_stride=strides.pop() if len(strides) == 1 else None,
            row_bytes=views[0][0].shape[1] * views[0][0].itemsize,
        )


@dataclass(frozen=True, slots=True)
class CopyPlan:
    host_pages: np.ndarray  # int64 page ids in the client's region
    # int64 device page ids if device_paged or of_pages, else device token ids
    rows: np.ndarray
    device_paged: bool  # copied as rows of whole device pages (the pool's pages are contiguous)
    page_size: int
    # The rows are whole device pages of a pool copied by tokens (a cache copy's): their tokens
    # (device_rows) are made only if a copy asks for them, and the order of a client's copies and
    # the data plane take the pages, one entry a page (the largest Put names 8 Mi tokens).
    of_pages: bool = False
    # Byte offsets of every row, per (host page stride, device row stride, row bytes); the tokens
    # of a plan of pages, under "tokens".
    _offsets: dict = field(default_factory=dict)

    @property
    def device_rows(self) -> np.ndarray:
        """int64 device page ids if device_paged, else device token ids."""
        if not self.of_pages:
            return self.rows
        got = self._offsets.get("tokens")
        if got is None:
            p = self.page_size
            got = (self.rows[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1)
            self._offsets["tokens"] = got
        return got

    @property
    def device_pages(self) -> np.ndarray | None:
        """The whole device pages the copy names, in order; None for a copy of tokens."""
        return self.rows if self.device_paged or self.of_pages else None

    @property
    def num_tokens(self) -> int:
        return self.host_pages.size * self.page_size

    def offsets(self, host_stride: int, dev_stride: int, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        key = (host_stride, dev_stride, row_bytes)
        got = self._offsets.get(key)
        if got is None:
            if self.device_paged:
                host = self.host_pages * host_stride
            else:  # token rows: token k of a host page lies k rows into the page's chunk
                host = (self.host_pages[:, None] * host_stride
                        + np.arange(self.page_size, dtype=np.int64) * row_bytes).reshape(-1)
            got = (np.ascontiguousarray(host), np.ascontiguousarray(self.device_rows * dev_stride))
            self._offsets[key] = got
        return got


    def strided_offsets(self, host_stride: int, geom: Geometry) -> tuple[np.ndarray, np.ndarray]:
        """Host and device byte offsets of every row for a device buffer of geometry ``geom``
        (relative to the buffer's ``offset``): a row is a token where heads are contiguous, else a
        (token, head) segment of ``head_bytes``. Host rows are page-first and token-major as ever:
        token k of a host page lies k tokens into the page's chunk, its heads one after another."""
        key = ("strided", host_stride, geom.shape_key())
        got = self._offsets.get(key)
        if got is None:
            if self.device_paged:
                raise AssertionError("a strided pool is never planned in pages")
            tb = geom.token_bytes
            host = (self.host_pages[:, None] * host_stride
                    + np.arange(self.page_size, dtype=np.int64) * tb).reshape(-1)
            dev = geom.token_offsets(self.device_rows)
            if not geom.heads_contiguous:
                host = (host[:, None] + np.arange(geom.heads, dtype=np.int64) * geom.head_bytes).reshape(-1)
                dev = (dev[:, None] + np.arange(geom.heads, dtype=np.int64) * geom.head_stride).reshape(-1)
            got = (np.ascontiguousarray(host), np.ascontiguousarray(dev))
            self._offsets[key] = got
        return got


def as_indices(values, what: str) -> np.ndarray:
    """int64 array of a protobuf repeated field (or any flat sequence). ``np.asarray`` reads the
    field in C: for 4 Mi values ~10 ms, against ~30 ms for ``np.array`` and ~400 ms for
    ``np.fromiter``."""
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} indices must be a flat list")
    return arr


def has_repeats(values: np.ndarray) -> bool:
    """Whether any value occurs twice: one pass for ascending input (what Alloc hands out), else a
    sort (``np.unique`` is ~50x slower here: 4 s for 4 Mi values)."""
    if values.size < 2:
        return False
    if (values[1:] > values[:-1]).all():
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def whole_pages(tokens: np.ndarray, page_size: int) -> np.ndarray | None:
    """Page ids if ``tokens`` are whole, aligned pages in order within each page; else None."""
    if tokens.size % page_size:
        return None
    if page_size == 1:
        return tokens
    rows = tokens.reshape(-1, page_size)
    first = rows[:, 0]
    if (first % page_size).any():
        return None
    if (rows != first[:, None] + np.arange(page_size, dtype=np.int64)).any():
        return None
    return first // page_size


def host_pages_of(tokens: np.ndarray, page_size: int) -> np.ndarray:
    pages = whole_pages(tokens, page_size)
    if pages is None:
        raise InvalidArgument(
            f"host indices must be whole, aligned pages of {page_size} tokens as returned by "
            f"Alloc ({tokens.size} indices given)"
        )
    return pages


def check_device_tokens(tokens: np.ndarray, num_tokens: int) -> None:
    if tokens.size == 0:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= num_tokens:
        bad = lo if lo < 0 else hi
        raise OutOfRange(f"device index {bad} is outside the device pool of {num_tokens} tokens")
    if has_repeats(tokens):
        raise InvalidArgument("device indices name the same slot more than once")


def make_plan(
    host_pages: np.ndarray, device_tokens: np.ndarray, page_size: int, num_device_pages: int | None
) -> CopyPlan:
    """Plans a copy whose indices were already checked."""
    dev_pages = None
    if num_device_pages is not None:
        dev_pages = whole_pages(device_tokens, page_size)
        if dev_pages is not None and dev_pages.size and int(dev_pages.max()) >= num_device_pages:
            dev_pages = None
    rows = device_tokens if dev_pages is None else dev_pages
    return CopyPlan(
        host_pages=np.ascontiguousarray(host_pages, dtype=np.int64),
        rows=np.ascontiguousarray(rows, dtype=np.int64),
        device_paged=dev_pages is not None,
        page_size=page_size,
    )


def copy_part(plan: CopyPlan, host: np.ndarray, device_pages: np.ndarray | None,
              device_tokens: np.ndarray, to_device: bool, stream: bool = False) -> None:
    """Copies one (layer, part). ``host`` is [region_pages, page_size*elems]; device views are
    [pages, page_size*elems] and [tokens, elems]. ``stream``: copied with streaming stores, as the
    daemon copies a job where ``streams`` says so."""
    if plan.host_pages.size == 0:
        return
    dev = device_pages if plan.device_paged else device_tokens
    if copy_rows is None:
        _copy_part_torch(plan, host, dev, to_device)
        return
    row_bytes = dev.shape[1] * dev.itemsize
    host_off, dev_off = plan.offsets(host.strides[0], dev.strides[0], row_bytes)
    if to_device:
        copy_rows(address(dev), dev_off.ctypes.data, address(host), host_off.ctypes.data,
                  dev_off.size, row_bytes, stream)
    else:
        copy_rows(address(host), host_off.ctypes.data, address(dev), dev_off.ctypes.data,
                  dev_off.size, row_bytes, stream)


def copy_part_at(plan: CopyPlan, host: BufferTable, layer: int, part: int, device_pages: np.ndarray | None,
                 device_tokens: np.ndarray, to_device: bool) -> None:
    """Copies one (layer, part) between a device view and host rows given by a table whose rows
    are byte offsets (the cache's pages, wherever they lie in the arena)."""
    if plan.host_pages.size == 0:
        return
    if copy_rows is None:
        raise Unimplemented("the node-wide cache needs kvserver's compiled copy kernel (_kvcopy)")
    dev = device_pages if plan.device_paged else device_tokens
    row_bytes = dev.shape[1] * dev.itemsize
    host_off, dev_off = plan.offsets(host.row_stride, dev.strides[0], row_bytes)
    base = int(host.bases[layer, part])
    if to_device:
        copy_rows(address(dev), dev_off.ctypes.data, base, host_off.ctypes.data, dev_off.size, row_bytes)
    else:
        copy_rows(base, host_off.ctypes.data, address(dev), dev_off.ctypes.data, dev_off.size, row_bytes)


@dataclass(frozen=True, slots=True)
class JobRows:
    """A job's rows as the kernel copies them: byte offsets of every row on each side (relative
    to each (layer, part) buffer's base) and the bytes of a row."""

    host: np.ndarray
    device: np.ndarray
    row_bytes: int

    @property
    def count(self) -> int:
        return self.device.size


def row_count(plan: CopyPlan, host: BufferTable, device: BufferTable) -> int | None:
    """How many rows ``job_rows`` makes, without making them; None where it makes none."""
    if device.geometry is not None:
        if copy_layers is None or host.row_stride is None:
            raise Unimplemented("pools with blocks or strided heads need kvserver's compiled copy kernel "
                                "(_kvcopy) and one host row stride")
        heads = 1 if device.geometry.heads_contiguous else device.geometry.heads
        return plan.device_rows.size * heads  # token rows, or (token, head) segments
    if copy_layers is None or device.row_stride is None or host.row_stride is None:
        return None
    return plan.device_rows.size  # pages of a paged plan, else tokens


def job_rows(plan: CopyPlan, host: BufferTable, device: BufferTable) -> JobRows | None:
    """The rows of a job between ``host`` and ``device`` (its pool's page table for a paged plan,
    its token table otherwise); None if the kernel cannot copy them (no compiled kernel, or
    buffers with different strides)."""
    if row_count(plan, host, device) is None:
        return None
    if device.geometry is not None:
        host_off, dev_off = plan.strided_offsets(host.row_stride, device.geometry)
    else:
        host_off, dev_off = plan.offsets(host.row_stride, device.row_stride, device.row_bytes)
    return JobRows(host_off, dev_off, device.row_bytes)


class RowCopier:
    """One job's kernel calls, piece by piece (``kvserver.media.shm``): every address is worked
    out once, so a piece costs the kernel call and a few integer sums. ``layers`` are the job's
    local layers; a piece names them by position (``lo``..``hi``) and its rows ``r0``..``r1``."""

    def __init__(self, rows: JobRows, layers: np.ndarray, host: BufferTable, device: BufferTable,
                 to_device: bool) -> None:
        host_bases = np.ascontiguousarray(host.bases[layers], dtype=np.uint64)
        dev_bases = np.ascontiguousarray(device.bases[layers], dtype=np.uint64)
        self.to_device = to_device
        self.parts = host.bases.shape[1]
        self.count = rows.count
        self.row_bytes = rows.row_bytes
        self.stream = streams(to_device, rows.count * rows.row_bytes * host_bases.size)
        if to_device:
            self._keep = (dev_bases, host_bases, rows.device, rows.host)
        else:
            self._keep = (host_bases, dev_bases, rows.host, rows.device)
        dst, src, dst_off, src_off = self._keep  # held for as long as the kernel reads them
        self._dst, self._src = dst.ctypes.data, src.ctypes.data
        self._dst_off, self._src_off = dst_off.ctypes.data, src_off.ctypes.data

    def copy(self, lo: int, hi: int, r0: int, r1: int, progress: np.ndarray | None = None,
             progress_base: int = 0, eventfd: int = -1, signal_interval: float = 0.0,
             stop: np.ndarray | None = None) -> int:
        """Copies rows ``r0``..``r1`` of the job's layers ``lo``..``hi`` (positions) and returns
        how many layers it copied. After each layer the kernel stores ``progress_base`` + the
        layers done in ``progress[0]``, and signals ``eventfd`` once ``signal_interval`` seconds
        have passed since its last signal (always after the last). Before each layer it reads
        ``stop[0]`` (an int64 another thread may set): once set, the copy ends at that layer
        boundary."""
        step = self.parts * 8  # one layer's row of bases (uint64)
        return copy_layers(self._dst + lo * step, self._src + lo * step, (hi - lo) * self.parts,
                           self.parts, self._dst_off + r0 * 8, self._src_off + r0 * 8, r1 - r0,
                           self.row_bytes, 0 if progress is None else progress.ctypes.data, eventfd,
                           int(signal_interval * 1e9), 0 if stop is None else stop.ctypes.data,
                           progress_base, self.stream)


def copy_job(plan: CopyPlan, layers: np.ndarray, host: BufferTable, device: BufferTable,
             to_device: bool, progress: np.ndarray | None = None, eventfd: int = -1,
             signal_interval: float = 0.0, stop: np.ndarray | None = None) -> int | None:
    """A whole job in one kernel call (``RowCopier.copy``); returns the layers copied, or None
    if the kernel cannot copy it, and then nothing was copied."""
    rows = job_rows(plan, host, device)
    if rows is None:
        return None
    copier = RowCopier(rows, layers, host, device, to_device)
    return copier.copy(0, len(layers), 0, rows.count, progress, 0, eventfd, signal_interval, stop)


@functools.cache
def load_torch() -> bool:
    """Imports torch, once: where the daemon uses it (the path below; CUDA, before CuPy:
    ``kvserver.media.cuda.runtime``). True if it is loaded; a torch that fails to load (a CUDA
    library missing) is logged, and the daemon goes on without it."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # a library of its own missing or broken (ImportError, OSError)
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == "torch"):  # (not installed: quiet)
            logger.warning("torch could not be loaded (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def torch_needed() -> bool:
    """Whether this daemon will load torch: it has no copy kernel, or CuPy is installed (the CUDA
    path imports torch before CuPy)."""
    if copy_rows is None or "cupy" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):  # a parent package that fails, a module without a spec
        return False


_scratch = threading.local()


def _scratch_buffer(dtype, rows: int, cols: int):  # torch types: torch is loaded late
    """A per-thread reusable torch buffer of at least rows x cols, grown on demand."""
    import torch

    need = rows * cols
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < need:
        buf = torch.empty(max(need, 1), dtype=dtype)
        _scratch.buf = buf
    return buf[:need].view(rows, cols)


def _copy_part_torch(plan: CopyPlan, host_view: np.ndarray, dev_view: np.ndarray, to_device: bool) -> None:
    if not load_torch():
        raise Unimplemented("copies without kvserver's compiled copy kernel (_kvcopy) need torch, which "
                            "did not load (the daemon's log says why)")
    import torch  # (loaded: at the daemon's start, ``torch_needed``)

    host, dev = torch.from_numpy(host_view), torch.from_numpy(dev_view)  # the same memory
    host_pages = torch.from_numpy(plan.host_pages)
    dev_rows = torch.from_numpy(plan.device_rows)
    tmp = _scratch_buffer(host.dtype, host_pages.numel(), host.shape[1])
    dev_tmp = tmp.view(-1, dev.shape[1])
    if to_device:
        torch.index_select(host, 0, host_pages, out=tmp)
        dev.index_copy_(0, dev_rows, dev_tmp)
    else:
        torch.index_select(dev, 0, dev_rows, out=dev_tmp)
        host.index_copy_(0, host_pages, tmp)
