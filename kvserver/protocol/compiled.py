"""The package's C extensions, each taken only if it was built from the sources beside it.

Every extension exports ``ABI``, a number its source raises with any change to what its Python
callers pass it or get back, and each caller names the number it was written for. An extension
built before such a change (a source tree updated without a rebuild) reports another number and
is not used: its caller runs its own fallback (numpy, torch or Python: slower, the same answers)
and the log says why, instead of calling a function whose arguments have changed.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)


def extension(name: str, abi: int) -> ModuleType | None:
    """The extension module ``name`` if it is built and its ``ABI`` is ``abi``; else None."""
    try:
        module = importlib.import_module(name)
    except ImportError:  # not built (no compiler): the fallback, as documented by each caller
        return None
    built = getattr(module, "ABI", None)
    if built != abi:
        logger.warning("%s was built from other sources (ABI %s; this code needs %d): its slower "
                       "fallback runs until it is rebuilt (pip install ., or python setup.py build_ext "
                       "--inplace in a source tree)", name, built, abi)
        return None
    return module
