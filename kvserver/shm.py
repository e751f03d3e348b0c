"""POSIX shared-memory objects (/dev/shm) as writable mmaps, with strict name checks."""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass

from kvserver.errors import InvalidArgument, NotFound, PermissionDenied

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def check_name(name: str) -> str:
    """A bare object name: no slashes, no leading dot, no '..', no NUL, at most 201 chars."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"shm name {name!r} is not allowed: use letters, digits, '.', '_' and '-' only, "
            "starting with a letter or digit, without '..' or '/'"
        )
    return name


@dataclass(slots=True)
class ShmMapping:
    """A mapped shared-memory object; ``size`` is the object's size when it was mapped."""

    name: str
    size: int
    mm: mmap.mmap

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A tensor view still exports the buffer; the mapping goes when the last view does.
            pass


def open_shm(name: str) -> ShmMapping:
    """Maps an existing object read-write; the name is checked before anything is opened."""
    check_name(name)
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"shm object {name!r} does not exist in {SHM_DIR}") from None
    except PermissionError:
        raise PermissionDenied(f"shm object {name!r} cannot be opened read-write") from None
    except OSError as exc:
        raise InvalidArgument(f"shm object {name!r} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"shm object {name!r} is not a regular shared-memory object")
        if st.st_size == 0:
            raise InvalidArgument(f"shm object {name!r} is empty")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return ShmMapping(name, st.st_size, mm)
    finally:
        os.close(fd)


def create_shm(name: str, size: int) -> ShmMapping:
    """Creates a new object (mode 0600, fails if it exists) of ``size`` bytes and maps it."""
    check_name(name)
    if size <= 0:
        raise InvalidArgument("shm size must be positive")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return ShmMapping(name, size, mm)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def unlink_shm(name: str) -> None:
    check_name(name)
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass

