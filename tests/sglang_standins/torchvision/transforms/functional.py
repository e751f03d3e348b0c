"""STAND-IN for torchvision.transforms.functional (see torchvision/__init__.py): InterpolationMode
only, the enum SGLang's multimodal configs name at import time."""

from enum import Enum


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
