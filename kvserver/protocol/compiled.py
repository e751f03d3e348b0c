"""The package's C extensions, each taken only if it was built from the sources beside it.

``SOURCES`` names each extension's files; setup.py builds every extension from its entry, with
the digest of those files compiled in (``SOURCES``, a module constant of the extension). Where the
files are beside the package (a source tree, or an installed package, which ships them), an
extension whose digest is not theirs was built from other sources (a tree updated without a
rebuild) and is not used: its caller runs the fallback of a build without a compiler (numpy,
torch or Python, slower; the features that need an extension refused, as the node-wide cache and
the disk tier need ``_kvcopy``), and the log says to rebuild, instead of running stale C code or
calling a function whose arguments have changed. Where none of them is there, any build that
carries a digest is taken.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

# Each extension and the files it is built from: its C source first, then every header it includes.
_S = "kvserver/protocol/csrc/sources.h"  # every extension's SOURCES constant
# kvlane.c's parts, which it includes once, in this order
_LANE_PARTS = tuple(f"kvserver/lane/csrc/{part}.h" for part in (
    "plane", "gate", "gate_cuda", "jobs", "serve_get", "serve_put", "slots", "cuda_jobs", "work", "thread",
    "engine", "loop_copies", "engine_cache"))
SOURCES: dict[str, tuple[str, ...]] = {
    "kvserver.copies._kvcopy": ("kvserver/copies/csrc/kvcopy.c", "kvserver/copies/csrc/stream.h", _S),
    "kvserver.store._kvindex": ("kvserver/store/csrc/index.c", "kvserver/store/csrc/index.h",
                                "kvserver/store/csrc/digest.h", "kvserver/store/csrc/hit.h", _S),
    "kvserver.lane._kvlane": ("kvserver/lane/csrc/kvlane.c", *_LANE_PARTS, "kvserver/copies/csrc/stream.h",
                              "kvserver/lane/csrc/request.h", "kvserver/lane/csrc/get.h",
                              "kvserver/lane/csrc/cache.h", "kvserver/lane/csrc/cuda.h",
                              "kvserver/store/csrc/hit.h",
                              "kvserver/store/csrc/index.h", "kvserver/store/csrc/digest.h", _S),
    "kvserver.api._packed": ("kvserver/api/csrc/packed.c", "kvserver/api/csrc/varint.h", _S),
    "kvserver.protocol._wire": ("kvserver/protocol/csrc/wire.c", "kvserver/lane/csrc/request.h", _S),
}
# The folder that holds the kvserver package: a source tree's root, or site-packages.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def digest(root: str, files: tuple[str, ...]) -> str:
    """The digest of ``files`` (paths relative to ``root``), names and contents."""
    h = hashlib.sha256()
    for name in files:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def extension(name: str) -> ModuleType | None:
    """The extension module ``name`` if it is built and, where its sources are beside the package,
    built from them; else None (logged once, but for an extension that was never built). Each of
    its callers asks here: the check and its warning happen once a process."""
    return check(name, ROOT)


def check(name: str, root: str) -> ModuleType | None:
    """``extension``'s check, against the sources under ``root``."""
    try:
        module = importlib.import_module(name)
    except ImportError:  # not built (no compiler): the fallback, as documented by each caller
        return None
    built = getattr(module, "SOURCES", None)
    files = SOURCES[name]
    present = [os.path.isfile(os.path.join(root, f)) for f in files]
    if not any(present):  # no sources to compare with: any build that carries a digest
        if built:
            return module
    elif all(present):
        try:
            if built == digest(root, files):
                return module
        except OSError as e:  # unreadable: nothing shows the build is of these sources
            logger.warning("%s: cannot read its sources (%s)", name, e)
    logger.warning("%s was built from other sources than %s (digest %s): its fallback runs until it "
                   "is rebuilt (python setup.py build_ext --inplace in a source tree, or install the "
                   "package again)", name, root, built)
    return None
