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
    _checkpoint(ckpt, {"config.json": b"{}", "model.safetensors": b"x" * 100_000, "README.md": b"readme"})
    first = weights_identity(ckpt)
    assert first.startswith("files=") and weights_identity(ckpt) == first  # stable
    _checkpoint(ckpt, {"README.md": b"other"})  # not a weight or config file: the same weights
    _checkpoint(str(tmp_path / "model" / "checkpoint-10"), {"optimizer.pt": b"o"})  # a trainer's
    st = os.stat(os.path.join(ckpt, "model.safetensors"))
    os.utime(os.path.join(ckpt, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert weights_identity(ckpt) == first  # touched, not changed
    copy = str(tmp_path / "copy")
    _checkpoint(copy, {"config.json": b"{}", "model.safetensors": b"x" * 100_000})
    assert weights_identity(copy) == first  # a copy of the same checkpoint shares
    _checkpoint(ckpt, {"model.safetensors": b"x" * 50_000 + b"y" + b"x" * 49_999})  # rewritten in place
    rewritten = weights_identity(ckpt)
    assert rewritten not in (first, "")
    _checkpoint(ckpt, {"model-00002.safetensors": b"z"})
    assert weights_identity(ckpt) not in (first, rewritten)
    assert weights_identity(ckpt, quantization="fp8").endswith(";quant=fp8")
    assert weights_identity(ckpt, load_format="LoadFormat.DUMMY").endswith(";load=dummy")
    gguf = str(tmp_path / "model.gguf")
    _checkpoint(str(tmp_path), {"model.gguf": b"g" * 10_000})
    single = weights_identity(gguf)
    _checkpoint(str(tmp_path), {"model.gguf": b"h" * 10_000})
    assert single.startswith("files=") and weights_identity(gguf) != single


def test_a_hub_model_is_named_by_its_cached_snapshots_commit(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    _checkpoint(str(repo / "snapshots" / commit), {"config.json": b"{}"})
    _checkpoint(str(repo / "refs"), {"main": commit.encode()})
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert weights_identity("org/tiny", cache_dir=str(tmp_path)) == f"hub=org/tiny@{commit}"  # download dir
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    assert weights_identity("org/tiny") == f"hub=org/tiny@{commit}"
    assert weights_identity("org/uncached", revision="v2") == "hub=org/uncached@v2"
    assert weights_identity("org/uncached") == "path=org/uncached"  # nothing more known: a warning


def test_an_operators_name_wins_and_every_identity_fits_the_daemons_bound(tmp_path):
    assert weights_identity(str(tmp_path), "v1", "fp8", override="step-1200") == "step-1200"
    long = weights_identity("org/x", override="w" * 1000)
    assert len(long) <= MAX_WEIGHTS and long.startswith("sha256=")


def test_sglangs_identity_is_read_from_its_model_settings(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace

    from kvclient.sglang._common import sglang_weights

    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", None)  # no runtime settings here
    ckpt = str(tmp_path / "model")
    _checkpoint(ckpt, {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    args = SimpleNamespace(model_path=ckpt, revision=None, quantization="fp8", download_dir=None,
                           load_format="auto")
    assert sglang_weights({}, args) == weights_identity(ckpt, quantization="fp8")
    assert sglang_weights({"weights": "v7"}, args) == "v7"
    assert sglang_weights({}, None) == ""  # nothing to read: a warning


def test_the_daemon_echoes_the_identity_and_a_client_warns_when_one_does_not(daemon, caplog):
    import logging

    from kvclient.core import ClientCore
    from kvserver.v1 import kvserver_pb2 as pb

    with ShmKVPool(LAYOUT, DTYPE, LAYERS, 64) as pool, KVClient(daemon.address) as a, \
            caplog.at_level(logging.WARNING, logger="kvclient"):
        register(a, pool, "rev=echo")
        assert a._core.request.weights == "rev=echo"
        assert "did not keep" not in caplog.text  # this daemon keeps it
        # An answer without it, as a daemon older than the field gives:
        core = ClientCore("/nowhere.sock", timeout=1.0, token=None, resilient=True)
        req = core.register_request(model="weights-model", pool=pool, start_layer=0, end_layer=LAYERS,
                                    num_layers=LAYERS, host_tokens=0, page_size=PAGE, tp_rank=0, tp_size=1,
                                    pp_rank=0, pp_size=1, weights="rev=echo")
        core.registered(pb.RegisterResponse(client_id="cid-x", page_size=PAGE), req, pool)
        assert "did not keep this engine's weights identity 'rev=echo'" in caplog.text
