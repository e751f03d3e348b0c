"""Copy planning and execution between a client's host region and its device pool.

A request is validated and turned into a ``CopyPlan`` once; the plan is then applied layer by
layer. Host memory is page-first (a page holds every layer of the client's range), so each
(layer, part) of a host page is one contiguous chunk of ``page_size`` tokens. Rows are pages
whenever the device indices are whole aligned pages too, else device tokens.

Per (layer, part) the copy is one of:
- a few ``copy_`` calls over runs that are consecutive on both sides (one pass, no temporary);
- ``index_select(out=scratch)`` then ``index_copy_`` (two passes through a reused buffer).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvserver.errors import InvalidArgument, OutOfRange

# Use run copies when the average run is at least this many rows long.
MIN_AVG_RUN_ROWS = 4


@dataclass(frozen=True, slots=True)
class CopyPlan:
    host_pages: torch.Tensor  # int64 page ids in the client's region
    device_rows: torch.Tensor  # int64 device page ids if device_paged, else device token ids
    device_paged: bool
    runs: tuple[tuple[int, int, int], ...] | None  # (host_page, device_row, length) when paged
    num_tokens: int


def as_indices(values, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} indices must be a flat list")
    return arr


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
    if np.unique(tokens).size != tokens.size:
        raise InvalidArgument("device indices name the same slot more than once")


def make_plan(
    host_pages: np.ndarray, device_tokens: np.ndarray, page_size: int, num_device_pages: int | None
) -> CopyPlan:
    """Plans a copy whose indices were already checked."""
    n = device_tokens.size
    dev_pages = None
    if num_device_pages is not None:
        dev_pages = whole_pages(device_tokens, page_size)
        if dev_pages is not None and dev_pages.size and int(dev_pages.max()) >= num_device_pages:
            dev_pages = None
    runs = None
    if dev_pages is not None:
        runs = _runs(host_pages, dev_pages)
        rows = dev_pages
    else:
        rows = device_tokens
    return CopyPlan(
        host_pages=torch.from_numpy(np.ascontiguousarray(host_pages)),
        device_rows=torch.from_numpy(np.ascontiguousarray(rows)),
        device_paged=dev_pages is not None,
        runs=runs,
        num_tokens=n,
    )


def _runs(host: np.ndarray, dev: np.ndarray) -> tuple[tuple[int, int, int], ...] | None:
    if host.size == 0:
        return ()
    breaks = np.flatnonzero((np.diff(host) != 1) | (np.diff(dev) != 1)) + 1
    if host.size < MIN_AVG_RUN_ROWS * (breaks.size + 1):
        return None
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [host.size]))
    return tuple(
        (int(host[s]), int(dev[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)
    )


_scratch = threading.local()


def _scratch_buffer(dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """A per-thread reusable buffer of at least rows x cols, grown on demand."""
    need = rows * cols
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < need:
        buf = torch.empty(max(need, 1), dtype=dtype)
        _scratch.buf = buf
    return buf[:need].view(rows, cols)


def copy_part(plan: CopyPlan, host: torch.Tensor, device_pages: torch.Tensor | None,
              device_tokens: torch.Tensor, to_device: bool) -> None:
    """Copies one (layer, part). ``host`` is [region_pages, page_size*elems]."""
    n_pages = plan.host_pages.numel()
    if n_pages == 0:
        return
    if plan.device_paged:
        dev = device_pages
        if plan.runs is not None:
            for h, d, length in plan.runs:
                if to_device:
                    dev[d : d + length].copy_(host[h : h + length])
                else:
                    host[h : h + length].copy_(dev[d : d + length])
            return
        tmp = _scratch_buffer(host.dtype, n_pages, host.shape[1])
        if to_device:
            torch.index_select(host, 0, plan.host_pages, out=tmp)
            dev.index_copy_(0, plan.device_rows, tmp)
        else:
            torch.index_select(dev, 0, plan.device_rows, out=tmp)
            host.index_copy_(0, plan.host_pages, tmp)
        return
    elems = device_tokens.shape[1]
    tmp = _scratch_buffer(host.dtype, n_pages, host.shape[1])
    if to_device:
        torch.index_select(host, 0, plan.host_pages, out=tmp)
        device_tokens.index_copy_(0, plan.device_rows, tmp.view(-1, elems))
    else:
        torch.index_select(device_tokens, 0, plan.device_rows, out=tmp.view(-1, elems))
        host.index_copy_(0, plan.host_pages, tmp)
