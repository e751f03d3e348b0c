"""A directory whose files keep the host cache across the daemon's restarts (--host-memory-dir).

The arena and the cache's page records are shared mappings of files in it, so that what the daemon
wrote is in the files the moment it is written, and outlives the process: a SIGKILL included. On
tmpfs (``/dev/shm``) nothing is ever written back to a disk; a reboot ends them.

Who may use it: the directory must be the daemon's own (its owner, mode 0700 or narrower, not a
link, below no link of another user), in a path whose every directory is root's or the daemon's
and writable by no one else unless sticky, as ``/dev/shm`` is; its files are opened relative to
it, never through a link, and must be regular, the daemon's, mode 0600, with one name. Anything
else is refused before a byte is read (``KeptDirError``). One daemon at a time: a lock (released
by the kernel when its holder dies) keeps a second one out.

What may be adopted: ``format.json`` names the format version and the shape of every file (the
arena's capacity, the tables' lengths). A daemon finding another shape, or none, starts empty,
says why, and writes its own: the header goes first, the files are emptied, then the new header
is written, so that a kill in between leaves no header and the next start is empty too.

Primitives: ``KeptDir`` (``array``, ``allocate``, ``seal``, ``close``; ``adopting``, ``reason``)
and ``KeptDirError``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserver.protocol.paths import foreign_path

logger = logging.getLogger(__name__)

FORMAT = 2  # bumped whenever a kept file's meaning changes (2: keys of up to 32 bytes kept whole)
# Files an earlier format kept that this one no longer maps: removed with what is not adopted, so
# that their memory (tmpfs) or disk goes back (format 1 kept a key in two word files).
RETIRED = ("index.w0", "index.w1")
HEADER = "format.json"
NOTHING = "no kept cache was found"
LOCK = "lock"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.fstatfs.restype = ctypes.c_int
# File systems whose files are memory: nothing is written back, a reboot ends them (statfs(2)).
MEMORY_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}
BOOT_ID = "/proc/sys/kernel/random/boot_id"
BOOT_TIME = "/proc/stat"  # its "btime": when this boot began, where the boot id cannot be read


def boot_id() -> str:
    """This boot of the machine's id: the kernel's boot id, else its boot time ("" where neither
    can be read)."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        pass
    try:
        with open(BOOT_TIME) as f:
            for line in f:
                if line.startswith("btime "):
                    return "btime:" + line.split()[1]
    except (OSError, IndexError):
        pass
    return ""


