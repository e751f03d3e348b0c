"""Checks shared by the bad-input and access tests: hashes, mappings, the status of a call, and an
event loop held still."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from kvclient import KVClientError
from kvserver.protocol.shared_memory import SHM_DIR


def sha_of(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def file_sha(name: str) -> str:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def pool_sha(pool) -> str:
    """The sha256 of a kvclient.ShmKVPool's whole object, read through its memfd (or its name)."""
    if not pool.fds:
        return file_sha(pool.name)
    fd = pool.fds[0]
    return hashlib.sha256(os.pread(fd, os.fstat(fd).st_size, 0)).hexdigest()


def mappings_of(name: str) -> list[str]:
    """Lines of this process's maps (the daemon runs in-process) that map /dev/shm/<name>, or
    the memfd labelled <name>."""
    path = os.path.join(SHM_DIR, name)
    ends = (path, f"{path} (deleted)", f"/memfd:{name} (deleted)")
    with open(f"/proc/{os.getpid()}/maps") as f:
        return [line for line in f if line.rstrip("\n").endswith(ends)]


def error_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status a call that must fail ended with; fails the test if it succeeded."""
    try:
        result = call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    except KVClientError as exc:
        return exc.code, exc.message
    pytest.fail(f"the request was accepted: {str(result)[:300]!r}")


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Polls ``predicate`` until it holds; fails the test, naming ``what``, after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Described:
    """A pool whose descriptor a test edits: registers as ``pool`` does, with ``desc`` sent."""

    def __init__(self, pool, desc) -> None:
        self._pool, self._desc = pool, desc
        self.layout, self.dtype = pool.layout, pool.dtype

    def descriptor(self):
        return self._desc

    def __getattr__(self, name):
        return getattr(self._pool, name)


@contextlib.contextmanager
def loop_held(loop, seconds: float = 10) -> Iterator[None]:
    """The event loop ``loop`` (another thread's) running nothing else until the block ends: held
    in a callback of its own, which has begun when this enters (an I/O callback ready before it
    may run first, never one after)."""
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        free.wait(seconds)

    loop.call_soon_threadsafe(hold)
    try:
        assert held.wait(seconds), "the loop did not come to the hold"
        yield
    finally:
        free.set()


def being_written(d) -> int:
    """Pages of a part being written by a Put now in daemon ``d`` (not those the data plane sets aside)."""
    from kvserver.store.pages import WRITING

    return d.run(lambda: int(((d.core.cache.pages.state == WRITING) & (d.core.cache.pages.part >= 0)).sum()))
