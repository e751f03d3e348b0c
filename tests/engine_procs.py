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
