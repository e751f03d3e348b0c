"""STAND-IN for torchvision, for kvserver's CPU-only tests.

Not torchvision. SGLang 0.5.23's sglang.srt.configs package (reached from memory_pool.py through
sglang.srt.configs.mamba_utils) imports multimodal config modules that do
`import torchvision.transforms as T` and `from torchvision.transforms.functional import
InterpolationMode` at module level. PyPI's torchvision wheel is built against its own (CUDA) torch
release and would not load beside the venv's CPU torch 2.13, and no CPU build is on PyPI, so only
those names are provided: InterpolationMode and transform classes that raise when used.
"""

KVSERVER_STANDIN = True
__version__ = "0.0.0+kvserver-standin"

from . import transforms  # noqa: E402,F401
