"""Every command and example of README.md and docs/*.md, run as written against real daemons.

The fenced ```bash and ```python blocks are extracted from the documents. Each is named below by
its document and first line: run (and how), or not run here, with the reason. A block in neither
table fails `test_every_block_is_run_or_has_a_reason`, so the documents cannot grow a command no
test runs. Only environment is set up around a block: a temporary HOME and XDG_RUNTIME_DIR, the
venv's bin first on PATH (kvserver, and grpcurl from the test extra), no KVSERVER_* variables, and
the daemons the block talks to. As root the default socket is /run/kvserver/kvserver.sock, so these
tests use it (and TCP port 50051, as the README does); they skip if something else holds either.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserver.config import parse_host_memory
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

# Daemons on the node's default socket and TCP port: one such module at a time (conftest).
pytestmark = pytest.mark.usefixtures("default_socket_lock")

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
TCP_PORT = 50051
STARTUP_TIMEOUT = 30.0
REGION = 2 << 20  # the host arena is whole 2 MiB regions

# Blocks run here, by how (each has its test below).
RUN = {
    ("README.md", "scripts/install.sh && .venv/bin/kvserver"): "opening",
    ("README.md", "kvserver"): "daemons",
    ("README.md", "import torch"): "engine",
    ("README.md", "from kvclient import KVClient, KVLayout, ShmKVPool"): "cache",
    ("README.md", "S=/run/kvserver/kvserver.sock"): "grpcurl",
    ("README.md", "scripts/test.sh"): "development",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_store.py"): "store-bench",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_lookup.py"): "lookup-bench",
    ("docs/integrations.md", "mkdir -p ~/.config/kvserver"): "sglang-daemon",
    # Run by tests/test_sglang_launch.py (SGLang's own parser and classes; skipped without SGLang).
    ("docs/integrations.md",
     "python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct --page-size 64 \\"):
        "sglang-linker",
    ("docs/integrations.md",
     "python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct --page-size 64 --pp-size 2 \\"):
        "sglang-linker-pp",
    ("docs/integrations.md",
     "python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct --page-size 64 --dp-size 2 \\"):
        "sglang-linker-dp",
    ("docs/integrations.md",
     "python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct --enable-hierarchical-cache \\"):
        "sglang-hicache",
    ("docs/integrations.md", "S=/run/kvserver/kvserver.sock"): "sglang-stats-grpcurl",
    ("docs/integrations.md", "from kvclient import KVClient"): "sglang-stats-python",
    # Run by tests/test_vllm_serve.py (vLLM's own CLI parser and connector factory; skipped without vLLM).
    ("docs/integrations.md", "vllm serve Qwen/Qwen2.5-0.5B-Instruct \\"): "vllm-serve",
    ("docs/integrations.md", "vllm serve Qwen/Qwen2.5-0.5B-Instruct --data-parallel-size 2 \\"):
        "vllm-serve-dp",
    ("docs/integrations.md", "vllm serve Qwen/Qwen2.5-0.5B-Instruct "
                             "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                             "\"endpoint\": \"tcp://*:5557\"}' \\"):
        "vllm-serve-events",
    ("docs/integrations.md", "vllm serve Qwen/Qwen2.5-0.5B-Instruct "
                             "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' \\"):
        "vllm-serve-layerwise",
    # Run by tests/test_cluster_netns.py: the master line on a veth end that is 10.0.0.1, the daemon
    # line on the other end's node (its own network namespace; skipped where none can be made).
    ("docs/integrations.md", "mooncake_master --rpc_address=10.0.0.1 --rpc_port=50051 --client_ttl=5 &"):
        "cluster-nodes",
    # Run by tests/test_api_metrics.py (the daemon line as written, then the curl line against it).
    ("docs/metrics.md", "kvserver --metrics-listen 127.0.0.1:9400"): "metrics-daemon",
    ("docs/metrics.md", "curl -s http://127.0.0.1:9400/metrics | grep '^kvserver_clients'"): "metrics-curl",
}
# Blocks not run here, and why.
NOT_RUN = {
    ("docs/integrations.md", "apt-get install -y libibverbs1 && pip install 'kvserver[cluster]'"):
        "installs system and PyPI packages; scripts/test.sh installs the same "
        "(scripts/install_cluster_deps.sh, the cluster extra) before the suite, whose cluster tests use them",
    ("README.md", "from kvclient import CudaKVPool"):
        "the CUDA pool needs a GPU and CuPy (docs/gpu-check.md is the check for a GPU machine)",
    ("docs/gpu-check.md", "echo /.whl/ >> .git/info/exclude"):
        "prepares a device run: edits .git/info/exclude and downloads wheels for the GPU machine",
    ("docs/performance.md", ".venv/bin/python benchmarks/run.py"):
        "the whole benchmark suite takes minutes (about 6 on a 2-core machine), for figures measured "
        "by hand; tests/test_bench_suite.py runs the same script with --quick",
    ("docs/performance.md", ".venv/bin/python benchmarks/run.py --quick --out /tmp/kvbench-quick"):
        "tests/test_bench_suite.py runs benchmarks/run.py --quick with its own temporary --out and "
        "checks every file it writes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_transfer.py --mib 32 --repeats 40"):
        "benchmarks of minutes on a 2-core machine, for figures measured by hand; the README's "
        "bench_transfer.py line runs the same script as written",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_engine_faults.py"):
        "a benchmark of about half a minute that SIGSTOPs its daemon, for figures measured by hand; "
        "tests/test_bench_engine_faults.py runs the same script on small sizes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_vllm_connector.py"):
        "a benchmark of about half a minute, for figures measured by hand; "
        "tests/test_bench_vllm_connector.py runs the same script on a small size",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_sglang_storage.py"):
        "a benchmark of about a minute, for figures measured by hand; "
        "tests/test_bench_sglang_storage.py runs the same script on a small size",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_reclaim.py --kills 10"):
        "a benchmark of ten engine kills, for figures measured by hand; test_core_liveness.py holds the "
        "same reclaim to its bound",
    ("docs/performance.md",
     ".venv/bin/python benchmarks/bench_control.py --host-memory 64MiB --rank 1 --page-size 1"):
        "a benchmark of daemon subprocesses for figures measured by hand; test_core_bounded_cost.py holds "
        "the same Register, Alloc and Free cases to their bounds",
    ("docs/performance.md",
     ".venv/bin/python benchmarks/bench_control.py --host-memory 1088MiB --rank 64 --page-size 1 --copies"):
        "a benchmark of a daemon subprocess for figures measured by hand; test_core_bounded_cost.py holds "
        "the same Write's marks off the loop",
    ("docs/performance.md",
     ".venv/bin/python benchmarks/bench_control.py --layers 4096 --tokens 1024 --host-memory 256MiB"):
        "a benchmark of a daemon subprocess for figures measured by hand; test_bench_control.py runs "
        "the same script with --layers",
    ("docs/performance.md", ".venv/bin/python -m pytest -q -s tests/test_core_bounded_cost.py -k largest"):
        "one test of the suite, which the suite runs; the line shows the figures it prints",
    ("docs/performance.md", ".venv/bin/python -m pytest -q -s tests/test_api_message_size.py"):
        "tests of the suite, which the suite runs",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_large_put.py --puts 4"):
        "a benchmark of four daemon subprocesses, for figures measured by hand; "
        "tests/test_bench_large_put.py runs the same script with one Put",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_leases.py"):
        "a benchmark of a daemon subprocess taking 16 Mi pins three times, for figures measured by hand; "
        "tests/test_bench_leases.py runs the same script on small sizes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_register_room.py"):
        "a benchmark of six daemon subprocesses filling 1 GiB each, for figures measured by hand; "
        "tests/test_bench_register_room.py runs the same script on 64 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_cache.py --repeats 20"):
        "a benchmark of daemon subprocesses for figures measured by hand; test_bench_cache.py runs "
        "the same script with --quick",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_cache.py --sizes 16,64 --repeats 20"):
        "a benchmark of daemon subprocesses (with bench_lane.py after it), for figures measured by hand; "
        "test_bench_cache.py and test_bench_lane.py run the same scripts on small sizes",
    ("docs/performance.md",
     ".venv/bin/python benchmarks/bench_restart.py --sizes 1 4 16 --runs 3 --plot docs/plots/restart.png"):
        "a benchmark that fills 21 GiB of tmpfs, for figures measured by hand; "
        "tests/test_bench_restart.py runs the same script on 64 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_cluster.py --mib 256 --rounds 5"):
        "a benchmark that moves 6 GiB through a Mooncake cluster on loopback, for figures measured by "
        "hand; tests/test_bench_cluster.py runs the same script on 8 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_disk.py --gib 1 --rounds 5"):
        "a benchmark that writes and reads 10 GiB of disk, for figures measured by hand; "
        "tests/test_bench_disk.py runs the same script on 64 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_restart.py --tier disk --cold --sizes 1 4 16 "
                            "--runs 3 --plot docs/plots/restart-disk.png"):
        "a benchmark that writes 21 GiB to disk and drops the page cache, for figures measured by hand; "
        "tests/test_bench_restart_disk.py runs the same script on 64 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_start.py --runs 10"):
        "twenty daemon launches, for figures measured by hand; tests/test_bench_start.py runs the same "
        "script with --runs 1",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_release.py --gib 4"):
        "a benchmark that populates 4 GiB twice, for figures measured by hand; tests/test_bench_release.py "
        "runs the same script on a small region",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_index.py --mib 256"):
        "a benchmark that fills a 256 MiB cache of tiny pages, for figures measured by hand; "
        "tests/test_bench_index.py runs the same script on a 32 MiB budget",
    ("docs/performance.md",
     '.venv/bin/python benchmarks/bench_hostile.py --seconds 5 --attacks "large messages"'):
        "a benchmark of half a minute, for figures measured by hand; tests/test_bench_hostile.py runs "
        "the same script (every attack, this one included) in 3 s phases",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_hostile.py --seconds 10"):
        "a benchmark of a daemon and five attacking processes for about half a minute, for figures "
        "measured by hand; tests/test_bench_hostile.py runs the same script in 3 s phases",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_priority.py"):
        "a benchmark of about a minute with a 1 GiB offloader engine, for figures measured by hand; "
        "tests/test_copies_workers.py and tests/test_dataplane.py hold the same order (a small load's copy "
        "before a queued offload's)",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_lane.py --trips 2000 --mib 16 64 --repeats 9"):
        "a benchmark of about a minute, for figures measured by hand; tests/test_bench_lane.py runs the "
        "same script on small sizes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_lane_waits.py"):
        "a benchmark of about 15 seconds with 16 MiB transfers, for figures measured by hand; "
        "tests/test_bench_lane_waits.py runs the same script on 1 MiB",
    ("docs/performance.md",
     ".venv/bin/python benchmarks/bench_lane_waits.py --mib 64 --page-sizes 16 64 --rounds 200"):
        "a benchmark of about 20 seconds with 64 MiB transfers, for figures measured by hand; "
        "tests/test_bench_lane_waits.py runs the same script on 1 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_stream.py --repeats 30"):
        "a benchmark that copies up to 256 MiB 60 times a size, for figures measured by hand; "
        "tests/test_bench_stream.py runs the same script on 1 and 4 MiB",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_put.py --trips 2000"):
        "a benchmark of two daemon subprocesses filled past their host memory (about a minute), for "
        "figures measured by hand; tests/test_bench_put.py runs the same script on small sizes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_lane.py --trips 2000 --mib"):
        "a benchmark of about 20 seconds (no bulk transfers), for figures measured by hand; "
        "tests/test_bench_lane.py runs the same script on small sizes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_lane.py --trips 2000 --mib --disk-cache"):
        "the same benchmark with a disk tier (about 20 seconds), for figures measured by hand; "
        "tests/test_bench_lane.py runs it with --disk-cache on small sizes",
    ("docs/performance.md", ".venv/bin/python benchmarks/bench_lookup.py --rounds 1000 --keys "
                            "1024,2048,4096,8192,65536 --key-bytes 16,32"):
        "the lookup-bench block's script with more sizes and rounds (about half a minute), for figures "
        "measured by hand; test_lookup_benchmark_block runs it with its defaults",
    ("docs/lane.md", ".venv/bin/python benchmarks/bench_lane.py"):
        "a benchmark of about half a minute, for figures measured by hand; tests/test_bench_lane.py "
        "runs the same script on small sizes",
    ("docs/integrations.md", 'python -m pip install "grpcio>=1.62.3" "protobuf>=4.25.1"'):
        "installs into SGLang's own environment; tests/test_ship_compose.py checks that Dockerfile.sglang "
        "runs these same two installs on SGLang's image",
}
# Lines of run blocks that are not run whole: the reason, the scripts checked instead, and the part
# of the line that runs as written (None: nothing).
PARTLY_RUN = {
    "scripts/install.sh && .venv/bin/kvserver": ("reinstalling would rebuild the venv these tests run in",
                                                 ["scripts/install.sh"], ".venv/bin/kvserver"),
    "scripts/test.sh": ("it runs this suite; CI runs it through .ci/run", ["scripts/test.sh"], None),
    "scripts/sanitize.sh": ("it runs tests of this suite against sanitized builds; scripts/test.sh runs it "
                            "in CI", ["scripts/sanitize.sh"], None),
}

def _shm_objects() -> set[str]:
    """/dev/shm's objects but POSIX semaphores (``sem.*``), which other tests' multiprocessing
    queues create and remove while this one runs beside them (pytest-xdist)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def command(line: str) -> str:
    """A shell line without its comment (none of the documents' commands holds a '#')."""
    return re.sub(r"(^|\s)#.*$", "", line).strip()


