"""Registration epochs inside host indices: index = (epoch << EPOCH_SHIFT) | host token slot.

Every registration gets a fresh random epoch, so host indices an engine kept from before a daemon
restart or a re-registration carry an epoch the new registration does not have, and are refused
with FAILED_PRECONDITION instead of naming whatever now lives at those slots. Two registrations
share an epoch with probability 1 / MAX_EPOCH (~7e-9), and the daemon never gives two live
registrations the same one.
"""

from __future__ import annotations

import numpy as np

from kvserver.errors import FailedPrecondition, OutOfRange

EPOCH_SHIFT = 36  # 64 G token slots per client region
MAX_SLOTS = 1 << EPOCH_SHIFT  # the most token slots a region may hold: registration refuses more
MAX_EPOCH = (1 << (63 - EPOCH_SHIFT)) - 1
SLOT_MASK = MAX_SLOTS - 1


def tag(slots: np.ndarray, epoch: int) -> np.ndarray:
    """Host indices of ``slots`` (all below 2^36: a larger slot would carry into the epoch bits
    and alias another slot, e.g. slot 2^36 + 5 of epoch 3 is slot 5 of epoch 3)."""
    if slots.size and int(slots.max()) >= MAX_SLOTS:
        raise ValueError(f"host slot {int(slots.max())} does not fit below 2^36 beside the epoch")
    return slots | np.int64(epoch << EPOCH_SHIFT)


def strip(indices: np.ndarray, epoch: int, num_pages: int, page_size: int) -> np.ndarray:
    """Host token slots of ``indices``, which must all carry ``epoch`` and lie in the client's
    region of ``num_pages`` pages of ``page_size`` tokens."""
    if indices.size == 0:
        return indices
    lo = int(indices.min())
    if lo < 0:
        raise OutOfRange(f"host index {lo} is negative; host indices come from Alloc")
    wrong = (indices >> EPOCH_SHIFT) != epoch
    if wrong.any():
        bad = int(indices[wrong.argmax()])
        raise FailedPrecondition(
            f"host index {bad} belongs to registration epoch {bad >> EPOCH_SHIFT}, not this "
            f"client's epoch {epoch}: it was allocated before a daemon restart or a "
            "re-registration, or was never allocated; allocate again"
        )
    slots = indices & SLOT_MASK
    hi = int(slots.max())
    if hi >= num_pages * page_size:
        raise OutOfRange(
            f"host page {hi // page_size} is outside this client's host region of {num_pages} pages"
        )
    return slots
