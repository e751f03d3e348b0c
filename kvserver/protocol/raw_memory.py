"""Arrays over mapped memory that do not pin it: the daemon's views of host memory and of engines'
shared-memory pools.

``np.frombuffer(mm)`` holds a buffer export of the mapping for as long as any view of it lives,
and ``mm.close()`` then raises; the daemon closes a pool's mappings once its copies ended, whatever
still holds a view. These arrays hold only the address: like a C pointer, none may be used after
its mapping is closed (callers drop their views first), and nothing keeps a closed mapping alive.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np


class _At:
    """What ``np.asarray`` reads a raw span from (the array interface, version 3)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


def address_of(mm: mmap.mmap) -> int:
    """The first byte of an open mapping in this process (no export of it is kept)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def array_at(address: int, nbytes: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """The ``nbytes`` at ``address`` as a flat, writable array of ``dtype`` (whole items only)."""
    dtype = np.dtype(dtype)
    raw = np.asarray(_At(address, nbytes - nbytes % dtype.itemsize))
    return raw.view(dtype)


def rows_at(flat: np.ndarray, offset: int, rows: int, row_items: int, row_stride: int) -> np.ndarray:
    """``rows`` rows of ``row_items`` items of ``flat``'s dtype over its memory, the first at its
    byte ``offset`` and each ``row_stride`` bytes after the one before; ValueError where one would
    reach past ``flat``'s end (numpy's ``as_strided`` would point there without a word)."""
    return np.ndarray((rows, row_items), flat.dtype, buffer=flat, offset=offset,
                      strides=(row_stride, flat.itemsize))


def address(view: np.ndarray) -> int:
    """The address of a view's first item."""
    return view.__array_interface__["data"][0]
