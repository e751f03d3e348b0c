"""Where a client finds the daemon when it is given no address (the default gRPC socket path),
and whether a directory is safe to meet another process in."""

from __future__ import annotations

import os
import stat


def default_socket() -> str:
    if os.geteuid() == 0:
        return "/run/kvserver/kvserver.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvserver-{os.geteuid()}"
    return os.path.join(runtime, "kvserver", "kvserver.sock")


def foreign_path(path: str) -> str | None:
    """Why another user could swap what lies at or below the absolute ``path``, or None: a link
    on the way that another user owns (it controls where the path leads), or a directory at or
    above it (resolved) that is neither root's nor this euid's, or that others may write without
    the sticky bit (as /tmp has). The part of ``path`` that does not exist yet is skipped: whoever
    makes it makes it below what was checked."""
    me = os.geteuid()
    cur = "/"
    for comp in path.strip("/").split("/"):
        cur = os.path.join(cur, comp)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            return f"{cur} is a link of uid {st.st_uid}: another user controls where it leads"
    here = os.path.realpath(path)
    while not os.path.lexists(here):
        here = os.path.dirname(here)
    while True:
        st = os.lstat(here)
        if st.st_uid not in (0, me):
            return f"{here} belongs to uid {st.st_uid}: another user controls it"
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{here} is writable by other users and not sticky"
        if here == os.path.dirname(here):
            return None
        here = os.path.dirname(here)
