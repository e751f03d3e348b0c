"""An engine that uses only the node-wide cache registers with no host region of its own."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvclient.keys import page_keys

PAGE = 16


def test_host_tokens_zero_registers_for_the_cache_only(daemon):
    with ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, 2, 8 * PAGE) as pool, \
            KVClient(daemon.address, resilient=False) as client:
        reg = client.register(model="cache-only", pool=pool, start_layer=0, end_layer=2, num_layers=2,
                              host_tokens=0, page_size=PAGE)
        assert reg.host_tokens == 0
        stats = client.stats(all_clients=True)
        assert stats.reserved_bytes == 0 and stats.num_clients == 1
        with pytest.raises(KVClientError) as err:
            client.alloc(PAGE)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        keys = page_keys(range(3 * PAGE), PAGE)
        assert client.put(keys, [0, 1, 2]).stored == 3
        assert client.lookup(keys).pages == 3
        client.unregister()
        after = client.stats(all_clients=True)
        assert after.num_clients == 0 and after.reserved_bytes == after.cache_bytes > 0
