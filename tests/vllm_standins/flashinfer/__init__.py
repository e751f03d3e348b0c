"""Stand-in for FlashInfer (flashinfer-python), for the CPU-only vLLM tests only.

Replaces: the real flashinfer package, which vllm/v1/attention/backends/flashinfer.py (and
backends/mla/flashinfer_mla.py) import at module level. Why: FlashInfer is a CUDA kernel library
(its wheel pulls flashinfer-cubin / a JIT that needs nvcc) and nothing of it runs on a CPU. The
tests only import the backend modules to read their class-level KV cache layout answers
(supported_kv_cache_layouts, is_mla); every name imported from here is a placeholder that raises
when it is called. vllm's own has_flashinfer() probe is answered before this is on sys.path
(tests/vllm_env.setup()), so vLLM never believes FlashInfer is installed.
"""

from __future__ import annotations

KVSERVER_STANDIN = True


class _PlaceholderBase:
    """A class or function of FlashInfer's that cannot run here: a class (so that vLLM's type
    annotations can write `Wrapper | Other` and subclass it) whose construction raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"flashinfer.{type(self).__name__} is a CPU test stand-in")


def _Placeholder(name: str) -> type:
    return type(name, (_PlaceholderBase,), {"__module__": __name__})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)
