"""The operator's input the daemon refuses, in this process through ``kvserver.__main__.main``: a port
past 65535, a NaN or infinite time, a negative thread count, a flag that needs another one that was
not given, and socket paths the daemon cannot use. Each ends in one ``kvserver: ...`` line on stderr
and exit code 2 (a flag) or 1 (a socket that cannot be made), never in a traceback; nothing that
lies where the daemon would put its fd socket is removed, unless it is a dead socket."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
from collections.abc import Iterator

import pytest
from conftest import DaemonThread

import kvserver.__main__ as cli
from kvserver.config import ServerConfig
from kvserver.protocol.fd_socket import fd_socket_path


@pytest.fixture
def clean_env(monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVSERVER_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def served(monkeypatch, clean_env) -> list:
    """main() as far as it goes before serving: the config it would serve is appended here (the
    coroutine is closed unrun)."""
    configs: list[ServerConfig] = []

    def record(coro) -> None:
        configs.append(coro.cr_frame.f_locals["config"])
        coro.close()

    monkeypatch.setattr(cli.uvloop, "run", record)
    return configs


def refused(argv: list[str], capsys) -> str:
    """main(argv) must exit 2 with one kvserver: line; that line."""
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, f"{argv}: exit {rc}\n{err}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("kvserver: ")]
    assert len(lines) == 1, err
    return lines[0]


# --- values --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["65536", "70000", "99999"])
def test_a_listen_port_past_65535_is_refused(served, capsys, socket_dir, port) -> None:
    """grpc would bind the port modulo 65536: a port nobody asked for."""
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock"), "--listen", f"127.0.0.1:{port}",
                    "--insecure-tcp"], capsys)
    assert f"listen address '127.0.0.1:{port}' is not host:port" in line, line
    assert not served


@pytest.mark.parametrize("port", ["0", "65535"])
def test_listen_ports_0_to_65535_are_taken(served, socket_dir, port) -> None:
    assert cli.main(["--socket", os.path.join(socket_dir, "kv.sock"), "--listen", f"[::1]:{port}",
                     "--insecure-tcp"]) == 0
    assert served[0].listen == f"[::1]:{port}"


# Every float flag, with a value its check would let through were NaN or infinity not refused.
FLOAT_FLAGS = {
    "--shutdown-grace": "shutdown grace",
    "--lease-seconds": "lease",
    "--reclaim-grace-seconds": "reclaim grace",
    "--progress-interval-ms": "progress interval",
    "--plane-spin-us": "plane spin",
    "--cuda-wait-seconds": "CUDA wait seconds",
}


@pytest.mark.parametrize("value", ["nan", "inf", "NaN", "Infinity"])
@pytest.mark.parametrize("flag", list(FLOAT_FLAGS))
def test_nan_and_infinite_times_are_refused(served, capsys, socket_dir, flag, value) -> None:
    """A NaN grace never compares: a dead engine's registration would never be reclaimed."""
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock"), flag, value], capsys)
    assert FLOAT_FLAGS[flag] in line, line
    assert not served


def test_a_nan_time_from_the_environment_is_refused(served, capsys, socket_dir, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVER_RECLAIM_GRACE_SECONDS", "nan")
    assert "reclaim grace" in refused(["--socket", os.path.join(socket_dir, "kv.sock")], capsys)
    monkeypatch.delenv("KVSERVER_RECLAIM_GRACE_SECONDS")
    monkeypatch.setenv("KVSERVER_LEASE_SECONDS", "NaN")
    assert "lease" in refused(["--socket", os.path.join(socket_dir, "kv.sock")], capsys)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_nan_cluster_timeout_is_refused(served, capsys, socket_dir, value) -> None:
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock"), "--cluster-master", "10.0.0.1:50051",
                    "--cluster-timeout-ms", value], capsys)
    assert "the cluster timeout must be in (0, 60000] ms" in line, line


def test_finite_times_are_taken(served, socket_dir) -> None:
    assert cli.main(["--socket", os.path.join(socket_dir, "kv.sock"), "--shutdown-grace", "0",
                     "--lease-seconds", "0.5", "--reclaim-grace-seconds", "0"]) == 0
    assert (served[0].shutdown_grace, served[0].lease, served[0].reclaim_grace) == (0, 0.5, 0)


