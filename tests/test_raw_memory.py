"""The daemon's views of mapped memory (kvserver.protocol.raw_memory): arrays that hold the
address, not the mapping, and that are refused where they would reach past their span; the host
arena hands out none once closed."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvserver.host.arena import HostArena
from kvserver.protocol.raw_memory import address, address_of, array_at, rows_at

MiB = 1 << 20


def test_a_view_does_not_pin_its_mapping_and_reads_its_bytes() -> None:
    mm = mmap.mmap(-1, 4096)
    mm[:8] = bytes(range(8))
    flat = array_at(address_of(mm), 4096, np.int64)
    assert flat.size == 512 and address(flat) == address_of(mm)
    assert flat[0] == int.from_bytes(bytes(range(8)), "little")
    flat[1] = -1
    assert mm[8:16] == b"\xff" * 8
    del flat
    mm.close()  # np.frombuffer's export would refuse this while a view lived


def test_rows_are_laid_where_asked_and_refused_past_their_span() -> None:
    mm = mmap.mmap(-1, 4096)
    flat = array_at(address_of(mm), 4096, np.int32)
    v = rows_at(flat, 64, rows=3, row_items=4, row_stride=1024)
    assert v.shape == (3, 4) and v.strides == (1024, 4) and address(v) == address_of(mm) + 64
    v[2, 3] = 7
    assert int.from_bytes(mm[64 + 2 * 1024 + 12 : 64 + 2 * 1024 + 16], "little") == 7
    assert rows_at(flat, 4096 - 16, rows=1, row_items=4, row_stride=16).shape == (1, 4)  # the last bytes
    for offset, rows, stride in ((4096 - 12, 1, 16), (4096, 1, 16), (64, 5, 1024), (1 << 40, 1, 16)):
        with pytest.raises(ValueError):
            rows_at(flat, offset, rows=rows, row_items=4, row_stride=stride)
    del flat, v
    mm.close()


def test_a_closed_arena_hands_out_no_view_and_no_address() -> None:
    arena = HostArena(16 * MiB)
    assert arena.view(np.uint8).size == 16 * MiB and arena.address == address(arena.view(np.int64))
    arena.close()
    with pytest.raises(RuntimeError, match="closed"):
        arena.view(np.uint8)
    with pytest.raises(RuntimeError, match="closed"):
        _ = arena.address
