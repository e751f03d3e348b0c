"""SGLang's HiCache storage backend (``kvclient.sglang.storage.KVServerStorage``) against a bare
in-process copy of the same bytes, measured in the same run.

Two backends are built as SGLang's cache controller builds them (its own storage config, its
factory, its host pools: SGLang 0.5.23's code with the test stand-ins of tests/sglang_env.py, since
SGLang cannot import on a CPU without them) over one daemon subprocess. Each round engine A stores
--pages fresh pages from its host pool (``batch_set_v1``) and engine B loads them into its own
(``batch_get_v1``). The baselines, in this process: the same pages copied out of A's host pool into
a private buffer and from there into B's (what an in-process store would cost: two copies, done as
the backend does them), and the backend's own staging gather and scatter alone (its two copies
besides the daemon's: the host pool is the engine's private memory, the daemon maps only the
sealed staging pool). The cache is filled first, so timed Puts evict and reuse memory the daemon
has touched. Rounds are interleaved; figures are medians.

Run: python benchmarks/bench_sglang_storage.py [--pages 128] [--layers 32] [--layout page_first]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import sglang_env  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402

from kvserver.config import parse_size  # noqa: E402

PAGE, HEADS, DIM = 16, 8, 128


def backend(address: str, args):
    """One engine's host pool and backend, constructed in the cache controller's order."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.runtime_context import get_parallel

    dev = sglang_env.mha_pool(layer_num=args.layers, size=args.pages * PAGE, page_size=PAGE,
                              head_num=HEADS, head_dim=DIM)
    host = sglang_env.host_pool(dev, layout=args.layout, ratio=2.1)
    controller = types.SimpleNamespace(mem_pool_device=dev, mem_pool_host=host, storage_host_pool=host,
                                       enable_storage_metrics=False,
                                       get_attn_cp_rank_and_size=lambda: (0, 1))
    extra = {"backend_name": "kvserver", "module_path": "kvclient.sglang.storage",
             "class_name": "KVServerStorage", "interface_v1": 1, "address": address, "timeout_s": 60.0,
             "staging_pages": args.pages}
    ranks = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_dcp_size": 1, "attn_dcp_rank": 0}
    with get_parallel().override(**ranks):
        config = HiCacheController._generate_storage_config(controller, "bench-sglang-storage", extra)
    store = StorageBackendFactory.create_backend("dynamic", config, host)
    store.register_mem_pool_host(host)
    store.on_host_pools_registered()
    return store, host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per call (SGLang's batch is 128)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layout", default="page_first",
                    choices=["layer_first", "page_first", "page_first_direct"])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--host-memory", default="1GiB",
                    help="the daemon's budget; the cache is filled before the timed rounds")
    args = ap.parse_args()

    sglang_env.setup()
    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tmp = tempfile.mkdtemp(prefix="kvbench-")
    daemon = DaemonProcess(os.path.join(tmp, "kv.sock"), host_memory=args.host_memory)
    a, host_a = backend(daemon.address, args)
    b, host_b = backend(daemon.address, args)
    try:
        host_a.kv_buffer.view(torch.uint8).random_(0, 255)
        src = torch.arange(1, args.pages + 1)
        dst = torch.arange(args.pages + 1, 2 * args.pages + 1)
        slots_src = (src[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        slots_dst = (dst[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        page_bytes = PAGE * HEADS * DIM * 2 * args.layers * 2  # bf16, K and V
        total = args.pages * page_bytes
        round_no = [0]

        def through_daemon() -> None:
            round_no[0] += 1
            base = round_no[0] * 10**7
            keys = get_storage_hash_str(list(range(base, base + args.pages * PAGE)), None, page_size=PAGE)
            assert a.batch_set_v1(keys, slots_src) == [True] * args.pages
            assert b.batch_get_v1(keys, slots_dst) == [True] * args.pages

        view_a, view_b = a._host_view, b._host_view
        spare = torch.empty(a.staging.view.shape, dtype=view_a.dtype)  # private memory, staging's shape

        def in_process() -> None:  # out and back in, host to host, no daemon, the staging's copies
            torch.index_select(view_a, 2, src, out=spare)
            view_b.movedim(2, 0).index_copy_(0, dst, spare.movedim(2, 0))

        def staging_only() -> None:
            a.staging.gather(view_a, src)
            b.staging.scatter(view_b, dst)

        fns = {"set+get": through_daemon, "in-process copy": in_process, "staging copies": staging_only}
        for fn in fns.values():
            fn()
        # Fill the cache first, so that timed rounds evict and reuse memory the daemon has touched
        # (a fresh arena's first touch is page faults, not the copy).
        for _ in range(parse_size(args.host_memory) // total + 1):
            through_daemon()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        through_daemon()
        assert torch.equal(view_a[:, :, src].view(torch.uint8), view_b[:, :, dst].view(torch.uint8))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"layout {args.layout}: {args.pages} pages of {page_bytes / 2**20:.1f} MiB = "
              f"{total / 2**20:.0f} MiB per call, medians of {args.repeats}")
        for name, t in med.items():
            print(f"  {name:18s} {t * 1e3:8.1f} ms  {total / t / 1e9:6.2f} GB/s")
        print(f"  set+get / in-process copy: {med['set+get'] / med['in-process copy']:.2f}x the time; "
              f"the staging copies are {med['staging copies'] / med['set+get'] * 100:.0f}% of set+get")
    finally:
        a.close()
        b.close()
        daemon.stop()
        sglang_env.restore()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
