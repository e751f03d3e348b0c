"""Shared memory as writable mmaps: sealed memfds handed over by descriptor (the default), and
named POSIX objects in /dev/shm (opt-in, with strict name and owner checks)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat
from dataclasses import dataclass

from kvserver.errors import FailedPrecondition, InvalidArgument, NoCapacity, NotFound, PermissionDenied, shown

SHM_DIR = "/dev/shm"
# Seals a pool's memfd gets: its size can never change, nor can the seals.
POOL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
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
    """A mapped shared-memory object: ``size`` bytes of it mapped from its byte ``start`` (the
    whole object unless mapped for a span: ``mapped_span``)."""

    name: str
    size: int
    mm: mmap.mmap
    fd: int = -1  # named objects: kept open so the object's size can be checked before each copy
    start: int = 0

    @property
    def end(self) -> int:
        """The object's bytes up to the mapping's end: ``start + size``."""
        return self.start + self.size

    def check_size(self) -> None:
        """Raises if the object shrank below what is mapped: touching the lost tail is SIGBUS."""
        if self.fd >= 0:
            now = os.fstat(self.fd).st_size
            if now < self.end:
                raise FailedPrecondition(
                    f"shm object {self.name!r} shrank from {self.end} to {now} bytes since Register; "
                    "register the pool again"
                )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # torch.frombuffer does not pin the mapping: every tensor view of it must be dropped first,
        # or it would point at unmapped memory. Callers clear their views before closing.
        self.mm.close()


def mapped_span(size: int, span: tuple[int, int] | None) -> tuple[int, int]:
    """(start, length) of what of an object of ``size`` bytes is mapped for a use of its bytes
    ``span`` = [lo, hi) (None: all of it): no more than the pages holding those. An object is as
    large as its maker likes (a sealed memfd of 64 TiB costs its maker nothing), with its buffers
    anywhere in it; mapped whole, or from its start, a few filled the daemon's address space. A
    span past the object's end maps a page of it (what uses the span is then refused)."""
    if span is None:
        return 0, size
    lo, hi = span
    page = mmap.ALLOCATIONGRANULARITY
    start = lo // page * page
    end = min(size, -(-max(hi, lo + 1) // page) * page)
    if end <= start:
        return 0, min(size, page)
    return start, end - start


def open_shm(name: str, owner_uid: int, span: tuple[int, int] | None = None) -> ShmMapping:
    """Maps an existing named object read-write; the name is checked before anything is opened,
    and the object must belong to ``owner_uid`` (the caller's). The daemon (often root) first only
    finds the object (O_PATH: no open of it, so no lease of another user's broken, no watcher of it
    told), checks its kind, its owner and that it lies in the shared-memory file system itself (not
    a file system mounted over the name), then opens that same file read-write without waiting: a
    lease on it would hold a blocking open for the kernel's lease-break-time (45 s) in a worker
    thread every Register shares."""
    check_name(name)
    path = os.path.join(SHM_DIR, name)
    try:
        found = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"shm object {name!r} does not exist in {SHM_DIR}") from None
    except OSError as exc:
        _daemons_shortage(exc, f"shm object {name!r}")
        raise InvalidArgument(f"shm object {name!r} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(found)
        if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory"
            raise InvalidArgument(f"shm object {name!r} cannot be opened: it is {kind}")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"shm object {name!r} is not a regular shared-memory object")
        if st.st_uid != owner_uid:
            raise PermissionDenied(
                f"shm object {name!r} is owned by uid {st.st_uid}, not by the caller (uid {owner_uid}); "
                "the daemon maps only named objects that belong to the caller"
            )
        if st.st_dev != os.stat(SHM_DIR).st_dev:
            raise InvalidArgument(f"shm object {name!r} is not in {SHM_DIR}'s file system (a mount over it)")
        try:
            fd = os.open(f"/proc/self/fd/{found}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except BlockingIOError:
            raise FailedPrecondition(
                f"shm object {name!r} is under a lease (fcntl F_SETLEASE) that an open for writing must "
                "break first: release it and register again"
            ) from None
        except PermissionError:
            raise PermissionDenied(f"shm object {name!r} cannot be opened read-write") from None
        except OSError as exc:
            _daemons_shortage(exc, f"shm object {name!r}")
            raise InvalidArgument(f"shm object {name!r} cannot be opened: {exc.strerror}") from None
    finally:
        os.close(found)
    try:
        st = os.fstat(fd)  # the file found above (its descriptor's), whatever the name names now
        if st.st_size == 0:
            raise InvalidArgument(f"shm object {name!r} is empty")
        start, size = mapped_span(st.st_size, span)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        except OSError as exc:
            _daemons_shortage(exc, f"shm object {name!r}")
            raise InvalidArgument(f"shm object {name!r} cannot be mapped: {exc.strerror}") from None
        return ShmMapping(name, size, mm, fd, start)
    except BaseException:
        os.close(fd)
        raise


def map_sealed_fd(fd: int, what: str, span: tuple[int, int] | None = None) -> ShmMapping:
    """Maps a descriptor an engine handed over: a regular (memfd) file open read-write and sealed
    against shrinking, so no truncation can ever fault a copy; of it, the pages holding its bytes
    ``span`` (``mapped_span``). The descriptor stays the caller's.
    The seals are read before the size: a seal is never taken off, so the size read after it is the
    one the object keeps (read before, it could be one a peer shrank from before sealing)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not shared memory that can carry seals (a disk file, a pipe, a closed fd)
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise InvalidArgument(f"{what} cannot be used: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{what} is not a regular file; send a sealed memfd")
    if not seals & fcntl.F_SEAL_SHRINK:
        raise FailedPrecondition(
            f"{what} is not sealed against shrinking: create it with memfd_create(MFD_ALLOW_SEALING) "
            "and add F_SEAL_SHRINK (kvclient.ShmKVPool does), so truncating it cannot crash the daemon"
        )
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidArgument(f"{what} is not open read-write")
    if st.st_size == 0:
        raise InvalidArgument(f"{what} is empty")
    fs_page = os.fstatvfs(fd).f_bsize  # hugetlbfs reports its huge page; tmpfs (THP or not) PAGE_SIZE
    if fs_page > mmap.PAGESIZE:
        # hugetlbfs (MFD_HUGETLB): touching a page when the node has no huge page left is SIGBUS.
        raise InvalidArgument(
            f"{what} is huge-page memory ({fs_page} B pages): refused, since a copy into it "
            "faults when the node runs out of huge pages; send an ordinary memfd"
        )
    start, size = mapped_span(st.st_size, span)
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    except OSError as exc:
        _daemons_shortage(exc, what)
        raise InvalidArgument(f"{what} cannot be mapped read-write: {exc.strerror}") from None
    return ShmMapping(what, size, mm, start=start)


def _daemons_shortage(exc: OSError, what: str) -> None:
    """Raises NoCapacity where mapping failed for want of the daemon's own resources (its address
    space, its descriptors: mmap keeps a copy of the descriptor), not for the caller's object."""
    if exc.errno == errno.ENOMEM:
        raise NoCapacity(f"{what} cannot be mapped: the daemon is out of address space") from None
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        raise NoCapacity(f"{what} cannot be mapped: the daemon is out of file descriptors "
                         f"({exc.strerror}); try again") from None


def create_memfd(name: str, size: int) -> tuple[int, ShmMapping]:
    """A new anonymous memfd of ``size`` bytes, sealed (``POOL_SEALS``) and mapped; ``name`` is
    only the label /proc shows. The memory goes when its last descriptor and mapping do."""
    if size <= 0:
        raise InvalidArgument("shm size must be positive")
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, POOL_SEALS)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return fd, ShmMapping(name, size, mm)
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

