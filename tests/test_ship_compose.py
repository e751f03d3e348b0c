"""docker-compose.yml, Dockerfile, Dockerfile.sglang and Dockerfile.vllm: the daemon and its engines
(SGLang, and vLLM under the `vllm` profile) share a socket volume, IPC, PIDs and GPUs; the daemon's
command line is one the real parser accepts; the healthcheck works against a real daemon; the SGLang
engine runs docs/integrations.md's linker command on SGLang's image plus kvclient, the vLLM one its
`vllm serve` command on vLLM's image plus kvclient.

No Docker engine is needed: the file is read with PyYAML and compose's ${VAR:-default} interpolation is
done here. ``docker compose config`` runs too where a compose CLI is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sglang_env
import vllm_env

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra: pip install -e .[test]")

from test_docs_readme import block, blocks, command  # noqa: E402

from kvclient._transport.channel import target  # noqa: E402
from kvserver.__main__ import build_parser, config_from_args  # noqa: E402
from kvserver.config import parse_size  # noqa: E402
from kvserver.protocol.paths import default_socket  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SGLANG_DOCKERFILE = REPO / "Dockerfile.sglang"
VLLM_DOCKERFILE = REPO / "Dockerfile.vllm"
ENGINES = ["engine", "vllm"]  # the services that reach the daemon
SOCKET_VOLUME = "kvserver-socket"

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\})")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation for the forms used here: $$, ${VAR}, ${VAR-default}, ${VAR:-default}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name, op, default = m.group(2), m.group(3), m.group(4) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VAR.sub(sub, value)


def load(env: dict[str, str] | None = None) -> dict:
    with open(COMPOSE) as f:
        return interpolate(yaml.safe_load(f), env or {})


@pytest.fixture(scope="module")
def compose() -> dict:
    return load()


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(autouse=True)
def no_kvserver_env(monkeypatch):
    # build_parser() reads KVSERVER_* for its defaults; the caller's environment must not leak in.
    for key in [k for k in os.environ if k.startswith("KVSERVER_")]:
        monkeypatch.delenv(key)


def mounts(service: dict) -> dict[str, str]:
    """Volume source -> container path, from the short ("src:dst[:mode]") or long syntax."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            src, dst = v.split(":")[:2]
        else:
            src, dst = v.get("source"), v["target"]
        out[src] = dst
    return out


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def daemon_args(service: dict) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list), "use the exec form so no shell sits between docker and the daemon's signals"
    assert cmd[0] == "kvserver", cmd
    return cmd[1:]


def daemon_config(service: dict):
    return config_from_args(build_parser().parse_args(daemon_args(service)))


def gpu_devices(service: dict) -> list[dict]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]


def test_services_present(services):
    assert {"kvserver", *ENGINES} <= set(services)


def test_vllm_only_under_its_profile(services):
    # `docker compose up` starts the daemon and SGLang; `--profile vllm` adds vLLM.
    assert services["vllm"]["profiles"] == ["vllm"]
    assert "profiles" not in services["kvserver"] and "profiles" not in services["engine"]


def test_daemon_command_parses(services):
    config = daemon_config(services["kvserver"])
    assert config.socket == "/run/kvserver/kvserver.sock"
    assert config.listen is None
    assert config.host_memory == 8 << 30  # the ${KVSERVER_HOST_MEMORY:-8GiB} default
    # The cache is kept in the host's /dev/shm (the daemon shares it: ipc host), so it outlives
    # the daemon's container.
    assert config.host_memory_dir == "/dev/shm/kvserver"
    assert services["kvserver"]["ipc"] == "host"


def test_the_cluster_profile_has_a_master_and_a_peer_daemon_and_the_daemon_joins_when_told(services):
    assert services["mooncake-master"]["profiles"] == services["kvserver-peer"]["profiles"] == ["cluster"]
    master = services["mooncake-master"]["command"]
    assert master[0] == "mooncake_master" and "--rpc_port=50051" in master
    assert services["mooncake-master"]["image"] == services["kvserver"]["image"]  # the extra's binary
    assert "cluster" in services["kvserver"]["build"]["args"]["KVSERVER_EXTRAS"].split(",")
    peer = daemon_config(services["kvserver-peer"])
    assert peer.cluster_master == "mooncake-master:50051" and peer.host_memory_dir is None
    assert mounts(services["kvserver-peer"]) == {"kvserver-peer-socket": "/run/kvserver"}
    assert daemon_config(services["kvserver"]).cluster_master is None  # off unless asked
    joined = load({"KVSERVER_CLUSTER_MASTER": "mooncake-master:50051"})["services"]["kvserver"]
    assert daemon_config(joined).cluster_master == peer.cluster_master
    assert "libibverbs1" in DOCKERFILE.read_text()


