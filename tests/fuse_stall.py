"""A FUSE file system that never answers root (for tests/test_peers_fuse.py), on /dev/fuse itself.

Usage (as root): fuse_stall.py MOUNTPOINT OWNER_UID [allow_other]. It mounts one file, ``f``, as if
OWNER_UID had mounted it (``user_id``), prints "mounted", then serves requests: a FLUSH from uid 0
(the daemon closing a descriptor of ``f``) is held, never answered; with ``allow_other`` a
GETATTR from uid 0 (an fstat of it) is held too. Killing this process aborts the connection: the
held requests fail, and whoever waited on them goes on.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct
import sys

IN = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
LOOKUP, GETATTR, OPEN, RELEASE, FLUSH, INIT, OPENDIR, RELEASEDIR, DESTROY = 1, 3, 14, 18, 25, 26, 27, 29, 38
NO_REPLY = (2, 36, 42)  # FORGET, INTERRUPT, BATCH_FORGET


def main() -> None:
    mnt, owner = sys.argv[1], int(sys.argv[2])
    allow_other = sys.argv[3:] == ["allow_other"]
    dev = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={dev},rootmode=40000,user_id={owner},group_id={owner}"
    opts += ",allow_other" if allow_other else ""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"kvtest", mnt.encode(), b"fuse", 0, opts.encode()) != 0:
        sys.exit(f"mount failed: {os.strerror(ctypes.get_errno())}")
    print("mounted", flush=True)

    def attr(node: int) -> bytes:
        if node == 1:
            return ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, owner, owner, 0, 4096, 0)
        return ATTR.pack(2, 4096, 8, 0, 0, 0, 0, 0, 0, stat.S_IFREG | 0o600, 1, owner, owner, 0, 4096, 0)

    def reply(unique: int, payload: bytes = b"", err: int = 0) -> None:
        os.write(dev, OUT.pack(OUT.size + len(payload), err, unique) + payload)

    held = []
    while True:
        try:
            buf = os.read(dev, 1 << 21)
        except OSError:
            return
        length, op, unique, node, uid, _, _, _, _ = IN.unpack_from(buf)
        body = buf[IN.size:length]
        if op == INIT:
            reply(unique, struct.pack("<IIIIHHIIHHII6I", 7, 31, 0, 0, 16, 12, 131072, 1, 32, 0, 0, 0,
                                      0, 0, 0, 0, 0, 0))
        elif op == LOOKUP:
            if body.rstrip(b"\0") == b"f":
                reply(unique, struct.pack("<QQQQII", 2, 0, 0, 0, 0, 0) + attr(2))
            else:
                reply(unique, err=-2)
        elif uid == 0 and (op == FLUSH or op == GETATTR and allow_other and node == 2):
            held.append(unique)  # never answered
            print(f"holding {'FLUSH' if op == FLUSH else 'GETATTR'}", flush=True)
        elif op == GETATTR:
            reply(unique, struct.pack("<QII", 0, 0, 0) + attr(node))
        elif op in (OPEN, OPENDIR):
            reply(unique, struct.pack("<QII", 1, 0, 0))
        elif op in (FLUSH, RELEASE, RELEASEDIR):
            reply(unique)
        elif op in NO_REPLY:
            pass
        elif op == DESTROY:
            reply(unique)
            return
        else:
            reply(unique, err=-38)  # ENOSYS


if __name__ == "__main__":
    main()
