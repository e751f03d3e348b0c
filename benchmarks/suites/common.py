"""Helpers the benchmark suites share: daemons on temp sockets, interleaved timing, percentiles,
machine info.

Daemons are subprocesses (``tests/daemon_proc.DaemonProcess``) on a Unix socket in a temporary
folder. ``daemon(*flags)`` starts one per distinct set of flags and hands the same one to every
later caller with those flags (a start costs seconds on a small machine); ``close_daemons()``
stops them all. Each suite unregisters what it registered, so suites sharing a daemon see it empty.
"""

from __future__ import annotations

import atexit
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from kvserver.config import parse_host_memory

_DAEMONS: dict[tuple[str, ...], tuple[object, int, str]] = {}
_LOCK = threading.Lock()
DEFAULT_BUDGET = "2GiB"


def daemon(*flags: str, host_memory: str = DEFAULT_BUDGET):
    """A running daemon with these extra flags and a budget of at least ``host_memory``
    (its arena is committed only as clients write, so a large budget costs nothing)."""
    from daemon_proc import DaemonProcess  # tests/ is on sys.path (run.py)

    need = max(parse_host_memory(host_memory), parse_host_memory(DEFAULT_BUDGET))
    with _LOCK:
        got = _DAEMONS.get(flags)
        if got is not None and got[1] >= need and got[0].proc.poll() is None:
            return got[0]
        if got is not None:
            _stop(flags)
        tmp = tempfile.mkdtemp(prefix="kvsuite-")
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--log-level", "ERROR", *flags, host_memory=str(need))
        _DAEMONS[flags] = (d, need, tmp)
        return d


def prestart() -> threading.Thread:
    """Starts the default daemon in a thread, so that its start overlaps the caller's imports."""
    t = threading.Thread(target=daemon, name="kvbench-daemon-start", daemon=True)
    t.start()
    return t


def daemon_flags(d) -> list[str]:
    """The daemon's command line after ``python -m kvserver``, for the results."""
    return [a for a in d.args if not a.startswith(tempfile.gettempdir())]


def _stop(flags: tuple[str, ...]) -> None:
    d, _, tmp = _DAEMONS.pop(flags)
    try:
        d.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def close_daemons() -> None:
    with _LOCK:
        for flags in list(_DAEMONS):
            _stop(flags)


atexit.register(close_daemons)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, progress=None) -> dict[str, list[float]]:
    """Seconds of every run of each function, run in turn (one of each per round) so that drift in
    the machine's speed hits all alike. One warm-up run each first (first touch of pages, threads)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        if progress is not None:
            progress.update(1)
    return times


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the nearest ranks."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats_of(seconds: list[float]) -> dict[str, float]:
    """Median, p50/p99, min and max of a list of seconds, and how many."""
    return {
        "n": len(seconds),
        "median_s": statistics.median(seconds),
        "p50_s": percentile(seconds, 50),
        "p99_s": percentile(seconds, 99),
        "min_s": min(seconds),
        "max_s": max(seconds),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine_info() -> dict:
    import grpc
    import numpy
    import torch

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _mem_total(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
        "loadavg": list(os.getloadavg()),
    }


def save_figure(fig, path) -> None:
    """Writes a figure as a small PNG (dpi 100, optimized) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100, pil_kwargs={"optimize": True})
    plt.close(fig)


def mib(nbytes: float) -> str:
    n = nbytes / (1 << 20)
    return f"{n / 1024:g} GiB" if n >= 1024 else f"{n:g} MiB"
