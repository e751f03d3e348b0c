"""The copy kernel's streaming stores (kvserver/copies/csrc/stream.h), used for jobs of
STREAM_MIN_JOB bytes or more: the same bytes as memcpy wherever rows start and however long they
are (an unaligned head, whole 64-byte lines, a tail), nothing written outside the rows, and the
progress word of each layer stored only after its rows."""

from __future__ import annotations

import numpy as np
import pytest

from kvserver.copies import transfer

pytestmark = pytest.mark.skipif(transfer.copy_layers is None, reason="the copy kernel is not built")
never = pytest.mark.skipif(transfer.copy_layers is not None and not transfer.streams(False, 1),
                           reason="a build that never streams (CFLAGS=-DKV_NO_STREAM)")


def copy(dst: np.ndarray, src: np.ndarray, dst_off: np.ndarray, src_off: np.ndarray, row_bytes: int,
         layers: int, parts: int, stream: bool, progress: np.ndarray | None = None) -> int:
    """Rows of ``row_bytes`` at the offsets, in each of ``layers * parts`` buffers that follow each
    other in ``dst`` and ``src`` (one buffer a ``len // (layers * parts)`` bytes)."""
    n = layers * parts
    step_d, step_s = dst.size // n, src.size // n
    dst_bases = (dst.ctypes.data + step_d * np.arange(n, dtype=np.uint64)).astype(np.uint64)
    src_bases = (src.ctypes.data + step_s * np.arange(n, dtype=np.uint64)).astype(np.uint64)
    return transfer.copy_layers(dst_bases.ctypes.data, src_bases.ctypes.data, n, parts, dst_off.ctypes.data,
                                src_off.ctypes.data, dst_off.size, row_bytes,
                                0 if progress is None else progress.ctypes.data, -1, 0, 0, 0, stream)


@pytest.mark.parametrize("row_bytes", [1, 63, 255, 256, 300, 4096 + 17, 32768])
def test_streamed_rows_are_the_bytes_memcpy_writes_and_nothing_else(row_bytes):
    rng = np.random.default_rng(row_bytes)
    layers, parts, rows = 3, 2, 40
    slot = row_bytes + 128  # rows start anywhere within their slot, not on a line
    src = rng.integers(0, 256, layers * parts * rows * slot, dtype=np.uint8)
    src_off = (np.arange(rows) * slot + rng.integers(0, 64, rows)).astype(np.int64)
    dst_off = (rng.permutation(rows) * slot + rng.integers(0, 64, rows)).astype(np.int64)
    fill = rng.integers(0, 256, src.size, dtype=np.uint8)
    got, want = fill.copy(), fill.copy()
    progress = np.zeros(1, np.int64)
    assert copy(got, src, dst_off, src_off, row_bytes, layers, parts, True, progress) == layers
    assert copy(want, src, dst_off, src_off, row_bytes, layers, parts, False) == layers
    assert progress[0] == layers
    assert np.array_equal(got, want)
    # And memcpy's own result is the rows, the rest untouched.
    per = src.size // (layers * parts)
    for b in range(layers * parts):
        for d, s in zip(dst_off, src_off, strict=True):
            d, s = b * per + d, b * per + s
            assert np.array_equal(want[d: d + row_bytes], src[s: s + row_bytes])
    # copy_rows (one buffer) streams the same bytes.
    one = fill.copy()
    transfer.copy_rows(one.ctypes.data, dst_off.ctypes.data, src.ctypes.data, src_off.ctypes.data, rows,
                       row_bytes, True)
    assert np.array_equal(one[:per], want[:per])


@never
def test_writes_stream_and_loads_from_the_kernels_threshold():
    """RowCopier decides for the whole job, whose pieces may each be smaller: a write (device to
    host) always, a load from STREAM_MIN_JOB bytes."""
    from kvserver.copies.transfer import JobRows, RowCopier

    class Table:
        def __init__(self, layers, parts):
            self.bases = np.zeros((layers, parts), np.uint64)

    page = 32 << 10
    for pages, load in [(transfer.STREAM_MIN_JOB // (64 * page), True),
                        (transfer.STREAM_MIN_JOB // (64 * page) - 1, False), (1, False)]:
        rows = JobRows(np.zeros(pages, np.int64), np.zeros(pages, np.int64), page)
        assert RowCopier(rows, np.arange(32), Table(32, 2), Table(32, 2), True).stream is load
        assert RowCopier(rows, np.arange(32), Table(32, 2), Table(32, 2), False).stream is True
