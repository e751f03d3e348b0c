"""Releasing a large host region: how long the event loop every engine shares is held.

An in-process daemon registers one engine with a region of --gib GiB and fills it (every page
populated, as a busy engine leaves it); a ticker on the daemon's loop measures its lateness while
the engine unregisters. The baseline, in the same run, is the same region given back to the kernel
on the loop itself (MADV_DONTNEED, as a release did before it moved to a worker thread). Prints the
loop's longest lag for each, the release's own time, and the ratio.

Run: python benchmarks/bench_release.py [--gib 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from conftest import DaemonThread  # noqa: E402
from loop_lag import lag_during  # noqa: E402

from kvclient import KVClient, KVLayout, ShmKVPool  # noqa: E402
from kvserver.config import ServerConfig  # noqa: E402

GiB = 1 << 30
LAYOUT = KVLayout.mha(8, 128)  # 8 KiB a token over 2 layers, fp16
TOKEN_BYTES = LAYOUT.token_bytes(torch.float16) * LAYOUT.num_parts * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="the region's size")
    args = ap.parse_args()
    nbytes = int(args.gib * GiB)
    with tempfile.TemporaryDirectory() as tmp:
        d = DaemonThread(ServerConfig(socket=os.path.join(tmp, "kv.sock"), host_memory=nbytes + GiB))
        try:
            arena = d.core.arena
            with ShmKVPool(LAYOUT, torch.float16, num_layers=2, num_tokens=1024) as pool, \
                    KVClient(d.address, resilient=False) as c:
                reg = c.register(model="m", pool=pool, start_layer=0, end_layer=2, num_layers=2,
                                 host_tokens=nbytes // TOKEN_BYTES, page_size=16)
                client = d.run(lambda: d.core.clients[reg.client_id])
                offset, size = client.region_offset, client.region_bytes
                arena.view(np.uint8)[offset: offset + size].fill(1)
                off_loop, took = d.call(lag_during(lambda: d.core.unregister(reg.client_id)))
                c.close()
            # The baseline: the same region, populated again, given back on the loop.
            offset = d.run(arena.reserve, size)
            arena.view(np.uint8)[offset: offset + size].fill(1)

            async def on_loop() -> None:
                arena.release(offset, size)

            on, base_took = d.call(lag_during(on_loop))
        finally:
            d.stop()
    print(f"release of a populated {size / GiB:.2f} GiB region")
    print(f"  in a worker (Unregister): the loop's longest lag {off_loop * 1e3:.1f} ms "
          f"(the Unregister took {took * 1e3:.0f} ms)")
    print(f"  on the loop (baseline):   the loop's longest lag {on * 1e3:.1f} ms "
          f"(the release took {base_took * 1e3:.0f} ms)")
    print(f"  lag ratio worker / loop: {off_loop / on:.3f}")


if __name__ == "__main__":
    main()
