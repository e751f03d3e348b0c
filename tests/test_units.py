"""Unit tests of the pieces under the daemon: sizes, layer ranges, arena, pages, copy plans."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvserver.config import ServerConfig, parse_size
from kvserver.copies import order, transfer
from kvserver.errors import FailedPrecondition, InvalidArgument, LayerOutOfRange, NoCapacity, OutOfRange
from kvserver.host.arena import REGION_ALIGN, HostArena
from kvserver.host.pages import PageAllocator
from kvserver.protocol.layout import KVLayout, LayerRange


def test_parse_size():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("4G") == 4 << 30
    assert parse_size("1048576") == 1 << 20
    assert parse_size("1.5k") == 1536
    for bad in ("lots", "8 GiBs", "-1G", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_config_checks():
    with pytest.raises(ValueError):
        ServerConfig(host_memory=1024)
    with pytest.raises(ValueError):
        ServerConfig(listen="no-port", token="t")
    with pytest.raises(ValueError, match="needs a token"):
        ServerConfig(listen="127.0.0.1:5000")
    assert ServerConfig(listen="127.0.0.1:5000", insecure_tcp=True).listen
    assert ServerConfig(socket="/tmp/x.sock", listen="127.0.0.1:5000", token="t").addresses == [
        "unix:///tmp/x.sock", "127.0.0.1:5000"]


def test_layer_range_maps_global_ids_and_names_the_range():
    r = LayerRange(16, 32)
    assert r.to_local(16) == 0 and r.to_local(31) == 15
    with pytest.raises(LayerOutOfRange, match=r"\[16, 32\)"):
        r.to_local(15)
    with pytest.raises(LayerOutOfRange, match=r"\[16, 32\)"):
        r.to_local(32)
    assert r.select([]) == list(range(16))
    assert r.select([17, 20]) == [1, 4]
    with pytest.raises(InvalidArgument):
        r.select([20, 17])
    with pytest.raises(InvalidArgument):
        r.select([17, 17])
    with pytest.raises(InvalidArgument):
        LayerRange(4, 4)


def test_layout_sizes():
    assert KVLayout.mha(8, 128).token_bytes(torch.bfloat16) == 2048
    mla = KVLayout.mla(512, 64)
    assert mla.num_parts == 1 and mla.token_bytes(torch.float8_e4m3fn) == 576
    assert KVLayout.from_wire(mla.to_wire()) == mla


def test_spaces_named_from_the_wire_share_their_layout_object():
    """The daemon keeps a key for each of up to 64 Ki space ids: each costs the collector one
    object, not two (its layout is the one object of its kind; a full collection over 64 Ki ids
    took 35 ms with a layout object each)."""
    import gc

    from kvserver.core.cache_ops import space_from_wire
    from kvserver.v1 import kvserver_pb2 as pb

    msgs = [pb.KVSpace(model=f"m{i}", layout=pb.KVLayout(mha=pb.MHALayout(num_heads=8, head_dim=128)),
                       dtype=pb.DTYPE_BFLOAT16, page_size=16, num_layers=32) for i in range(2000)]
    gc.collect()
    before = len(gc.get_objects())
    keys = [space_from_wire("t", m) for m in msgs]
    assert len(gc.get_objects()) - before <= len(keys) + 50
    assert keys[0].layout is keys[-1].layout and keys[0].layout == KVLayout.mha(8, 128)
    mla = pb.KVLayout(mla=pb.MLALayout(kv_lora_rank=512, qk_rope_head_dim=64))
    assert KVLayout.from_wire(mla) is KVLayout.from_wire(mla) == KVLayout.mla(512, 64)


def test_arena_first_fit_merge_and_exhaustion():
    arena = HostArena(8 * REGION_ALIGN)
    a = arena.reserve(1)
    b = arena.reserve(3 * REGION_ALIGN)
    c = arena.reserve(REGION_ALIGN)
    assert (a, b, c) == (0, REGION_ALIGN, 4 * REGION_ALIGN)
    assert arena.reserved == 5 * REGION_ALIGN
    with pytest.raises(NoCapacity):
        arena.reserve(4 * REGION_ALIGN)
    arena.release(b, 3 * REGION_ALIGN)
    arena.release(a, 1)
    assert arena.largest_free() == 4 * REGION_ALIGN  # a and b merged
    assert arena.reserve(4 * REGION_ALIGN) == 0
    arena.release(0, 4 * REGION_ALIGN)
    arena.release(c, REGION_ALIGN)
    assert arena.largest_free() == arena.capacity and arena.reserved == 0
    arena.close()


def test_page_allocator_checks_ownership():
    pages = PageAllocator(8)
    got = pages.allocate(3)
    assert got.tolist() == [0, 1, 2] and pages.num_free == 5
    with pytest.raises(NoCapacity):
        pages.allocate(6)
    with pytest.raises(OutOfRange):
        pages.check_owned(np.array([8]))
    with pytest.raises(OutOfRange):
        pages.check_owned(np.array([-1]))
    with pytest.raises(FailedPrecondition):
        pages.check_owned(np.array([3]))
    with pytest.raises(InvalidArgument):
        pages.check_owned(np.array([1, 1]))
    pages.free(np.array([1]))
    with pytest.raises(FailedPrecondition):
        pages.free(np.array([1]))
    assert pages.num_used == 2


def test_whole_pages_detection():
    p = 4
    assert transfer.whole_pages(np.arange(8), p).tolist() == [0, 1]
    assert transfer.whole_pages(np.array([8, 9, 10, 11, 0, 1, 2, 3]), p).tolist() == [2, 0]
    assert transfer.whole_pages(np.array([1, 2, 3, 4]), p) is None  # unaligned
    assert transfer.whole_pages(np.array([0, 1, 3, 2]), p) is None  # out of order in the page
    assert transfer.whole_pages(np.arange(6), p) is None  # partial page
    with pytest.raises(InvalidArgument, match="whole, aligned pages"):
        transfer.host_pages_of(np.arange(6), p)


def test_plan_picks_pages_or_tokens():
    p = 4
    # Scattered whole pages: page rows on both sides.
    plan = transfer.make_plan(np.array([5, 1, 3]), np.array([8, 9, 10, 11, 0, 1, 2, 3, 40, 41, 42, 43]),
                              p, num_device_pages=100)
    assert plan.device_paged and plan.device_rows.tolist() == [2, 0, 10]
    host_off, dev_off = plan.offsets(1000, 64, 64)
    assert host_off.tolist() == [5000, 1000, 3000] and dev_off.tolist() == [128, 0, 640]
    # Device slots not whole pages: token rows; host offsets step through each page's chunk.
    plan = transfer.make_plan(np.array([2]), np.array([7, 3, 9, 1]), p, num_device_pages=100)
    assert not plan.device_paged and plan.device_rows.tolist() == [7, 3, 9, 1]
    host_off, dev_off = plan.offsets(1000, 24, 16)
    assert host_off.tolist() == [2000, 2016, 2032, 2048] and dev_off.tolist() == [168, 72, 216, 24]
    # Strided pool (no page view), or whole pages past the last full device page: token rows.
    assert not transfer.make_plan(np.array([0]), np.arange(4), p, num_device_pages=None).device_paged
    assert not transfer.make_plan(np.array([0]), np.arange(8, 12), p, num_device_pages=2).device_paged
    # A cache copy of whole pages of a pool copied by tokens: the pages kept, for the order of the
    # client's copies and the data plane; their tokens made only when a copy asks for them.
    plan = transfer.CopyPlan(np.array([2, 0]), np.array([3, 1]), False, p, of_pages=True)
    assert "tokens" not in plan._offsets and plan.device_pages.tolist() == [3, 1]
    assert order.device_pages(SimpleNamespace(plan=plan)).tolist() == [3, 1] and "tokens" not in plan._offsets
    assert not plan.device_paged and plan.device_rows.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    tokens = transfer.make_plan(np.array([2]), np.array([7, 3, 9, 1]), p, num_device_pages=100)
    assert tokens.device_pages is None


def test_check_device_tokens():
    transfer.check_device_tokens(np.array([0, 9]), 10)
    with pytest.raises(OutOfRange, match="outside the device pool of 10"):
        transfer.check_device_tokens(np.array([10]), 10)
    with pytest.raises(OutOfRange):
        transfer.check_device_tokens(np.array([-1]), 10)
    with pytest.raises(InvalidArgument, match="more than once"):
        transfer.check_device_tokens(np.array([3, 3]), 10)


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("to_device", [True, False])
def test_copy_part_matches_reference(monkeypatch, kernel, paged, to_device):
    if kernel == "c":
        assert transfer.copy_rows is not None, "the _kvcopy extension is not built"
    else:
        monkeypatch.setattr(transfer, "copy_rows", None)
    g = np.random.default_rng(0)
    p, elems, region_pages, dev_tokens = 4, 6, 10, 64
    host_full = g.integers(0, 1 << 30, (region_pages, 3, p * elems), dtype=np.int64)
    host = host_full[:, 1]  # a strided (layer, part) view, as in the daemon
    dev = g.integers(0, 1 << 30, (dev_tokens, elems), dtype=np.int64)
    hp = np.array([7, 2, 5])
    if paged:
        dt = (np.array([3, 9, 0])[:, None] * p + np.arange(p)).reshape(-1)
    else:
        dt = np.random.default_rng(0).permutation(dev_tokens)[: 3 * p]
    plan = transfer.make_plan(hp, dt, p, dev_tokens // p)
    assert plan.device_paged == paged
    host_before, dev_before = host_full.copy(), dev.copy()
    transfer.copy_part(plan, host, dev.reshape(-1, p * elems), dev, to_device)
    rows = host_before[:, 1][hp].reshape(-1, elems)
    if to_device:
        expect = dev_before.copy()
        expect[dt] = rows
        assert np.array_equal(dev, expect)
        assert np.array_equal(host_full, host_before)
    else:
        expect = host_before.copy()
        expect[hp, 1] = dev_before[dt].reshape(3, -1)
        assert np.array_equal(host_full, expect)
        assert np.array_equal(dev, dev_before)


# ---- bounded bookkeeping, unambiguous host indices, layer ids checked against the range first ----------


def test_layer_ids_past_the_range_are_out_of_range_naming_it():
    """A list longer than the range is refused for the id outside it, not for its length."""
    with pytest.raises(LayerOutOfRange, match=r"layer 3 is outside this client's layer range \[2, 3\)"):
        LayerRange(2, 3).select([2, 3])
    with pytest.raises(LayerOutOfRange, match=r"layer 9 is outside .* \[4, 8\)"):
        LayerRange(4, 8).select([4, 5, 6, 7, 9])
    with pytest.raises(LayerOutOfRange, match=r"layer 1 is outside"):
        LayerRange(4, 8).select([1] + [5] * 100_000)
    with pytest.raises(InvalidArgument, match="ascending without repeats"):
        LayerRange(4, 8).select([5] * 100_000)  # every id inside: a repeat


def test_epoch_aliasing_is_refused():
    """With epoch 3, slot 2^36 + 5 would tag to the same index as slot 5: refused, never aliased."""
    from kvserver.core import epochs

    five = epochs.tag(np.array([5]), 3)
    assert int(five[0]) == (3 << epochs.EPOCH_SHIFT) | 5
    with pytest.raises(ValueError, match="2\\^36"):
        epochs.tag(np.array([(1 << 36) + 5]), 3)
    # strip refuses slots past the client's region (here 4 pages of 16 tokens), naming the page.
    assert epochs.strip(five, 3, num_pages=4, page_size=16).tolist() == [5]
    with pytest.raises(OutOfRange, match="host page 4 is outside this client's host region of 4 pages"):
        epochs.strip(epochs.tag(np.array([64]), 3), 3, num_pages=4, page_size=16)


def test_page_allocator_keeps_fifo_order_across_frees():
    pages = PageAllocator(6)
    assert pages.allocate(4).tolist() == [0, 1, 2, 3]
    pages.free(np.array([2, 0]))
    # Never-used pages first, then freed ones in the order they were freed.
    assert pages.allocate(3).tolist() == [4, 5, 2]
    pages.free(np.array([1, 3]))
    assert pages.num_free == 3 and pages.num_used == 3
    assert pages.allocate(3).tolist() == [0, 1, 3]
    with pytest.raises(NoCapacity, match="1 pages requested, 0 of 6 free"):
        pages.allocate(1)
    pages.free(np.array([5, 4, 3, 2, 1, 0]))
    assert pages.allocate(6).tolist() == [5, 4, 3, 2, 1, 0]


def test_page_allocator_of_the_most_pages_is_cheap():
    """16 Mi pages: built, filled, checked and emptied with array operations, not per-page Python."""
    import time

    t0 = time.perf_counter()
    pages = PageAllocator(1 << 24)
    built = time.perf_counter() - t0
    got = pages.allocate(1 << 22)
    shuffled = np.random.default_rng(0).permutation(got)
    t0 = time.perf_counter()
    pages.check_owned(shuffled)
    pages.free(shuffled)
    again = pages.allocate(1 << 24)
    spent = time.perf_counter() - t0
    # Against one array operation over as many pages, in the same run (the machine may be busy):
    # sorting 16 Mi shuffled ids takes about 2 s here; per-page Python would be many times that.
    t0 = time.perf_counter()
    np.sort(np.random.default_rng(1).permutation(1 << 24))
    baseline = time.perf_counter() - t0
    assert again.size == 1 << 24 and pages.num_free == 0
    assert built < 0.05 + baseline / 20 and spent < 3 * baseline, (built, spent, baseline)


def test_repeats_are_found_without_sorting_in_order_input():
    assert not transfer.has_repeats(np.arange(10))
    assert not transfer.has_repeats(np.array([3, 1, 2]))
    assert transfer.has_repeats(np.array([3, 1, 3]))
    assert transfer.has_repeats(np.array([0, 1, 1, 2]))
    assert not transfer.has_repeats(np.array([], dtype=np.int64))


def test_packed_indices_are_the_bytes_protobuf_writes():
    from kvserver.api import packed as wire
    from kvserver.v1 import kvserver_pb2 as pb

    rng = np.random.default_rng(0)
    cases = [
        np.arange(1000) | (12345 << 36),  # one epoch's host indices: every varint the same length
        np.arange(1000) | ((1 << 26) + 1 << 36),  # 9-byte varints
        np.array([0, 1, 127, 128, 16383, 16384, -1, -(1 << 63), (1 << 63) - 1]),  # mixed lengths
        rng.integers(-(1 << 63), (1 << 63) - 1, 1000, dtype=np.int64),
        np.array([], dtype=np.int64),
    ]
    for values in cases:
        expected = pb.AllocResponse(host_indices=values.tolist()).SerializeToString()
        assert wire.packed_int64(1, values) == expected


def test_the_daemon_out_of_descriptors_is_resource_exhausted_not_internal() -> None:
    """A Load's eventfd (or any descriptor the daemon makes) refused with EMFILE or ENFILE is the
    daemon's shortage: RESOURCE_EXHAUSTED, which says to try again, not INTERNAL."""
    import errno
    import os

    from kvserver.errors import Code, status_of

    for number in (errno.EMFILE, errno.ENFILE):
        code, details = status_of(OSError(number, os.strerror(number)))
        assert code == Code.RESOURCE_EXHAUSTED and "out of file descriptors" in details, details
    assert status_of(OSError(errno.EIO, "I/O error"))[0] == Code.INTERNAL


def test_engines_name_their_torch_dtypes_on_the_wire_and_others_are_refused_as_before():
    from kvserver.protocol.layout import KV_DTYPES, kv_dtype, wire_dtype

    for wire, d in KV_DTYPES.items():
        assert wire_dtype(getattr(torch, d.name)) == wire == wire_dtype(d) and kv_dtype(wire) is d
        assert d.itemsize == getattr(torch, d.name).itemsize
    for bad in (torch.int8, torch.float64, np.dtype(np.float16), "bfloat16"):
        with pytest.raises(InvalidArgument, match=r"use one of torch\.bfloat16, torch\.float16, torch\."):
            wire_dtype(bad)
