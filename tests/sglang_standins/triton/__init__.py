"""STAND-IN for the `triton` package (OpenAI Triton GPU compiler), for kvserver's CPU-only tests.

Not Triton. SGLang 0.5.23 does `import triton` / `import triton.language as tl` at module level in
sglang/srt/utils/common.py and in the mem_cache modules (memory_pool.py defines @triton.jit copy
kernels). The real wheel is ~150 MB and needs a GPU to do anything, so the tests put this
directory on sys.path (tests/sglang_env.py) instead. It provides only what those imports touch at
import time: decorators that return the Python function unchanged and a kernel launch that raises.
Any SGLang code path that actually launches a Triton kernel fails loudly with RuntimeError.
"""

import math

__version__ = "0.0.0+kvserver-standin"
KVSERVER_STANDIN = True


class _StandinKernel:
    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError(f"triton stand-in: kernel {self.__name__} cannot run (no Triton in CPU tests)")

        return launch

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"triton stand-in: {self.__name__} cannot run (no Triton in CPU tests)")


def _decorator(*dargs, **dkwargs):
    if len(dargs) == 1 and callable(dargs[0]) and not dkwargs:
        return _StandinKernel(dargs[0])
    return lambda fn: _StandinKernel(fn) if not isinstance(fn, _StandinKernel) else fn


jit = _decorator


def autotune(*args, **kwargs):
    return lambda fn: fn


def heuristics(*args, **kwargs):
    return lambda fn: fn


class Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **rest):
        self.kwargs = kwargs or {}
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.__dict__.update(rest)


def cdiv(x, y):
    return (x + y - 1) // y


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << math.ceil(math.log2(n))


from . import language  # noqa: E402,F401
