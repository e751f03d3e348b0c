"""The disk tier's write and read GB/s against plain O_DIRECT I/O of the same bytes, in one run.

In-process, on the daemon's own KVCore with --disk-cache in ``--dir``: host pages of ``--page-mib``
(real bytes) are written behind to disk as Puts' pages are (``DiskTier.demote``, 8 pages a Put,
as fast as the write queue takes them), timed until the last is on disk with its check; then host
memory is emptied and the pages are read back as Gets read them (``CacheOps._promote``, 64 pages a
Get, one after the other), timed until the last is in host memory and checked. The baseline, on
the same file system in the same run: one thread writing, then reading, the same bytes from and to
the same host memory with plain O_DIRECT ``pwrite`` / ``pread`` of one page each, no check. The
ratio is tier GB/s / plain GB/s; rounds alternate which goes first.

Run: python benchmarks/bench_disk.py [--gib 1] [--page-mib 2] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from kvserver.core.cache_ops import CacheOps
from kvserver.core.kvcore import KVCore
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys
from kvserver.store.spaces import PartKey, SpaceKey

MiB, GiB = 1 << 20, 1 << 30
LAYOUT = KVLayout.mha(8, 128)
PUT_PAGES, GET_PAGES = 8, 64

_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("pread", "pwrite"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    _fn.restype = ctypes.c_ssize_t


def plain(path: str, base: int, offsets: list[int], page: int, write: bool) -> float:
    """Seconds to write (or read) every page with O_DIRECT, one call a page, one thread."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        call = _libc.pwrite if write else _libc.pread
        t0 = time.perf_counter()
        for i, off in enumerate(offsets):
            if call(fd, base + off, page, i * page) != page:
                raise OSError(ctypes.get_errno(), "plain O_DIRECT call came short")
        return time.perf_counter() - t0
    finally:
        os.close(fd)


async def tier_write(core: KVCore, part, ids: np.ndarray) -> float:
    disk = core.disk
    before = disk.counters.written_pages
    limit = core.arena.capacity // 4
    page = part.key.page_bytes
    t0 = time.perf_counter()
    for i in range(0, len(ids), PUT_PAGES):
        while disk.queued_bytes + PUT_PAGES * page > limit:
            await asyncio.sleep(0.0002)
        disk.demote(part, ids[i : i + PUT_PAGES])
    while disk.counters.written_pages - before < len(ids):
        await asyncio.sleep(0.0002)
    return time.perf_counter() - t0


async def tier_read(ops: CacheOps, part, keys: Keys) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(keys), GET_PAGES):
        await ops._promote(part, keys[i : i + GET_PAGES], 0.0)
    return time.perf_counter() - t0


async def one_round(args, where: str, order: int) -> tuple[float, float, float, float]:
    page = int(args.page_mib * MiB)
    n = int(args.gib * GiB) // page
    root = tempfile.mkdtemp(prefix="kvserver-bench-disk-", dir=where)
    try:
        core = KVCore(n * page + 64 * MiB, disk_cache=os.path.join(root, "disk"),
                      disk_size=2 * n * page + 64 * MiB, disk_threads=args.threads)
        c = core.cache
        space = SpaceKey(f"uid:{os.getuid()}", "disk-bench", LAYOUT, dtype_named("float16"), 16, 4, 1, 1)
        part = c.part(c.space(space), PartKey(0, 0, 0, 4, page))
        keys = Keys.of([i.to_bytes(8, "little") + b"diskbnch" for i in range(n)])
        plan = c.prepare_put(part, keys)
        arena = core.arena.view(np.uint8)
        rng = np.random.default_rng(0)
        for off in plan.offsets.tolist():
            arena[off : off + page] = rng.integers(0, 256, page, dtype=np.uint8)
        c.complete_put(plan, True)
        ids = c.pages.find(part.gid, keys)
        offsets = c.pages.offset[ids].tolist()
        base = core.arena.address
        ops = CacheOps(core)
        plain_path = os.path.join(root, "plain")
        if order:
            pw = plain(plain_path, base, offsets, page, True)
        tw = await tier_write(core, part, ids)
        if not order:
            pw = plain(plain_path, base, offsets, page, True)
        pr = plain(plain_path, base, offsets, page, False)  # into the same pages: bytes unchanged
        c.make_room(core.arena.capacity)  # host memory emptied: every page is on disk only
        assert c.lookup(part, keys)[0] == 0 and core.disk.holds(part, keys).all()
        tr = await tier_read(ops, part, keys)
        assert core.disk.counters.promoted_pages == n and core.disk.counters.bad_checks == 0
        cc = core.disk.counters
        if os.environ.get("BENCH_DISK_DEBUG"):
            print(f"  threads' write {cc.write_seconds:.3f} s, read {cc.read_seconds:.3f} s; "
                  f"wall {tw:.3f}/{tr:.3f}")
        if order:
            pr = plain(plain_path, base, offsets, page, False)
        await core.close()
        return pw, tw, pr, tr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes written and read per round (GiB)")
    p.add_argument("--page-mib", type=float, default=2.0, help="page size (MiB; 16 tokens of an 8B model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=8, help="the disk tier's worker threads (--disk-threads)")
    p.add_argument("--dir", default="/tmp", help="a directory on the file system to measure")
    args = p.parse_args()
    nbytes = int(args.gib * GiB) // int(args.page_mib * MiB) * int(args.page_mib * MiB)
    rows = []
    for r in range(args.rounds):
        pw, tw, pr, tr = asyncio.run(one_round(args, args.dir, r % 2))
        rows.append((pw, tw, pr, tr))
        print(f"round {r}: write plain {nbytes / pw / 1e9:.2f} GB/s, tier {nbytes / tw / 1e9:.2f} GB/s "
              f"({pw / tw:.2f}x); read plain {nbytes / pr / 1e9:.2f} GB/s, tier {nbytes / tr / 1e9:.2f} GB/s "
              f"({pr / tr:.2f}x)", flush=True)
    w = statistics.median(pw / tw for pw, tw, _, _ in rows)
    rd = statistics.median(pr / tr for _, _, pr, tr in rows)
    print(f"disk tier in {args.dir}, {nbytes / GiB:.2f} GiB in pages of {args.page_mib:g} MiB: "
          f"write {w:.2f}x plain O_DIRECT, read {rd:.2f}x plain O_DIRECT (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