def blocks() -> dict[tuple[str, str], str]:
    """(document, first line without its comment) -> the block's text, for every bash/python block."""
    out = {}
    for doc in DOCS:
        for lang, body in _FENCE.findall((REPO / doc).read_text()):
            if lang in ("bash", "sh", "python"):
                first = next(command(line) for line in body.splitlines() if command(line))
                out[(doc, first)] = body
    return out


def block(mode: str) -> str:
    (key,) = [k for k, v in RUN.items() if v == mode]
    return blocks()[key]


ROOT_SOCKET = "/run/kvserver/kvserver.sock"


def expected_socket(env: dict[str, str]) -> str:
    """Where the daemon's default socket is for this user (README, "Running the daemon")."""
    return ROOT_SOCKET if os.geteuid() == 0 else f"{env['XDG_RUNTIME_DIR']}/kvserver/kvserver.sock"


def accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(path) == 0


def port_free(port: int) -> bool:
    """True unless something listens on the port. SO_REUSEADDR, as the daemon's gRPC server sets
    it: connections of a daemon that just stopped (TIME_WAIT for a minute) do not take the port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A user's home with a private XDG_RUNTIME_DIR; the global paths the README uses are free."""
    (tmp_path / "run").mkdir(mode=0o700)
    if os.geteuid() == 0 and os.path.exists(ROOT_SOCKET) and accepts(ROOT_SOCKET):
        pytest.skip(f"a daemon already serves the default socket {ROOT_SOCKET}")
    if not port_free(TCP_PORT):
        pytest.skip(f"TCP port {TCP_PORT}, which the README uses, is taken")
    return tmp_path