def in_memory(fd: int) -> bool:
    """Whether the file system of ``fd`` keeps its files in memory only (tmpfs and its kind)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: its f_type (a long) first
    if _libc.fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in MEMORY_FILE_SYSTEMS


class KeptDirError(RuntimeError):
    """The directory cannot keep the cache: another user controls it, or another daemon uses it."""


def _check_path(path: str) -> None:
    """``path`` (absolute, as given) must not be a link, nor lie below a link another user owns;
    and every directory above it (resolved) must be root's or ours, and writable by no one else
    unless sticky: else another user could swap what is below it."""
    if os.path.islink(path):
        raise KeptDirError(f"{path} is a link: give the directory itself")
    why = foreign_path(os.path.dirname(path))
    if why is not None:
        raise KeptDirError(f"{why} (above {path})")


def _check_own(st: os.stat_result, what: str, kind: int) -> None:
    me = os.geteuid()
    if stat.S_IFMT(st.st_mode) != kind:
        raise KeptDirError(f"{what} is not a {'directory' if kind == stat.S_IFDIR else 'regular file'}")
    if st.st_uid != me:
        raise KeptDirError(f"{what} belongs to uid {st.st_uid}, not to the daemon's uid {me}")
    if st.st_mode & 0o077:
        raise KeptDirError(f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: other users may reach it "
                           "(it must be 0700 for the directory, 0600 for its files)")
    if kind == stat.S_IFREG and st.st_nlink != 1:
        raise KeptDirError(f"{what} has {st.st_nlink} names: another may be changed under it")


class KeptDir:
    """The directory, checked and locked. ``shape``: what the files must have been made for
    (format, capacity, table lengths) to be adopted; ``adopting`` says whether they were."""

    def __init__(self, path: str, shape: dict[str, Any],
                 accept: Callable[[dict[str, Any]], bool] | None = None, *, unchecked: bool = False) -> None:
        """``accept``: given the header found, of this format, whether files of that shape are
        adopted too (``shape`` is then the one found). ``unchecked``: the files keep no check of
        their bytes (the host cache's, whose commit order is whole in shared memory only): on a
        file system that writes back, where a power cut may leave the arena and the records from
        different moments, they are adopted within the boot that wrote them only."""
        self.path = os.path.abspath(path)  # not resolved: a link there is refused, not followed
        self.shape = {"format": FORMAT, **shape}
        self._asked = self.shape  # (``start_over`` goes back to it from one ``accept`` took)
        self._accept = accept
        self._fds: dict[str, int] = {}
        self._maps: list[mmap.mmap] = []
        self._dir = -1
        self._lock = -1
        _check_path(self.path)
        try:
            os.makedirs(os.path.dirname(self.path), 0o700, exist_ok=True)
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        self._dir = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _check_own(os.fstat(self._dir), self.path, stat.S_IFDIR)
            if unchecked and not in_memory(self._dir):
                boot = boot_id()
                # One that cannot tell this boot from the next never adopts (a new id each start).
                self.shape["boot"] = boot or "unknown:" + os.urandom(8).hex()
                self._asked = self.shape
                logger.warning("%s is not on tmpfs: the cache kept there outlives its daemon, not its "
                               "machine (after a reboot it starts empty; its pages keep no check)%s",
                               self.path, "" if boot else "; this machine's boot cannot be told from "
                               "the next (no boot id nor boot time), so it starts empty at every start")
            self._lock = self._open(LOCK)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise KeptDirError(f"another daemon keeps its cache in {self.path} (give this one another "
                                   "directory: --host-memory-dir, KVSERVER_HOST_MEMORY_DIR)") from None
            self.adopting, self.reason = self._read_header()
            self.found = self.reason != NOTHING  # there was a kept cache, adopted or not
            if not self.adopting:
                self._remove(HEADER)  # first: a kill from here on leaves nothing to adopt
                self._remove_retired()
        except BaseException:
            self.close()
            raise

    def unseal(self) -> None:
        """Removes the header: until ``seal`` nothing in the directory will be adopted."""
        self._remove(HEADER)

    def start_over(self, reason: str) -> None:
        """Drops what was found (its mappings are let go; its files are emptied as they are mapped
        again) and starts as if the directory held nothing."""
        self.unseal()
        self._unmap()
        self._remove_retired()
        self.adopting, self.reason, self.shape = False, reason, self._asked

    # Files

    def _open(self, name: str) -> int:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir)
        try:
            _check_own(os.fstat(fd), os.path.join(self.path, name), stat.S_IFREG)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _remove(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass

    def _remove_retired(self) -> None:
        for name in RETIRED:
            self._remove(name)

    def _read_header(self) -> tuple[bool, str]:
        try:
            fd = os.open(HEADER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir)
        except FileNotFoundError:
            return False, NOTHING
        try:
            _check_own(os.fstat(fd), os.path.join(self.path, HEADER), stat.S_IFREG)
            with os.fdopen(os.dup(fd), "rb") as f:
                text = f.read(1 << 16)
        finally:
            os.close(fd)
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):  # (nested past the parser's depth)
            return False, "its format.json cannot be read"
        if not isinstance(found, dict) or found.get("format") != FORMAT:
            got = found.get("format") if isinstance(found, dict) else None
            return False, f"it is in format {got!r}, which this daemon (format {FORMAT}) does not know"
        if "boot" in self.shape and found.get("boot") != self.shape["boot"]:
            since = ("the machine restarted since it was written" if found.get("boot") else
                     "it was written by a daemon that did not bind it to the machine's boot, so a "
                     "restart of the machine since cannot be ruled out")
            return False, (f"{since} (on a file system that writes back, a power cut may have torn "
                           "what it holds, and its pages keep no check)")
        if found != self.shape and self._accept is not None and self._accept(found):
            self.shape = found
        if found != self.shape:
            diff = ", ".join(f"{k} {found.get(k)!r} (now {v!r})" for k, v in self.shape.items()
                             if found.get(k) != v)
            return False, f"it was made for another shape: {diff}"
        return True, ""

    def mapping(self, name: str, nbytes: int) -> mmap.mmap:
        """The file ``name`` of ``nbytes`` mapped shared: as found if adopting (it must have that
        size), else emptied first. Its blocks are sparse until ``allocate`` takes them."""
        mm = mmap.mmap(self.file(name, nbytes), max(1, nbytes), flags=mmap.MAP_SHARED)
        self._maps.append(mm)
        return mm

    def file(self, name: str, nbytes: int) -> int:
        """The file ``name`` of ``nbytes``, open: as found if adopting (it must have that size),
        else emptied first (sparse). ``mapping`` maps one; the disk tier reads and writes one."""
        if name in self._fds:
            raise ValueError(f"{name} is open already")
        fd = self._open(name)
        self._fds[name] = fd
        size = os.fstat(fd).st_size
        if self.adopting and size != nbytes:
            raise KeptDirError(f"{os.path.join(self.path, name)} is {size} bytes, not {nbytes}: changed "
                               "by something other than the daemon")
        if not self.adopting:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, nbytes)
        return fd

    def direct(self, name: str) -> int:
        """File ``name`` (open with ``file``) opened again for direct I/O (O_DIRECT: no page cache),
        the same file or an error; -1 if its file system does not do direct I/O."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return -1
            raise
        a, b = os.fstat(fd), os.fstat(self._fds[name])
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(fd)
            raise KeptDirError(f"{os.path.join(self.path, name)} was replaced while the daemon opened it")
        self._fds[name + "#direct"] = fd
        return fd

    def array(self, name: str, n: int, dtype: Any) -> np.ndarray:
        """A table of ``n`` items kept in file ``name`` (see ``mapping``)."""
        dtype = np.dtype(dtype)
        return np.frombuffer(self.mapping(name, n * dtype.itemsize), dtype=dtype, count=n)

    def extent(self, name: str) -> int:
        """Bytes of file ``name`` before its first hole: what ``allocate`` gave it from its start."""
        try:
            return os.lseek(self._fds[name], 0, os.SEEK_HOLE)
        except OSError:
            return os.fstat(self._fds[name]).st_size

    def allocate(self, name: str, start: int, nbytes: int) -> bool:
        """Gives bytes [start, start + nbytes) of the file its memory now, so that writing them
        later cannot fail (a full tmpfs kills the writer with SIGBUS); False if the file system
        has no room."""
        try:
            os.posix_fallocate(self._fds[name], start, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return False
            raise
        return True

    def punch(self, name: str, start: int, nbytes: int) -> None:
        """Frees bytes [start, start + nbytes) of the file: they read as zeros, hold no memory."""
        flags = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        while _libc.fallocate(self._fds[name], flags, start, nbytes) != 0:
            err = ctypes.get_errno()
            if err != errno.EINTR:  # (a signal: again)
                raise OSError(err, f"freeing {nbytes} bytes of {name}: {os.strerror(err)}")

    def seal(self) -> None:
        """Writes the header once every file has its shape: from now on a restart adopts them."""
        tmp = HEADER + ".tmp"
        self._remove(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir)
        with os.fdopen(fd, "w") as f:
            json.dump(self.shape, f)
        os.rename(tmp, HEADER, src_dir_fd=self._dir, dst_dir_fd=self._dir)

    # Small files written whole (the catalog)

    def read_text(self, name: str) -> str:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir)
        except FileNotFoundError:
            return ""
        with os.fdopen(fd, "rb") as f:
            _check_own(os.fstat(f.fileno()), os.path.join(self.path, name), stat.S_IFREG)
            return f.read().decode("utf-8", "replace")

    def appender(self, name: str, fresh: bool) -> int:
        """A descriptor appending to file ``name``; ``fresh`` empties it first."""
        fd = self._open(name)
        if fresh:
            os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_END)
        self._fds[name] = fd
        return fd

    def replace_text(self, name: str, text: str) -> int:
        """Writes ``name`` whole (a new file renamed over it) and returns it open for appending."""
        tmp = name + ".tmp"
        self._remove(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir)
        try:
            data = text.encode()
            while data:
                data = data[os.write(fd, data):]
            os.rename(tmp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except BaseException:
            os.close(fd)
            self._remove(tmp)
            raise
        old = self._fds.pop(name, None)
        if old is not None:
            os.close(old)
        self._fds[name] = fd
        return fd

    def flush(self) -> None:
        """Writes the files' changes back to their file system now (a disk's: so that they
        outlive a reboot too, not only the daemon)."""
        for mm in self._maps:
            mm.flush()
        for fd in self._fds.values():
            os.fsync(fd)

    def _unmap(self) -> None:
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a view still refers to it: unmapped once the view goes
                pass
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        self._unmap()
        for fd in (self._lock, self._dir):
            if fd >= 0:
                os.close(fd)
        self._lock = self._dir = -1
