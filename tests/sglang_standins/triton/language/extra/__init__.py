"""STAND-IN for triton.language.extra (see tests/sglang_standins/triton/__init__.py): SGLang's
quantization kernels do `from triton.language.extra import libdevice` at module level."""

from . import libdevice  # noqa: F401