def test_an_empty_host_memory_dir_turns_keeping_off():
    config = daemon_config(load({"KVSERVER_HOST_MEMORY_DIR": ""})["services"]["kvserver"])
    assert config.host_memory_dir is None
    config = daemon_config(load({"KVSERVER_HOST_MEMORY_DIR": "/dev/shm/other"})["services"]["kvserver"])
    assert config.host_memory_dir == "/dev/shm/other"
    assert config.addresses == ["unix:///run/kvserver/kvserver.sock"]
    # Root's default socket is the same path, so the image's bare `kvserver` agrees with compose.
    if os.geteuid() == 0:
        assert default_socket() == config.socket


def test_the_disk_tier_is_off_until_a_directory_on_its_volume_is_named(services):
    assert daemon_config(services["kvserver"]).disk_cache is None
    path = "/var/cache/kvserver/disk"
    service = load({"KVSERVER_DISK_CACHE": path, "KVSERVER_DISK_SIZE": "200GiB"})["services"]["kvserver"]
    config = daemon_config(service)
    assert (config.disk_cache, config.disk_size) == (path, 200 << 30)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    assert mounts["/var/cache/kvserver"] == "kvserver-disk"  # a volume: it outlives the container


@pytest.mark.parametrize("size", ["64GiB", "512MiB", "1T"])
def test_host_memory_from_environment(size):
    config = daemon_config(load({"KVSERVER_HOST_MEMORY": size})["services"]["kvserver"])
    assert config.host_memory == parse_size(size)


def test_bad_host_memory_is_refused_by_the_daemon():
    args = daemon_args(load({"KVSERVER_HOST_MEMORY": "lots"})["services"]["kvserver"])
    with pytest.raises(ValueError, match="cannot read size 'lots'"):
        config_from_args(build_parser().parse_args(args))


def test_shared_socket_volume(compose, services):
    assert SOCKET_VOLUME in compose.get("volumes", {}), "declare the socket volume at the top level"
    socket_dir = os.path.dirname(daemon_config(services["kvserver"]).socket)
    for name in ("kvserver", *ENGINES):
        assert mounts(services[name]).get(SOCKET_VOLUME) == socket_dir, f"{name} must mount {SOCKET_VOLUME}"


@pytest.mark.parametrize("name", ENGINES)
def test_engine_address_matches_daemon_socket(services, name):
    address = environment(services[name])["KVSERVER_ADDRESS"]
    sock = daemon_config(services["kvserver"]).socket
    assert address == f"unix://{sock}"
    assert target(address) == f"unix://{sock}"  # what kvclient will dial


def test_ipc_and_pid_namespaces_shared(services):
    for name in ("kvserver", *ENGINES):
        assert services[name].get("ipc") == "host", f"{name}: /dev/shm pools and CUDA IPC need ipc: host"
        assert services[name].get("pid") == "host", f"{name}: CUDA IPC needs a shared PID namespace"


@pytest.mark.parametrize("name", ["kvserver", *ENGINES])
def test_gpu_reservation(services, name):
    assert gpu_devices(services[name]), f"{name} needs deploy.resources.reservations.devices (nvidia, gpu)"


def test_healthcheck_and_dependency(services):
    daemon = services["kvserver"]
    hc = daemon["healthcheck"]
    assert hc["test"][0] in ("CMD", "CMD-SHELL")
    assert not hc.get("disable", False)
    assert "unix://" + daemon_config(daemon).socket in " ".join(hc["test"])
    for name in ENGINES:
        assert services[name]["depends_on"]["kvserver"]["condition"] == "service_healthy", name
    assert daemon["restart"] == "unless-stopped"