@pytest.fixture
def env(home: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVER_")}
    out.update(HOME=str(home), XDG_RUNTIME_DIR=str(home / "run"), PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    return out


class ShellDaemon:
    """One documented line that starts the daemon, run by bash as written (bash execs a lone command,
    so the signal reaches the daemon itself); its output goes to a file."""

    def __init__(self, line: str, env: dict[str, str], log: Path) -> None:
        self.line = line
        self.log_path = log
        self._log = open(log, "wb")  # closed in close()
        self.proc = subprocess.Popen(["bash", "-c", line], cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self) -> tuple[list[str], int]:
        """The addresses and host memory the daemon reports, once it answers health SERVING on each."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while (m := re.search(r"kvserver listening on (.*) with (\d+) bytes", self.log)) is None:
            assert self.proc.poll() is None, f"{self.line!r} exited {self.proc.returncode}:\n{self.log}"
            assert time.monotonic() < deadline, f"{self.line!r} not listening:\n{self.log}"
            time.sleep(0.05)
        addresses = m.group(1).split(", ")
        for target in addresses:
            assert health(target) == health_pb2.HealthCheckResponse.SERVING, (self.line, target)
        return addresses, int(m.group(2))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=15) == 0, f"{self.line!r}:\n{self.log}"
        assert "kvserver stopped" in self.log and "Traceback" not in self.log, self.log

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    made: list[ShellDaemon] = []

    def _start(line: str, env: dict[str, str]) -> ShellDaemon:
        made.append(ShellDaemon(line, env, tmp_path / f"daemon-{len(made)}.log"))
        return made[-1]

    yield _start
    for d in made:
        d.close()


def health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def stats(target: str) -> pb.StatsResponse:
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.KVServerStub(ch).Stats(pb.StatsRequest(), timeout=5)


def starts_daemon(cmd: str) -> bool:
    words = shlex.split(cmd)
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        words.pop(0)
    return bool(words) and os.path.basename(words[0]) == "kvserver"


def host_memory_of(cmd: str) -> int:
    """The budget a daemon line asks for, as the daemon rounds it (whole regions)."""
    m = re.search(r"(?:--host-memory\s+|KVSERVER_HOST_MEMORY=)(\S+)", cmd)
    return parse_host_memory(m.group(1) if m else "4GiB") // REGION * REGION


def run_lines(text: str, env: dict[str, str], start) -> list[str]:
    """Runs a block line by line: a daemon line until it serves, then SIGTERM; any other line to
    its end. Returns the addresses each daemon listened on, in order."""
    listened = []
    for line in text.splitlines():
        cmd = command(line)
        if not cmd:
            continue
        if cmd in PARTLY_RUN:
            _, scripts, part = PARTLY_RUN[cmd]
            for script in scripts:
                assert os.access(REPO / script, os.X_OK), f"{script}, named in the docs, is not executable"
            if part is None:
                continue
            cmd = line = part
        if starts_daemon(cmd):
            d = start(line, env)
            addresses, capacity = d.wait_listening()
            assert capacity == host_memory_of(cmd), (line, capacity)
            d.stop()
            listened.append(", ".join(addresses))
        else:
            res = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=300)
            assert res.returncode == 0, f"{line!r} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return listened


def test_every_block_is_run_or_has_a_reason():
    found = set(blocks())
    unknown = sorted(found - set(RUN) - set(NOT_RUN))
    assert not unknown, f"blocks no test runs; run them in test_docs_readme.py or give a reason: {unknown}"
    stale = sorted((set(RUN) | set(NOT_RUN)) - found)
    assert not stale, f"blocks named in test_docs_readme.py but no longer in the documents: {stale}"


def test_opening_commands_install_test_and_start_the_daemon(env, start):
    text = (REPO / "README.md").read_text()
    title, rest = text.split("\n", 1)
    assert title.startswith("# ") and rest.lstrip("\n").startswith("```bash\n"), "README must open with them"
    lines = [command(line) for line in block("opening").splitlines() if command(line)]
    assert lines == ["scripts/install.sh && .venv/bin/kvserver", "scripts/test.sh"]
    assert re.search(r"^exec scripts/test\.sh", (REPO / ".ci/run").read_text(), re.MULTILINE), \
        "CI must run the README's test command"
    (listened,) = run_lines(block("opening"), env, start)
    assert listened == f"unix://{expected_socket(env)}"


def test_running_the_daemon_block(env, start, home):
    kept = Path(f"/dev/shm/kvserver-{os.getuid()}")
    disk = home / ".cache" / "kvserver-disk"
    ours = [d for d in (kept, disk) if not d.exists()]  # a directory of the user's own is left as it was
    try:
        listened = run_lines(block("daemons"), env, start)
        for d in ours:  # the daemon made the directories, owner-only, and sealed their files
            assert stat.S_IMODE(d.stat().st_mode) == 0o700 and (d / "format.json").exists()
        if disk in ours:  # the disk tier's file is as large as asked, and sparse
            data = (disk / "data").stat()
            assert data.st_size == 20 << 30 and data.st_blocks * 512 < 64 << 20
    finally:
        for d in ours:
            shutil.rmtree(d, ignore_errors=True)
    unix = f"unix://{expected_socket(env)}"
    assert listened == [unix, unix, unix, unix, unix, unix, unix, f"127.0.0.1:{TCP_PORT}"]
    token = home / ".config" / "kvserver" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text().strip()) >= 32


def test_engine_example(env, start, tmp_path):
    d = start("kvserver", env)
    (target,), _ = d.wait_listening()
    shm_before = _shm_objects()
    (tmp_path / "engine.py").write_text(block("engine"))
    res = subprocess.run([str(VENV_BIN / "python"), "engine.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    reg = re.search(r"registered: (\d+) host tokens of (\d+) bytes", out)
    assert reg and int(reg.group(1)) == 16384, out
    moved = 64 * int(reg.group(2))
    assert f"offloaded {moved} bytes of 64 tokens" in out, out
    assert f"prefetched {moved} bytes, layer by layer" in out, out
    assert out.rstrip().endswith("done: client and pool closed"), out
    after = stats(target)
    assert after.num_clients == 0 and after.reserved_bytes == 0, after
    assert _shm_objects() <= shm_before, "the example left its pool behind"
    d.stop()


def test_cache_example_hits_in_a_second_process(env, start, tmp_path):
    d = start("kvserver", env)
    (target,), _ = d.wait_listening()
    (tmp_path / "cached_engine.py").write_text(block("cache"))
    outs = []
    for _ in range(2):  # two processes, one after the other: the second is the restarted engine
        res = subprocess.run([str(VENV_BIN / "python"), "cached_engine.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout.strip())
    assert outs == ["computed the prompt, stored 4 pages", "loaded 4 of 4 pages from the cache"], outs
    after = stats(target)
    assert after.num_clients == 0 and after.cache_bytes > 0, after  # the pages outlived both engines
    d.stop()


def test_store_benchmark_block(env):
    res = subprocess.run(["bash", "-e", "-c", block("store-bench")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(("lookup", "prepare"))]
    # six operations at 1k and 64k keys, and the two packed walks at 1k, each with its dict ratio
    assert len(rows) == 14, res.stdout
    assert sum("packed" in row for row in rows) == 2, res.stdout
    assert all(float(row[-1]) > 0 for row in rows), res.stdout


def test_lookup_benchmark_block(env):
    res = subprocess.run(["bash", "-e", "-c", block("lookup-bench")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(("engine", "scheduler"))]
    # who (2 words), key bytes, keys
    assert [(row[3], row[4]) for row in rows] == [
        (width, n) for width in ("16", "32") for n in ("1024", "1024", "65536", "65536")], res.stdout
    for width in (16, 32):
        assert f"target: a Lookup of 1k keys of {width} bytes in the daemon ≤ 50 µs" in res.stdout, res.stdout


def test_grpcurl_block(env, start, home, tmp_path):
    plain = start("kvserver", env)
    plain.wait_listening()
    token = home / ".config" / "kvserver" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("readme-test-token\n")
    token.chmod(0o600)
    tcp = start(f"kvserver --socket none --listen 127.0.0.1:{TCP_PORT} --token-file {token}", env)
    assert tcp.wait_listening()[0] == [f"127.0.0.1:{TCP_PORT}"]
    script = tmp_path / "grpcurl.sh"
    script.write_text(block("grpcurl"))
    res = subprocess.run(["bash", "-e", "-o", "pipefail", str(script)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    out = res.stdout
    assert out.count("kvserver.v1.KVServer") >= 3, out  # two lists and the describe
    assert '"status": "SERVING"' in out, out
    assert re.search(rf'"capacity_?[bB]ytes": "{4 << 30}"', out), out
    plain.stop()
    tcp.stop()


def test_development_block(env, start):
    text = block("development")
    assert "scripts/test.sh" in text
    assert run_lines(text, env, start) == []


def test_integrations_daemon_block(env, start, home):
    """docs/integrations.md's daemon for SGLang: root's socket, the budget it names, an admin token
    only its owner reads."""
    if os.geteuid() != 0:
        pytest.skip("the block is written for root (/run/kvserver/kvserver.sock), as in SGLang's container")
    listened = run_lines(block("sglang-daemon"), env, start)
    assert listened == [f"unix://{ROOT_SOCKET}"]
    token = home / ".config" / "kvserver" / "admin-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text().strip()) >= 32
