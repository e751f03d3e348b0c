"""The disk tier's page I/O on a real file: runs, direct and buffered paths, and the checks that
keep a changed, torn or misplaced page from being served."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvserver.copies._kvcopy import crc32c, page_sums
from kvserver.disk import io

PAGE = 8192


@pytest.fixture
def arena():
    mm = mmap.mmap(-1, 64 * PAGE)
    buf = np.frombuffer(mm, np.uint8)
    buf[:] = np.random.default_rng(0).integers(0, 256, len(buf), dtype=np.uint8)
    return mm, buf, int(buf.ctypes.data)  # unmapped once nothing refers to it


@pytest.fixture
def data_file(tmp_path):
    path = str(tmp_path / "data")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 64 * PAGE)
    try:
        direct = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        direct = -1
    yield path, fd, direct
    os.close(fd)
    if direct >= 0:
        os.close(direct)


def test_crc32c_is_the_castagnoli_crc():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(b"") == 0 and crc32c(b"a", 7) != crc32c(b"a")
    data = os.urandom(10_000)
    assert crc32c(data[5000:], crc32c(data[:5000])) == crc32c(data)  # it chains


def test_page_sums_match_one_crc_per_page(arena):
    _, buf, base = arena
    offsets = np.array([0, 3 * PAGE, 7 * PAGE + 13], np.int64)
    seeds = np.array([1, 2, 3], np.uint32)
    out = np.zeros(3, np.uint32)
    page_sums(base, offsets.ctypes.data, 3, PAGE, seeds.ctypes.data, out.ctypes.data)
    want = [crc32c(buf[o : o + PAGE].tobytes(), s) for o, s in zip(offsets, seeds, strict=True)]
    assert out.tolist() == want


def test_seeds_differ_by_key_and_by_part():
    words = np.array([[1, 5, 0, 0], [1, 5, 0, 0], [2, 5, 0, 0], [1, 5, 0, 9], [1, 5, 9, 0]], np.uint64)
    lens = np.array([16, 15, 16, 32, 32], np.uint8)
    a, b = io.seeds(words, lens, 0), io.seeds(words, lens, 1)
    assert len(set(a.tolist())) == 5 and (a != b).all()


@pytest.mark.parametrize("direct", [True, False])
def test_pages_go_out_and_come_back_whole_in_runs(arena, data_file, direct):
    _, buf, base = arena
    _, fd, dfd = data_file
    if direct and dfd < 0:
        pytest.skip("this file system has no direct I/O")
    host = np.array([0, 1, 2, 10, 11, 30], np.int64) * PAGE  # runs of 3, 2 and 1 pages
    disk = np.array([4, 5, 6, 20, 21, 0], np.int64) * PAGE
    seed = np.arange(6, dtype=np.uint32)
    want = [buf[h : h + PAGE].copy() for h in host.tolist()]
    ok, checks = io.write_pages(fd, dfd if direct else -1, base, host, disk, PAGE, seed)
    assert ok.all() and len(io._runs(disk, host, PAGE)[1]) == 3
    back = np.array([40, 41, 42, 50, 51, 60], np.int64) * PAGE  # elsewhere in the arena
    got, bad = io.read_pages(fd, dfd if direct else -1, base, back, disk, PAGE, seed, checks)
    assert got.all() and bad == 0
    for h, w in zip(back.tolist(), want, strict=True):
        assert np.array_equal(buf[h : h + PAGE], w)


def test_a_changed_page_a_page_at_another_key_and_a_short_file_are_caught(arena, data_file):
    _, buf, base = arena
    path, fd, dfd = data_file
    host = np.arange(4, dtype=np.int64) * PAGE
    disk = np.arange(4, dtype=np.int64) * PAGE
    seed = np.array([11, 12, 13, 14], np.uint32)
    ok, checks = io.write_pages(fd, dfd, base, host, disk, PAGE, seed)
    assert ok.all()
    os.pwrite(fd, b"\x00\x01", 1 * PAGE + 100)  # another process changes page 1
    os.fsync(fd)
    back = np.arange(20, 24, dtype=np.int64) * PAGE
    got, bad = io.read_pages(fd, dfd, base, back, disk, PAGE, seed, checks)
    assert got.tolist() == [True, False, True, True] and bad == 1
    # Page 2's bytes read as page 3's key (a record pointing at another page): its check fails.
    got, bad = io.read_pages(fd, dfd, base, back[2:3], disk[3:4], PAGE, seed[2:3], checks[2:3])
    assert not got.any() and bad == 1
    os.ftruncate(fd, 2 * PAGE + 100)  # cut inside page 2
    got, bad = io.read_pages(fd, -1, base, back, disk, PAGE, seed, checks)
    assert got.tolist() == [True, False, False, False] and bad == 1  # 2 and 3 short: read errors


def test_a_write_that_fails_reports_its_pages_not_written(arena, tmp_path):
    _, _, base = arena
    fd = os.open(str(tmp_path / "ro"), os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        ok, _ = io.write_pages(fd, -1, base, np.array([0, PAGE], np.int64), np.array([0, PAGE], np.int64),
                               PAGE, np.zeros(2, np.uint32))
        assert not ok.any()
    finally:
        os.close(fd)
