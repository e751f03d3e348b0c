"""Two hosts on one machine: network namespaces joined by a veth pair, for tests of what crosses a
network. Needs root and iproute2; the test is skipped, saying why, where they cannot be made.
Only the two veth ends made here carry addresses, and both namespaces are deleted at the end."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def two_hosts(net: str | None = None) -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Yields ((namespace A, its address), (namespace B, its address)): ``net``.1 and ``net``.2 on
    one /30 (``net`` like "10.0.0"; default a random private one). The addresses live only on the
    veth ends inside the two namespaces: the host's own network never sees them."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's ip, which is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    a, b = f"kvsa{tag}", f"kvsb{tag}"
    va, vb = f"kvva{tag}"[:15], f"kvvb{tag}"[:15]
    net = net or f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, f"{net}.1"), (b, vb, f"{net}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        err = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"network namespaces cannot be made here: {err.decode(errors='replace').strip() or exc}")
    try:
        yield (a, f"{net}.1"), (b, f"{net}.2")
    finally:
        for ns in made:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
