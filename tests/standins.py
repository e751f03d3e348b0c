"""What the engine test environments (tests/sglang_env.py, tests/vllm_env.py) share: taking their
stand-ins out of sight again."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def undo(standins: Path, modules: tuple[str, ...], environ_before: dict[str, str] | None) -> None:
    """Takes ``standins`` off sys.path and its ``modules`` out of sys.modules (the engine's modules
    already imported keep their references), and puts ``environ_before`` back if given."""
    while str(standins) in sys.path:
        sys.path.remove(str(standins))
    for name in list(sys.modules):
        path = getattr(sys.modules[name], "__file__", None) or ""
        if name.split(".", 1)[0] in modules and path.startswith(str(standins)):
            del sys.modules[name]
    if environ_before is not None:
        os.environ.clear()
        os.environ.update(environ_before)