def test_stop_grace_covers_shutdown_grace(services):
    daemon = services["kvserver"]
    grace = daemon_config(daemon).shutdown_grace
    m = re.fullmatch(r"(\d+)s", str(daemon.get("stop_grace_period", "10s")))
    assert m and int(m.group(1)) > grace, "docker would SIGKILL the daemon during its drain"


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_installs_the_project(services):
    build = services["kvserver"]["build"]
    assert (REPO / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
    ins = dockerfile_instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    args = {rest.split("=")[0] for word, rest in ins if word == "ARG"}
    assert set(build.get("args", {})) <= args, "compose passes a build arg the Dockerfile does not declare"
    copied = " ".join(rest for word, rest in ins if word == "COPY")
    for needed in ("pyproject.toml", "kvserver", "client"):  # the package dirs pyproject.toml names
        assert needed in copied, f"Dockerfile does not copy {needed}"
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert re.search(r'pip install "\.\$\{KVSERVER_EXTRAS:\+\[\$KVSERVER_EXTRAS\]\}"', runs), runs
    cmd = next(rest for word, rest in reversed(ins) if word in ("CMD", "ENTRYPOINT"))
    assert '"kvserver"' in cmd


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, SGLANG_DOCKERFILE, VLLM_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_sources_build_a_wheel(tmp_path, dockerfile):
    """The files a Dockerfile copies exist and are enough for `pip install .` (built here without
    network)."""
    src = tmp_path / "src"
    src.mkdir()
    for word, rest in dockerfile_instructions(dockerfile):
        if word != "COPY":
            continue
        *sources, dest = rest.split()
        for pattern in sources:
            assert list(REPO.glob(pattern)), f"{dockerfile.name} copies {pattern}, which does not exist"
            for path in REPO.glob(pattern):
                to = src / (path.name if dest.endswith("/") else dest)
                (shutil.copytree if path.is_dir() else shutil.copy)(path, to)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-qw", str(tmp_path)]
    res = subprocess.run([*pip, "."], cwd=src, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert list(tmp_path.glob("kvserver-*.whl"))


def documented_launch(mode: str) -> list[str]:
    """The words of docs/integrations.md's launch_server command (test_docs_readme's block), split as bash
    splits them, continuations joined."""
    (line,) = [ln for ln in re.sub(r"\\\n", " ", block(mode)).splitlines() if "sglang.launch_server" in ln]
    return shlex.split(line, comments=True)


def documented_install() -> list[str]:
    """docs/integrations.md's step 1: the installs into SGLang's environment."""
    (text,) = [text for (doc, first), text in blocks().items()
               if doc == "docs/integrations.md" and first.startswith("python -m pip install")]
    return [command(line) for line in text.splitlines() if command(line)]


def test_engine_runs_the_documented_linker_command(services):
    cmd = services["engine"]["command"]
    assert isinstance(cmd, list), "use the exec form so no shell sits between docker and SGLang's signals"
    doc = documented_launch("sglang-linker")
    assert doc[:3] == ["python", "-m", "sglang.launch_server"]
    # The same flags and the same JSON, word for word; python3 is the image's interpreter, and the
    # container listens on all its interfaces (the published port) rather than on localhost.
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    assert cmd[3:] == [*doc[3:], "--host", "0.0.0.0", "--port", "30000"]
    config = json.loads(cmd[cmd.index("--unified-cache-external-linker-config") + 1])
    assert config["linker"] == "KVServerLinker" and config["linker_module_path"] == "kvclient.sglang.linker"
    address = config["linker_extra_config"]["address"]
    assert address == environment(services["engine"])["KVSERVER_ADDRESS"]
    assert address == f"unix://{daemon_config(services['kvserver']).socket}"


def test_engine_model_follows_MODEL():
    cmd = load({"MODEL": "meta-llama/Llama-3.1-8B-Instruct"})["services"]["engine"]["command"]
    assert cmd[cmd.index("--model-path") + 1] == "meta-llama/Llama-3.1-8B-Instruct"


def documented_serve(mode: str) -> list[str]:
    """The words of docs/integrations.md's `vllm serve` command (test_docs_readme's block), split as bash
    splits them, continuations joined."""
    (line,) = [ln for ln in re.sub(r"\\\n", " ", block(mode)).splitlines() if "vllm serve" in ln]
    return shlex.split(line, comments=True)


def test_vllm_runs_the_documented_serve_command(services):
    vllm = services["vllm"]
    # vllm/vllm-openai's entrypoint is `vllm serve`; the service spells it out rather than rely on it.
    assert vllm["entrypoint"] == ["vllm", "serve"]
    ins = dockerfile_instructions(VLLM_DOCKERFILE)
    assert next(rest for word, rest in reversed(ins) if word == "ENTRYPOINT") == '["vllm", "serve"]'
    cmd = vllm["command"]
    assert isinstance(cmd, list), "use the exec form so no shell sits between docker and vLLM's signals"
    doc = documented_serve("vllm-serve")
    assert doc[:2] == ["vllm", "serve"]
    # The same words and the same JSON; the container listens on all its interfaces (the published
    # port) rather than on localhost.
    assert [*vllm["entrypoint"], *cmd] == [*doc, "--host", "0.0.0.0", "--port", "8000"]
    assert vllm["ports"] == ["8000:8000"]
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVServerConnector"
    assert config["kv_connector_module_path"] == "kvclient.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    address = config["kv_connector_extra_config"]["address"]
    assert address == environment(vllm)["KVSERVER_ADDRESS"]
    assert address == f"unix://{daemon_config(services['kvserver']).socket}"


def test_vllm_model_follows_MODEL():
    cmd = load({"MODEL": "meta-llama/Llama-3.1-8B-Instruct"})["services"]["vllm"]["command"]
    assert cmd[0] == "meta-llama/Llama-3.1-8B-Instruct"


# service -> its Dockerfile and base image: the engine release kvclient's integration is written and
# tested against (tests/sglang_env.py, tests/vllm_env.py).
ENGINE_IMAGES = {
    "engine": (SGLANG_DOCKERFILE, f"lmsysorg/sglang:v{sglang_env.SGLANG_VERSION}"),
    "vllm": (VLLM_DOCKERFILE, f"vllm/vllm-openai:v{vllm_env.VLLM_VERSION}"),
}


@pytest.mark.parametrize("name", ENGINES)
def test_engine_image_is_the_engines_plus_kvclient(services, name):
    dockerfile, base = ENGINE_IMAGES[name]
    build = services[name]["build"]
    assert (REPO / build["context"] / build["dockerfile"]).resolve() == dockerfile
    ins = dockerfile_instructions(dockerfile)
    assert ins[0] == ("FROM", base)
    copied = " ".join(rest for word, rest in ins if word == "COPY")
    for needed in ("pyproject.toml", "kvserver", "client"):
        assert needed in copied, f"{dockerfile.name} does not copy {needed}"
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    installs = re.findall(r"pip install ([^&]*?)\s*(?:&&|$)", runs)
    assert installs, runs
    assert "--no-deps ." in installs, "kvclient must go in with --no-deps (the engine's torch stays)"
    for args in installs:
        assert "torch" not in args and "--upgrade" not in args and "-U " not in args, args
    # The same installs as docs/integrations.md's step 1, with the image's interpreter.
    for line in documented_install():
        assert line.replace("python -m pip", "python3 -m pip", 1) in runs, line
    assert "cmp - /tmp/torch-before" in runs, "the build must fail if torch's version changed"


def _compose_cli() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        res = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=30)
        if res.returncode == 0:
            return cmd
    return None


def test_docker_compose_config():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI here (`docker compose` plugin and `docker-compose` both missing); "
                    "the structure checks above stand in for `docker compose config`")
    res = subprocess.run([*cli, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KVSERVER_HOST_MEMORY": "8GiB"})
    assert res.returncode == 0, res.stderr


def healthcheck_argv(services, socket: str) -> list[str]:
    """The healthcheck's exec form, run with this interpreter against ``socket``."""
    test = services["kvserver"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    compose_socket = daemon_config(services["kvserver"]).socket
    return [sys.executable, *(arg.replace(compose_socket, socket) for arg in test[2:])]


def test_healthcheck_passes_against_a_real_daemon(services, daemon):
    argv = healthcheck_argv(services, daemon.config.socket)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_healthcheck_fails_without_a_daemon(services, socket_dir):
    argv = healthcheck_argv(services, os.path.join(socket_dir, "absent.sock"))
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode != 0


def test_healthcheck_fails_while_draining(services, daemon):
    """On SIGTERM the daemon goes NOT_SERVING first: the check must turn unhealthy then."""
    from grpc_health.v1 import health_pb2

    daemon.call(daemon.daemon.health.set("kvserver.v1.KVServer", health_pb2.HealthCheckResponse.NOT_SERVING))
    res = subprocess.run(healthcheck_argv(services, daemon.config.socket), capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 1, res.stderr