def test_negative_torch_threads_are_refused(served, capsys, socket_dir) -> None:
    """torch.set_num_threads(-1) raised at the start, a traceback."""
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock"), "--torch-threads", "-1"], capsys)
    assert "torch threads must be between 0 (torch's default) and 1024" in line, line
    assert not served


@pytest.mark.parametrize(("flag", "value", "text"), [
    ("--torch-threads", "99999999999", "torch threads must be between 0"),  # a C int: an overflow traceback
    ("--torch-threads", "1025", "torch threads must be between 0"),
    ("--copy-threads", "100000", "copy threads must be between 1 and 1024"),  # 100000 threads started
    ("--disk-threads", "5000", "disk threads must be between 1 and 1024"),
])
def test_thread_counts_past_1024_are_refused(served, capsys, socket_dir, flag, value, text) -> None:
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock"), "--disk-cache", socket_dir, flag, value],
                   capsys)
    assert text in line, line
    assert not served


def test_thread_counts_up_to_1024_are_taken(served, socket_dir) -> None:
    assert cli.main(["--socket", os.path.join(socket_dir, "kv.sock"), "--torch-threads", "1024",
                     "--copy-threads", "1024"]) == 0
    assert (served[0].torch_threads, served[0].copy_threads) == (1024, 1024)


# --- a flag that needs another -------------------------------------------------------------------------
# (the flag given alone, its value, the flag it needs)
ORPHANS = {
    "disk-size": ("--disk-size", "20GiB", "--disk-cache"),
    "disk-size-malformed": ("--disk-size", "lots", "--disk-cache"),
    "cluster-segment": ("--cluster-segment", "1GiB", "--cluster-master"),
    "cluster-timeout-ms": ("--cluster-timeout-ms", "500", "--cluster-master"),
    "cluster-host": ("--cluster-host", "10.0.0.2", "--cluster-master"),
    "kv-events-hashes": ("--kv-events-hashes", "bytes", "--kv-events-endpoint"),
    "metrics-per-space": ("--metrics-per-space", None, "--metrics-listen"),
}


def _variable(flag: str) -> str:
    return "KVSERVER_" + flag[2:].upper().replace("-", "_")


@pytest.mark.parametrize("case", list(ORPHANS))
def test_a_flag_without_the_flag_it_needs_is_refused(served, capsys, socket_dir, case) -> None:
    flag, value, needs = ORPHANS[case]
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock"), flag, *([value] if value else [])],
                   capsys)
    assert f"{flag} needs {needs}" in line, line
    assert not served


@pytest.mark.parametrize("case", list(ORPHANS))
def test_a_variable_without_the_flag_it_needs_is_refused(served, capsys, socket_dir, monkeypatch,
                                                         case) -> None:
    flag, value, needs = ORPHANS[case]
    monkeypatch.setenv(_variable(flag), value or "1")
    line = refused(["--socket", os.path.join(socket_dir, "kv.sock")], capsys)
    assert f"{flag} ({_variable(flag)}) needs {needs}" in line, line
    assert not served


def test_defaults_alone_need_nothing(served, socket_dir) -> None:
    assert cli.main(["--socket", os.path.join(socket_dir, "kv.sock")]) == 0
    assert served[0].disk_cache is None and served[0].cluster_master is None
    assert served[0].metrics_listen is None and not served[0].metrics_per_space


def test_the_flags_are_taken_with_the_flags_they_need(served, socket_dir, monkeypatch) -> None:
    sock = os.path.join(socket_dir, "kv.sock")
    assert cli.main(["--socket", sock, "--disk-cache", os.path.join(socket_dir, "disk"), "--disk-size",
                     "64MiB", "--metrics-listen", "127.0.0.1:0", "--metrics-per-space",
                     "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-hashes", "bytes",
                     "--cluster-master", "10.0.0.1:50051", "--cluster-segment", "8MiB",
                     "--cluster-timeout-ms", "500", "--cluster-host", "10.0.0.2"]) == 0
    config = served[0]
    assert (config.disk_size, config.metrics_per_space) == (64 << 20, True)
    assert not config.kv_events_int_hashes
    assert (config.cluster_segment, config.cluster_timeout, config.cluster_host) == (8 << 20, 0.5, "10.0.0.2")
    # The one needed may come from its variable, the other from its flag.
    monkeypatch.setenv("KVSERVER_METRICS_LISTEN", "127.0.0.1:0")
    assert cli.main(["--socket", sock, "--metrics-per-space"]) == 0
    assert served[1].metrics_per_space


