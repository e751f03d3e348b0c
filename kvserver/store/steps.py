"""A request's bookkeeping in steps: the cache's large operations are generators that do at most
``STEP_KEYS`` keys' work and then yield, so that the daemon (``kvserver.core.cache_ops``) can let
its event loop serve other engines between two steps; ``run_steps`` runs one to its end at once.

Primitives: ``STEP_KEYS`` and ``run_steps``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

# Keys one step handles: about a millisecond of the event loop, a few for a Put that evicts, on the
# 2-core VM of docs/performance.md ("Hostile peers"); 4096 made another engine's Load wait twice as
# long behind each step.
STEP_KEYS = 1024


def run_steps(steps: Generator[None, None, T]) -> T:
    """Runs every step of ``steps`` now and returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
