"""Moving pages between the host arena and the disk tier's file, and checking them.

A batch of pages is moved in runs: pages whose file offsets and host offsets both follow on are one
``pwrite`` or ``pread`` (up to ``MAX_RUN`` bytes), so a slab's worth of small pages costs a few
calls. Where the file system does direct I/O and a page is whole blocks (its size and offsets
multiples of ``BLOCK``, as every host page of 4 KiB multiples is), the call bypasses the page cache:
one copy, straight between the arena and the device. Anything else goes through the page cache.

Every page carries a check, its CRC-32C started from a seed made of its key and its part's identity
(``seeds``; ``keep.part_identity``: what the part is, not the number it is filed under): written
beside the page's record before the page counts as stored, and compared after every read. A page
whose bytes are not those its record promises (a write torn by a crash of the machine, a file
truncated or changed by another process, a device error) is never served.

Calls here block: the tier runs them in its worker threads (ctypes lets go of the GIL).

Primitives: ``seeds``, ``write_pages``, ``read_pages``.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from kvserver.errors import Unimplemented
from kvserver.protocol import compiled

# The copy kernel's page checksums; None where it is not built (or built from other sources): the
# disk tier is refused at start.
_kvcopy = compiled.extension("kvserver.copies._kvcopy")
page_sums = None if _kvcopy is None else _kvcopy.page_sums

BLOCK = 4096  # direct I/O's alignment: offsets, sizes and addresses in whole blocks
MAX_RUN = 16 << 20  # bytes of one call, at most

_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("pread", "pwrite"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    _fn.restype = ctypes.c_ssize_t


def seeds(words: np.ndarray, lens: np.ndarray, part: int) -> np.ndarray:
    """Each page's check seed: its key (its words, (n, 4), and its length) and its part's identity
    (``keep.part_identity``, 64 bits), mixed."""
    with np.errstate(over="ignore"):
        w = words.astype(np.uint64)
        h = (w[:, 0] * np.uint64(0x9E3779B97F4A7C15)) ^ w[:, 1]
        h = (h * np.uint64(0x9E3779B97F4A7C15)) ^ w[:, 2]
        h = (h * np.uint64(0x9E3779B97F4A7C15)) ^ w[:, 3]
        h ^= (lens.astype(np.uint64) << np.uint64(56)) ^ (np.uint64(part) * np.uint64(0xC2B2AE3D27D4EB4F))
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    return (h & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def sums(base: int, offsets: np.ndarray, nbytes: int, seed: np.ndarray) -> np.ndarray:
    """The check of each page of ``nbytes`` at ``base + offsets``."""
    if page_sums is None:
        raise Unimplemented("the disk tier needs kvserver's compiled copy kernel (_kvcopy)")
    offsets = np.ascontiguousarray(offsets, np.int64)
    seed = np.ascontiguousarray(seed, np.uint32)
    out = np.empty(len(offsets), np.uint32)
    page_sums(base, offsets.ctypes.data, len(offsets), nbytes, seed.ctypes.data, out.ctypes.data)
    return out


def _runs(disk: np.ndarray, host: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Order of the pages by file offset, and where each run starts in that order."""
    order = np.argsort(disk, kind="stable")
    d, h = disk[order], host[order]
    brk = np.ones(len(d), bool)
    if len(d) > 1:
        brk[1:] = (d[1:] != d[:-1] + nbytes) | (h[1:] != h[:-1] + nbytes)
    starts = np.flatnonzero(brk)
    per_run = max(1, MAX_RUN // nbytes)  # long runs cut every per_run pages
    if len(starts):
        ends = np.append(starts[1:], len(d))
        starts = np.concatenate([np.arange(s, e, per_run) for s, e in zip(starts.tolist(), ends.tolist(),
                                                                          strict=True)])
    return order, starts


def _move(call, fd: int, address: int, size: int, offset: int) -> None:
    """The whole of one pread or pwrite, or OSError (a short read past the end is EIO)."""
    done = 0
    while done < size:
        got = call(fd, address + done, size - done, offset + done)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(errno.EIO, f"the disk cache's file ends before byte {offset + size}")
        done += got


def _each_run(write: bool, fd: int, direct_fd: int, base: int, host: np.ndarray, disk: np.ndarray,
              nbytes: int) -> np.ndarray:
    """Moves the pages run by run (a run that fails, page by page); the mask of those moved."""
    ok = np.zeros(len(host), bool)
    if not len(host):
        return ok
    order, starts = _runs(disk, host, nbytes)
    ends = np.append(starts[1:], len(order))
    call = _libc.pwrite if write else _libc.pread
    aligned = nbytes % BLOCK == 0 and base % BLOCK == 0
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        first = order[s]
        h, d = int(host[first]), int(disk[first])
        use = direct_fd if direct_fd >= 0 and aligned and h % BLOCK == 0 and d % BLOCK == 0 else fd
        try:
            try:
                _move(call, use, base + h, (e - s) * nbytes, d)
            except OSError as exc:  # a file system whose direct I/O wants another alignment
                if use == fd or exc.errno != errno.EINVAL:
                    raise
                use = fd
                _move(call, use, base + h, (e - s) * nbytes, d)
            ok[order[s:e]] = True
        except OSError:  # page by page: only the pages that fail are lost
            for i in order[s:e].tolist() if e - s > 1 else ():
                try:
                    _move(call, use, base + int(host[i]), nbytes, int(disk[i]))
                    ok[i] = True
                except OSError:
                    pass
    return ok


def write_pages(fd: int, direct_fd: int, base: int, host: np.ndarray, disk: np.ndarray, nbytes: int,
                seed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Writes pages of ``nbytes`` at host arena ``base + host`` to file offsets ``disk``: (mask of
    those written, their checks)."""
    checks = sums(base, host, nbytes, seed)
    return _each_run(True, fd, direct_fd, base, host, disk, nbytes), checks


def read_pages(fd: int, direct_fd: int, base: int, host: np.ndarray, disk: np.ndarray, nbytes: int,
               seed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, int]:
    """Reads pages from file offsets ``disk`` into host arena ``base + host``: (mask of those read
    whole whose check matches ``expected``, how many were read but failed their check)."""
    ok = _each_run(False, fd, direct_fd, base, host, disk, nbytes)
    good = ok.copy()
    if ok.any():
        got = sums(base, host[ok], nbytes, seed[ok])
        good[np.flatnonzero(ok)] = got == expected[ok]
    return good, int(np.count_nonzero(ok & ~good))
