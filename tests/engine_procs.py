"""Engine-side process bodies for tests; importable by multiprocessing's spawn start method."""

from __future__ import annotations

import traceback

import grpc
import torch

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool


def pipeline_stage(address: str, start: int, end: int, num_layers: int, seed: int, out) -> None:
    """One PP stage: write and load its own layers; an id outside its range must be refused."""
    try:
        result = {"range": (start, end)}
        layout = KVLayout.mha(4, 16)
        with ShmKVPool(layout, torch.bfloat16, end - start, 1024) as pool, KVClient(address) as client:
            g = torch.Generator().manual_seed(seed)
            for layer in pool.buffers:
                for buf in layer:
                    buf.copy_(torch.randn(buf.shape, generator=g))
            original = [[b.clone() for b in layer] for layer in pool.buffers]
            client.register(model="pp-model", pool=pool, start_layer=start, end_layer=end,
                            num_layers=num_layers, host_tokens=512, page_size=16,
                            pp_rank=start // (end - start), pp_size=num_layers // (end - start))
            host = client.alloc(256)
            dev = (torch.randperm(64, generator=g)[:16][:, None] * 16 + torch.arange(16)).reshape(-1)
            client.write(host_indices=host, device_indices=dev)
            for layer in pool.buffers:
                for buf in layer:
                    buf.zero_()
            handle = client.load(host_indices=host, device_indices=dev)
            for layer in range(start, end):
                handle.wait_layer(layer)
            handle.wait()
            result["exact"] = all(
                torch.equal(pool.buffers[i][p][dev], original[i][p][dev])
                for i in range(end - start) for p in range(2)
            )
            outside = end if end < num_layers else start - 1
            errors = []
            for call in ("write", "load"):
                try:
                    if call == "write":
                        client.write(host_indices=host, device_indices=dev, layers=[outside])
                    else:
                        client.load(host_indices=host, device_indices=dev, layers=[outside]).wait()
                except KVClientError as exc:
                    errors.append((exc.code == grpc.StatusCode.OUT_OF_RANGE, exc.message))
            result["errors"] = errors
            result["stats"] = (client.stats().clients[0].start_layer, client.stats().clients[0].end_layer)
            client.unregister()
        out.put(result)
    except BaseException:
        out.put({"range": (start, end), "traceback": traceback.format_exc()})


def resilient_engine(address: str, idx: int, stop, counters, out) -> None:
    """Writes and loads in a loop through a daemon that may die and come back.

    counters[3*idx:3*idx+3] = hits, misses, reconnects (read by the parent while it runs).
    A hit is checked against the bytes written; a set of pages written once at the start is
    loaded every round too, and must never come back after the daemon lost it."""
    import time

    import numpy as np

    result = {"idx": idx, "mismatches": 0, "stale_hits": 0, "max_call_s": 0.0}
    try:
        rng = np.random.default_rng(idx)
        layout = KVLayout.mha(2, 32)
        with ShmKVPool(layout, torch.float16, 4, 512) as pool, KVClient(address, timeout=2.0) as client:
            raw = [[b.view(torch.uint8) for b in layer] for layer in pool.buffers]

            def fill(dev):
                for layer in raw:
                    for b in layer:
                        b[dev] = torch.from_numpy(rng.integers(0, 256, tuple(b[dev].shape), dtype=np.uint8))

            def snap(dev):
                return [b[dev].clone() for layer in raw for b in layer]

            def wipe(dev):
                for layer in raw:
                    for b in layer:
                        b[dev] = 0

            client.register(model="restart", pool=pool, start_layer=0, end_layer=4, num_layers=4,
                            host_tokens=512, page_size=16)
            cached_dev = torch.arange(0, 64)
            fill(cached_dev)
            cached = snap(cached_dev)
            cached_host = client.alloc(64)
            assert client.write(host_indices=cached_host, device_indices=cached_dev) > 0
            epoch0 = client.registration.epoch
            while not stop.is_set():
                dev = (torch.from_numpy(rng.permutation(np.arange(4, 32))[:4])[:, None] * 16
                       + torch.arange(16)).reshape(-1)
                fill(dev)
                want = snap(dev)
                t0 = time.monotonic()
                host = client.alloc(64)
                ok = host is not None and client.write(host_indices=host, device_indices=dev) > 0
                if ok:
                    wipe(dev)
                    ok = client.load(host_indices=host, device_indices=dev).wait() > 0
                    if ok and any(not torch.equal(a, b) for a, b in zip(snap(dev), want, strict=True)):
                        result["mismatches"] += 1
                    client.free(host)
                # The pages written at the start: a hit must be exact; after a restart, a miss.
                wipe(cached_dev)
                if client.load(host_indices=cached_host, device_indices=cached_dev).wait() > 0:
                    if client.registration.epoch != epoch0:
                        result["stale_hits"] += 1
                    elif any(not torch.equal(a, b) for a, b in zip(snap(cached_dev), cached, strict=True)):
                        result["mismatches"] += 1
                result["max_call_s"] = max(result["max_call_s"], time.monotonic() - t0)
                counters[3 * idx + (0 if ok else 1)] += 1
                counters[3 * idx + 2] = client.reconnects
                if not ok:
                    time.sleep(0.01)
            result["misses"] = client.misses
            client.unregister()
        out.put(result)
    except BaseException:
        result["traceback"] = traceback.format_exc()
        out.put(result)
