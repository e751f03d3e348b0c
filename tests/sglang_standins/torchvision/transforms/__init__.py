"""STAND-IN for torchvision.transforms (see torchvision/__init__.py): names imported at module level
by SGLang's multimodal configs; every transform raises when constructed."""

from . import functional  # noqa: F401
from .functional import InterpolationMode  # noqa: F401


class _StandinTransform:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in: {type(self).__name__} is not available in CPU tests")


class Compose(_StandinTransform):
    pass


class Lambda(_StandinTransform):
    pass


class Resize(_StandinTransform):
    pass


class ToTensor(_StandinTransform):
    pass


class Normalize(_StandinTransform):
    pass


class CenterCrop(_StandinTransform):
    pass
