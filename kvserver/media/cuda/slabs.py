"""Pinning the node-wide cache's slabs for the GPU.

Cache pages live in slabs of the daemon's arena, outside every client's pinned region. A CUDA
copy kernel reads and writes host memory directly, so every slab must be page-locked and mapped
(cudaHostRegister, Portable | Mapped: visible to every context) before a CUDA job may name its
pages. ``SlabPinner`` follows the cache's slabs (``added``/``removed``, wired to the cache's
``on_slab_added``/``on_slab_removed`` with the slab's address) and pins nothing until CUDA is in
use: the first CUDA registration (``use``) pins every slab that exists, later slabs are pinned as
they come, and a slab is unpinned just before the cache releases it. The cache releases a slab
only while none of its pages is being read or written, and a CUDA job keeps its pages marked
until the GPU is done with them, so ``removed`` never unpins memory a copy may still touch.

Cache rows are given to the GPU by their host address: with unified addressing the device pointer
of registered host memory is its host pointer. Each slab is checked at pin time
(``pointerGetAttributes``); on a device where the two differ, or while a slab could not be
pinned, CUDA jobs on cache pages are refused (``check``) with the reason.
"""

from __future__ import annotations

import logging
import threading

from kvserver.errors import FailedPrecondition

logger = logging.getLogger(__name__)

HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
HOST_REGISTER_CHUNK = 64 << 30  # one cudaHostRegister of 512 GiB or more fails on r580+ drivers


def register_host(rt, ptr: int, nbytes: int, flags: int = HOST_REGISTER_FLAGS) -> list[int]:
    """Page-locks ``nbytes`` at ``ptr`` in chunks of at most HOST_REGISTER_CHUNK; returns the
    chunks' addresses (each to be given to ``hostUnregister``). Nothing stays registered if a
    chunk fails."""
    chunks: list[int] = []
    try:
        for start in range(0, nbytes, HOST_REGISTER_CHUNK):
            rt.hostRegister(ptr + start, min(HOST_REGISTER_CHUNK, nbytes - start), flags)
            chunks.append(ptr + start)
    except BaseException:
        for chunk in chunks:
            rt.hostUnregister(chunk)
        raise
    return chunks


class SlabPinner:
    """Keeps every cache slab pinned for the GPU once CUDA is in use (see the module's notes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: dict[int, int] = {}  # address -> bytes: every slab the cache holds
        self._pinned: dict[int, list[int]] = {}  # address -> its registered chunks
        self._unpinned: dict[int, str] = {}  # address -> why pinning it failed
        self._cupy = None
        self._ordinal = 0
        self._mismatch = ""  # set once a slab's device pointer differs from its host address

    @property
    def active(self) -> bool:
        """CUDA is in use: slabs are pinned."""
        return self._cupy is not None

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._slabs[ptr] for ptr in self._pinned)

    def added(self, ptr: int, nbytes: int) -> None:
        """The cache reserved a slab: pinned at once if CUDA is in use."""
        with self._lock:
            self._slabs[ptr] = nbytes
            if self._cupy is not None:
                self._pin(ptr, nbytes)

    def removed(self, ptr: int, nbytes: int) -> None:
        """The cache is about to release a slab (no page of it is read or written): unpinned."""
        with self._lock:
            self._slabs.pop(ptr, None)
            self._unpinned.pop(ptr, None)
            chunks = self._pinned.pop(ptr, None)
            if chunks:
                self._unpin(chunks)

    def use(self, cupy, ordinal: int) -> None:
        """CUDA is in use (a CUDA pool attached on device ``ordinal``): every slab is pinned now
        and every later one as it comes. Runs in a worker thread; each slab is pinned under the
        lock on its own, so the cache's hooks wait for one slab at most."""
        with self._lock:
            if self._cupy is not None:
                return
            self._cupy, self._ordinal = cupy, ordinal
            todo = list(self._slabs.items())
        for ptr, nbytes in todo:
            with self._lock:
                if ptr in self._slabs and ptr not in self._pinned and ptr not in self._unpinned:
                    self._pin(ptr, nbytes)

    def check(self) -> None:
        """Raises FailedPrecondition unless the GPU can copy to and from every cache slab by its
        host address."""
        with self._lock:
            if self._cupy is None:
                raise FailedPrecondition("no CUDA pool has attached: the cache slabs are not pinned for CUDA")
            if self._mismatch:
                raise FailedPrecondition(self._mismatch)
            pending = len(self._slabs) - len(self._pinned) - len(self._unpinned)
            if pending:  # the first CUDA registration is still pinning the slabs that were there
                raise FailedPrecondition(
                    f"{pending} cache slab(s) are still being pinned for the GPU; CUDA copies of cache "
                    "pages wait until they are"
                )
            if self._unpinned:
                ptr, why = next(iter(self._unpinned.items()))
                raise FailedPrecondition(
                    f"{len(self._unpinned)} cache slab(s) could not be pinned for the GPU (the slab at "
                    f"{ptr:#x}: {why}); CUDA copies of cache pages are refused until they are released"
                )

    def close(self) -> None:
        """Unpins every slab (the daemon is shutting down; no copy runs any more)."""
        with self._lock:
            for chunks in self._pinned.values():
                self._unpin(chunks)
            self._pinned.clear()
            self._unpinned.clear()
            self._slabs.clear()

    def _pin(self, ptr: int, nbytes: int) -> None:
        rt = self._cupy.cuda.runtime
        try:
            with self._cupy.cuda.Device(self._ordinal):
                self._pinned[ptr] = register_host(rt, ptr, nbytes)
                device_ptr = rt.pointerGetAttributes(ptr).devicePointer
        except Exception as exc:
            self._unpinned[ptr] = str(exc) or type(exc).__name__
            logger.warning("pinning the cache slab at %#x (%d bytes) for CUDA failed: %s", ptr, nbytes, exc)
            return
        if device_ptr != ptr and not self._mismatch:
            self._mismatch = (
                f"on CUDA device {self._ordinal} pinned host memory has another device address "
                f"(host {ptr:#x}, device {device_ptr:#x}): without unified addressing the node-wide "
                "cache cannot be copied to or from CUDA pools"
            )
            logger.warning("%s", self._mismatch)

    def _unpin(self, chunks: list[int]) -> None:
        rt = self._cupy.cuda.runtime
        with self._cupy.cuda.Device(self._ordinal):
            for chunk in chunks:
                try:
                    rt.hostUnregister(chunk)
                except Exception:
                    logger.exception("unpinning the cache slab chunk at %#x failed", chunk)
