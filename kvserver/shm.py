"""POSIX shared-memory objects (/dev/shm) as writable mmaps, with strict name checks."""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass

from kvserver.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, shown

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def check_name(name: str) -> str:
    """A bare object name: no slashes, no leading dot, no '..', no NUL, at most 201 chars."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"shm name {shown(name)} is not allowed: use letters, digits, '.', '_' and '-' only, "
            "starting with a letter or digit, without '..' or '/'"
        )
    return name


@dataclass(slots=True)
class ShmMapping:
    """A mapped shared-memory object; ``size`` is the object's size when it was mapped."""

    name: str
    size: int
    mm: mmap.mmap
    fd: int = -1  # kept open by open_shm so the object's size can be checked before each copy

    def check_size(self) -> None:
        """Raises if the object shrank below what is mapped: touching the lost tail is SIGBUS."""
        if self.fd >= 0:
            now = os.fstat(self.fd).st_size
            if now < self.size:
                raise FailedPrecondition(
                    f"shm object {self.name!r} shrank from {self.size} to {now} bytes since Register; "
                    "register the pool again"
                )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # torch.frombuffer does not pin the mapping: every tensor view of it must be dropped first,
        # or it would point at unmapped memory. Callers clear their views before closing.
        self.mm.close()


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
        return ShmMapping(name, st.st_size, mm, fd)
    except BaseException:
        os.close(fd)
        raise


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