def test_an_empty_needed_flag_as_in_a_template_is_given(served, capsys, socket_dir) -> None:
    """docker-compose.yml passes --disk-cache "${KVSERVER_DISK_CACHE-}" --disk-size ...: an empty
    directory turns the tier off and the size beside it is no mistake; a malformed one still is."""
    sock = os.path.join(socket_dir, "kv.sock")
    assert cli.main(["--socket", sock, "--disk-cache", "", "--disk-size", "10%"]) == 0
    assert served[0].disk_cache is None
    line = refused(["--socket", sock, "--disk-cache", "", "--disk-size", "lots"], capsys)
    assert "cannot read size 'lots'" in line, line


# --- sockets the daemon cannot use ----------------------------------------------------------------------


START_SECONDS = 15.0


@pytest.fixture
def started(clean_env) -> Iterator[None]:
    """main() really serving (it fails at its start here); serve() freezes the collector's objects."""
    yield
    gc.unfreeze()


def start_fails(argv: list[str], capsys) -> str:
    """main(argv) must fail at its start with exit 1 and one kvserver: line; that line. A daemon
    that starts after all is stopped (SIGTERM) after START_SECONDS, and the test fails."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # should the timer outlive main()
    timer = threading.Timer(START_SECONDS, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        rc = cli.main(["--host-memory", "16MiB", *argv])
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert rc == 1, f"{argv}: exit {rc}\n{err}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("kvserver: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_socket_below_a_file_is_refused(started, capsys, socket_dir) -> None:
    afile = os.path.join(socket_dir, "afile")
    open(afile, "w").close()
    for path in (os.path.join(afile, "kv.sock"), os.path.join(afile, "sub", "kv.sock")):
        line = start_fails(["--socket", path], capsys)
        assert f"cannot use socket {path}" in line, line
        assert "not a directory" in line.lower(), line


def test_a_socket_directory_that_cannot_be_made_is_refused(started, capsys) -> None:
    line = start_fails(["--socket", "/proc/no-such-dir/kv.sock"], capsys)
    assert "cannot use socket /proc/no-such-dir/kv.sock" in line and "No such file or directory" in line, line


def test_a_socket_path_too_long_says_why(started, capsys, socket_dir) -> None:
    path = os.path.join(socket_dir, "x" * 110, "kv.sock")
    line = start_fails(["--socket", path], capsys)
    assert f"cannot use socket {path}" in line and "too long" in line, line
    assert not line.endswith("None")


def test_an_fd_socket_path_too_long_says_why(started, capsys, socket_dir) -> None:
    """The socket's path fits a Unix address and its .fd neighbour's does not."""
    path = os.path.join(socket_dir, "y" * (107 - len(socket_dir) - 1))
    assert len(path) == 107  # the most sun_path holds
    line = start_fails(["--socket", path], capsys)
    assert fd_socket_path(path) in line and "too long" in line, line


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_what_lies_at_the_fd_socket_path_is_kept(started, capsys, socket_dir, kind) -> None:
    path = os.path.join(socket_dir, "kv.sock")
    fd_path = fd_socket_path(path)
    if kind == "file":
        with open(fd_path, "w") as f:
            f.write("precious")
    else:
        os.mkdir(fd_path)
    line = start_fails(["--socket", path], capsys)
    assert f"cannot use the fd socket {fd_path}" in line and "not a socket" in line, line
    if kind == "file":
        with open(fd_path) as f:
            assert f.read() == "precious"
    else:
        assert os.path.isdir(fd_path)


def test_a_dead_fd_socket_is_replaced(socket_dir) -> None:
    """A crashed daemon's fd socket (a socket file nothing listens on) is what start removes."""
    path = os.path.join(socket_dir, "kv.sock")
    fd_path = fd_socket_path(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(fd_path)
    daemon = DaemonThread(ServerConfig(socket=path, host_memory=16 << 20))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(fd_path)  # the new daemon's: the dead one would refuse the connection
    finally:
        daemon.stop()
