"""The weights' identity in the KV space (``KVSpace.weights``, ``kvclient.weights``): engines of
one model name and other weights never share a page; the identity an adapter reads from a local
checkpoint, a cached hub snapshot, a revision and the quantisation."""

from __future__ import annotations

import os

import pytest
import torch

from kvclient import CacheView, KVClient, KVLayout, ShmKVPool
from kvclient.keys import page_keys
from kvclient.weights import MAX_WEIGHTS, weights_identity
from tests.test_e2e_roundtrip import fill_random

LAYOUT, DTYPE, PAGE, LAYERS = KVLayout.mha(2, 8), torch.float16, 16, 4


def register(client, pool, weights: str):
    return client.register(model="weights-model", pool=pool, start_layer=0, end_layer=LAYERS,
                           num_layers=LAYERS, host_tokens=0, page_size=PAGE, weights=weights)


def test_engines_of_other_weights_never_share_a_page(daemon):
    keys = page_keys(range(500, 500 + 4 * PAGE), PAGE)
    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 128) as pa, ShmKVPool(LAYOUT, DTYPE, LAYERS, 128) as pb_, \
            ShmKVPool(LAYOUT, DTYPE, LAYERS, 128) as pc, KVClient(daemon.address) as a, \
            KVClient(daemon.address) as b, KVClient(daemon.address) as c:
        register(a, pa, "rev=1111")
        register(b, pb_, "rev=2222")
        register(c, pc, "rev=1111")
        fill_random(pa, 1)
        assert a.put(keys, [0, 1, 2, 3]).stored == 4
        assert b.lookup(keys).pages == 0 and b.get(keys, [0, 1, 2, 3]).pages() == 0
        assert b.put(keys, [4, 5, 6, 7]).stored == 4  # its own pages, not "present"
        assert c.lookup(keys).pages == 4  # the same weights share
        stats = {s.space.weights: s for s in a.stats().spaces if s.space.model == "weights-model"}
        assert set(stats) == {"rev=1111", "rev=2222"}
        assert stats["rev=1111"].complete_pages == stats["rev=2222"].complete_pages == 4
        for weights, found in (("rev=1111", 4), ("rev=3333", 0), ("", 0)):
            with CacheView(daemon.address, model="weights-model", layout=LAYOUT, dtype=DTYPE, page_size=PAGE,
                           num_layers=LAYERS, weights=weights) as view:
                assert view.lookup(keys).pages == found, weights


def _checkpoint(path, files: dict[str, bytes]) -> None:
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


def test_a_local_checkpoint_is_named_by_its_files(tmp_path):
    ckpt = str(tmp_path / "model")
    _checkpoint(ckpt, {"config.json": b"{}", "model.safetensors": b"x" * 100, "README.md": b"readme"})
    first = weights_identity(ckpt)
    assert first.startswith("files=") and weights_identity(ckpt) == first  # stable
    with open(os.path.join(ckpt, "README.md"), "ab") as f:
        f.write(b"more")  # not a weight or config file: same weights
    assert weights_identity(ckpt) == first
    st = os.stat(os.path.join(ckpt, "model.safetensors"))
    os.utime(os.path.join(ckpt, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    rewritten = weights_identity(ckpt)  # the weights replaced in place
    assert rewritten != first
    _checkpoint(ckpt, {"model-00002.safetensors": b"y"})
    assert weights_identity(ckpt) not in (first, rewritten)
    assert weights_identity(ckpt, quantization="fp8").endswith(";quant=fp8")


def test_a_hub_model_is_named_by_its_cached_snapshots_commit(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    _checkpoint(str(repo / "snapshots" / commit), {"config.json": b"{}"})
    _checkpoint(str(repo / "refs"), {"main": commit.encode()})
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    assert weights_identity("org/tiny") == f"commit={commit}"
    assert weights_identity("org/uncached", revision="v2") == "revision=v2"
    assert weights_identity("org/uncached") == ""  # nothing known: said in a warning


def test_an_operators_name_wins_and_every_identity_fits_the_daemons_bound(tmp_path):
    assert weights_identity(str(tmp_path), "v1", "fp8", override="step-1200") == "step-1200"
    long = weights_identity("org/x", override="w" * 1000)
    assert len(long) <= MAX_WEIGHTS and long.startswith("sha256=")
