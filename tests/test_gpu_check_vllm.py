"""scripts/gpu_check_vllm.py, the GPU check's vLLM connector round, run here on CPU views.

The same round runs on a lent GPU with CUDA views; here the views lie in shared memory. It runs
with the vLLM stand-in the GPU machine uses (in a subprocess where vLLM cannot be imported) and
with vLLM's real modules; the stand-in is compared with vLLM 0.33, and the views the script builds
from the stride formulas with the ones vLLM's own create_kv_cache_views builds.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import vllm_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")

needs_vllm = pytest.mark.skipif(not vllm_env.vllm_installed(),
                                reason="vllm not installed (scripts/install_vllm.sh)")


def load_check():
    path = os.path.join(SCRIPTS, "gpu_check_vllm.py")
    spec = importlib.util.spec_from_file_location("gpu_check_vllm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CHECK = load_check()


def _expect_ok(result: dict) -> None:
    assert result["ok"], result
    assert result["saved"] and result["lookup"] == CHECK.BLOCKS and result["exact"] and result["layer_waits"]
    assert result["load_errors_empty"] and result["past_blocks_untouched"]
    assert result["miss_reported"] and result["miss_untouched"]
    assert result["prefix_exact"] and result["prefix_errors_exact"]


def test_the_rounds_with_the_standin_as_the_gpu_machine_runs_them(daemon):
    """No vLLM importable (as on the GPU machine): the stand-in answers, and the real worker
    side passes the round in every (kind, layout) of the check (one subprocess: one torch import)."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.modules["vllm"] = None  # vLLM is installed here, not there
        sys.path.insert(0, {SCRIPTS!r})
        import gpu_check_vllm as check
        results = [check.run({daemon.address!r}, kind, "cpu", layout) for kind, layout in check.CASES]
        assert sys.modules["vllm"].__doc__.startswith("stand-in"), "the stand-in was not used"
        import kvclient.vllm._meta as meta
        assert meta.KVConnectorMetadata.__module__.startswith("vllm."), meta.KVConnectorMetadata
        print(json.dumps(results))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["kind"] for r in results] == [f"vllm-worker-{k}-{lay}" for k, lay in CHECK.CASES]
    for result in results:
        _expect_ok(result)
        # The asynchronous load's round and the decode step (eager on CPU: no figure) ran.
        assert result["async_reported"] and result["async_exact"]
        if result["kind"] == "vllm-worker-{}-{}".format(*CHECK.CASES[0]):
            assert result["decode_step"] == {"graphs": False, "steps": 3}


@pytest.fixture(scope="module")
def real_vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


@needs_vllm
def test_the_round_with_vllms_own_modules(daemon, real_vllm):
    assert CHECK.install_standin() is False  # vLLM itself answers
    result = CHECK.run(daemon.address, "mla", "cpu", "LBHNC")
    _expect_ok(result)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    from kvclient.vllm._meta import KVServerConnectorMetadata

    assert issubclass(KVServerConnectorMetadata, KVConnectorMetadata)


@needs_vllm
def test_the_standin_matches_vllm_0_33(real_vllm):
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as real_base
    from vllm.model_executor.models import utils as real_utils

    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    for name in saved:
        del sys.modules[name]
    try:
        sys.modules["vllm"] = None  # not importable: the stand-in goes in
        assert CHECK.install_standin() is True
        base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
        utils = sys.modules["vllm.model_executor.models.utils"]
        assert vllm_env.VLLM_VERSION == "0.33.0"
        # The base class: empty in both (nothing a subclass would inherit differs).
        assert not [n for n in vars(real_base.KVConnectorMetadata) if not n.startswith("_")]
        assert not [n for n in vars(base.KVConnectorMetadata) if not n.startswith("_")]
        real_w, standin_w = real_base.KVConnectorWorkerMetadata, base.KVConnectorWorkerMetadata
        assert standin_w.__abstractmethods__ == real_w.__abstractmethods__ == frozenset({"aggregate"})
        assert list(inspect.signature(standin_w.aggregate).parameters) == \
            list(inspect.signature(real_w.aggregate).parameters)
        names = ["model.layers.0.self_attn.attn", "model.layers.31.self_attn.attn", "layers.7",
                 "model.layers.12.self_attn.mla_attn", "model.decoder.layers.5.self_attn.attn",
                 "language_model.model.layers.3.self_attn.attn", "2.self_attn", "encoder.layers.1.self_attn",
                 "model.layers.4.mixer.attn", "transformer.h.9.attn.attn", "model.layers.3.attn.1",
                 "model.layers.2.cross_attn.0", "model.layers.6.mlp", "model.encoder.layers.0.sub.1",
                 "model.norm", "a.1.b.2.c.3.attn"]
        for name in names:
            for num in (1, 2, 3):
                answers = []
                for fn in (real_utils.extract_layer_index, utils.extract_layer_index):
                    try:
                        answers.append(("value", fn(name, num)))
                    except AssertionError:
                        answers.append(("assert", None))
                assert answers[0] == answers[1], (name, num, answers)
        assert [utils.extract_layer_index(n) for n in names[:3]] == [0, 31, 7]
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@needs_vllm
@pytest.mark.parametrize("layout", list(CHECK.LAYOUTS))
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_views_are_vllms_own(real_vllm, kind, layout):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert KVCacheLayout[layout].value == CHECK.LAYOUTS[layout]
    g = CHECK.geometry(kind)
    if kind == "mla":
        spec = MLAAttentionSpec(block_size=g["block"], num_kv_heads=1, head_size=576, dtype=torch.uint8)
    else:
        spec = FullAttentionSpec(block_size=g["block"], num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    blocks, layers = 5, 3
    strides = compute_layout_strides(spec, blocks, layers, KVCacheLayout[layout])
    assert strides == CHECK.layout_strides(kind, layout, blocks, layers)
    tensor = KVCacheTensor(size=spec.page_size_bytes * blocks * layers, layers=["l0", "l1", "l2"],
                           layer_stride=strides[0], block_stride=strides[1])
    assert tensor.size == CHECK.raw_bytes(kind, blocks, layers)
    raw = torch.zeros(tensor.size + 64, dtype=torch.int8)[64:]  # a raw buffer not at its storage's start
    theirs = create_kv_cache_views(raw, spec, blocks, KVCacheLayout[layout], tensor)
    ours = CHECK.views(raw, kind, layout, blocks, layers)
    assert len(ours) == len(theirs) == layers
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype, a.data_ptr()) == \
            (b.shape, b.stride(), b.storage_offset(), b.dtype, b.data_ptr())


def test_the_sync_watch_collects_torchs_sync_warnings_and_restores_the_mode(monkeypatch):
    """The CUDA-only guard of the stream-ordered sections, with torch's sync debug mode stubbed
    (this torch has no CUDA): torch's warnings are collected, others not, the mode is put back."""
    import warnings

    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: modes.append(mode))
    found: list[str] = []
    with CHECK._sync_watch(True, found):
        assert modes[-1] == "warn"
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert found == ["called a synchronizing CUDA operation"] and modes[-1] == 0
    with CHECK._sync_watch(False, found):  # CPU: nothing to watch
        pass
    assert modes == [0, "warn", 0]
