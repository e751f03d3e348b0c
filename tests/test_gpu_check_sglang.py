"""scripts/gpu_check_sglang.py, the GPU check's SGLang linker round, run here on CPU pools.

The same round runs on a lent GPU with CUDA tensors; here it runs with the pools in shared memory,
both with the SGLang stand-in that the GPU machine uses (in a subprocess where SGLang cannot be
imported) and with SGLang's real classes, and the stand-in is compared with those classes so it
cannot drift from what the linker sees in SGLang.
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
import sglang_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")

needs_sglang = pytest.mark.skipif(not sglang_env.sglang_installed(),
                                  reason="sglang not installed (scripts/install_sglang.sh)")


def load_check():
    path = os.path.join(SCRIPTS, "gpu_check_sglang.py")
    spec = importlib.util.spec_from_file_location("gpu_check_sglang", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _expect_ok(result: dict) -> None:
    assert result["ok"], result
    assert result["lookup"] == 48 and result["exact"] and result["finished"]
    assert result["miss_reported"] and result["miss_untouched"] and result["past_slots_untouched"]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_round_with_the_standin_as_the_gpu_machine_runs_it(daemon, kind):
    """No SGLang importable (its triton import fails here, as SGLang is absent there): the
    stand-in answers, and the real linker passes the round."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {SCRIPTS!r})
        import gpu_check_sglang as check
        result = check.run({daemon.address!r}, {kind!r}, "cpu")
        assert sys.modules["sglang"].__doc__.startswith("stand-in"), "the stand-in was not used"
        print(json.dumps(result))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _expect_ok(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture
def real_sglang():
    sglang_env.setup()
    yield
    sglang_env.restore()


@needs_sglang
def test_the_round_with_sglangs_own_classes(daemon, real_sglang):
    check = load_check()
    assert check.install_standin() is False  # SGLang itself answers
    _expect_ok(check.run(daemon.address, "mha", "cpu"))


@needs_sglang
def test_the_standin_matches_sglang_0_5_23(real_sglang):
    from sglang.srt.mem_cache import hicache_storage as real_storage
    from sglang.srt.mem_cache.unified_cache import components as real_components
    from sglang.srt.mem_cache.unified_cache import unified_cache_linker as real_linker

    saved = {n: m for n, m in sys.modules.items() if n == "sglang" or n.startswith("sglang.")}
    for name in saved:
        del sys.modules[name]
    try:
        sys.modules["sglang"] = None  # not importable: the stand-in goes in
        check = load_check()
        assert check.install_standin() is True
        standin_storage = sys.modules["sglang.srt.mem_cache.hicache_storage"]
        standin_components = sys.modules["sglang.srt.mem_cache.unified_cache.components"]
        standin_linker = sys.modules["sglang.srt.mem_cache.unified_cache.unified_cache_linker"]
        for member in standin_storage.PoolName:
            assert real_storage.PoolName(member.value).name == member.name
        for member in standin_components.ComponentType:
            assert real_components.ComponentType(member.value).name == member.name
        real_fields = real_storage.PoolTransfer.__dataclass_fields__
        for name in standin_storage.PoolTransfer.__dataclass_fields__:
            assert name in real_fields
        real_base, base = real_linker.UnifiedCacheLinker, standin_linker.UnifiedCacheLinker
        assert base.__abstractmethods__ == real_base.__abstractmethods__
        for name in base.__abstractmethods__:
            assert list(inspect.signature(getattr(base, name)).parameters) == \
                list(inspect.signature(getattr(real_base, name)).parameters), name
        real_counter, counter = real_linker.LayerWiseLoadCounter, standin_linker.LayerWiseLoadCounter
        for name, fn in inspect.getmembers(counter, inspect.isfunction):
            assert list(inspect.signature(fn).parameters) == \
                list(inspect.signature(getattr(real_counter, name)).parameters), name
        assert {n for n, _ in inspect.getmembers(real_counter, inspect.isfunction)} == \
            {n for n, _ in inspect.getmembers(counter, inspect.isfunction)}
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)
