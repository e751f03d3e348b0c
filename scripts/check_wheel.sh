#!/usr/bin/env bash
# What a user installs, checked from outside the tree: builds the wheel, installs it with its
# dependencies into a fresh virtual environment (CPU torch first, as scripts/install.sh does), imports
# every module of the tree's packages from there without CuPy (the engines' integrations, which
# import SGLang or vLLM, are found in the wheel but not imported), runs `kvserver --help`, and starts
# the installed daemon for one health check and a shared-memory round trip with the installed kvclient.
# Usage: scripts/check_wheel.sh   (needs .venv from scripts/install.sh, to build with)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d "${TMPDIR:-/tmp}/kvserver-wheel.XXXXXX")
daemon=""
cleanup() {
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
start=$SECONDS

# Built from a copy of the sources, so a stale build/ folder in the tree cannot slip files in.
mkdir "$work/src"
cp -r pyproject.toml setup.py README.md kvserver client "$work/src/"
find "$work/src" \( -name __pycache__ -o -name '*.so' \) -prune -exec rm -rf {} +
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/kvserver-*.whl)

python3 -m venv "$work/venv"
py=$work/venv/bin/python
"$py" -m pip install -q --no-compile --only-binary=:all: "torch==${KVSERVER_TORCH_VERSION:-2.13.0}+cpu" \
  || "$py" -m pip install -q --no-compile torch --index-url https://download.pytorch.org/whl/cpu
"$py" -m pip install -q --no-compile "$wheel"

# The modules the tree holds, named as installed (client/ is kvclient).
modules=$(cd "$repo" && .venv/bin/python - <<'EOF'
from pathlib import Path

for name, folder in (("kvserver", "kvserver"), ("kvclient", "client")):
    for path in sorted(Path(folder).rglob("*.py")):
        parts = [name, *path.relative_to(folder).with_suffix("").parts]
        print(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
EOF
)

cd "$work"  # nothing of the tree on sys.path from here on
"$py" - "$work/venv" $modules <<'EOF'
import importlib
import importlib.util
import pkgutil
import shutil
import sys
import sysconfig

venv, expected = sys.argv[1], sys.argv[2:]
# The engines' integrations and what they stand on, named here as well as found in the tree, so
# that a module missing from the tree fails too.
expected += [
    "kvclient.sglang", "kvclient.sglang._common", "kvclient.sglang.linker", "kvclient.sglang.storage",
    "kvclient.vllm", "kvclient.vllm.connector", "kvclient.vllm._space", "kvclient.vllm._scheduler",
    "kvclient.vllm._worker", "kvclient.vllm._meta", "kvclient.registrar", "kvclient.views_pool",
]
installed = []
for top in ("kvserver", "kvclient"):
    pkg = importlib.import_module(top)
    installed += [top] + [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{top}.")]
missing = sorted(set(expected) - set(installed))
assert not missing, f"the installed wheel lacks {missing}"
# The engines' integrations import their engine (SGLang, vLLM), which an engine's environment has
# and this one does not: they are checked to be in the wheel, and found there, but not imported.
# The packages themselves (kvclient.sglang, kvclient.vllm) import without their engine.
needs_engine = [n for n in installed if n.startswith(("kvclient.sglang.", "kvclient.vllm."))]
# So do the modules of an extra this environment is without: the publisher's schema (msgspec, the
# `events` extra). The cluster tier imports Mooncake (the `cluster` extra) only once configured.
needs_engine += ["kvserver.events.schema"]
for name in installed:
    if name in needs_engine:
        spec = importlib.util.find_spec(name)
        assert spec.origin.startswith(venv), f"{name} found at {spec.origin}, not in the wheel"
        continue
    mod = importlib.import_module(name)
    assert mod.__file__.startswith(venv), f"{name} imported from {mod.__file__}, not from the wheel"
assert importlib.util.find_spec("cupy") is None and "cupy" not in sys.modules
if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):
    for ext in ("kvserver.copies._kvcopy", "kvserver.lane._kvlane", "kvserver.protocol._wire",
                "kvserver.store._kvindex", "kvserver.api._packed"):
        assert ext in installed, f"the wheel has no compiled {ext}"
    # ... each built by the wheel, with the digest of its sources (kvserver.protocol.compiled): taken.
    for holder, attr in (("kvserver.copies.transfer", "_kvcopy"), ("kvserver.lane.plane", "_kvlane"),
                         ("kvserver.protocol.lane_request", "_wire"), ("kvclient._transport.lane", "_wire"),
                         ("kvserver.store.index", "_kvindex"), ("kvserver.api.wire", "_compiled")):
        assert getattr(importlib.import_module(holder), attr) is not None, f"{holder} runs its fallback"
print(f"imported {len(installed) - len(needs_engine)} modules from the wheel, without CuPy; "
      f"found {len(needs_engine)} that need an engine or an extra: {needs_engine}")
EOF
"$work/venv/bin/kvserver" --help > /dev/null

sock=$work/kv.sock
"$work/venv/bin/kvserver" --socket "$sock" --host-memory 64MiB --log-level WARNING &
daemon=$!
"$py" - "$sock" <<'EOF'
import sys
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvclient import KVClient, KVLayout, ShmKVPool

target = f"unix://{sys.argv[1]}"
deadline = time.monotonic() + 60
while True:
    try:
        with grpc.insecure_channel(target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            break
    except grpc.RpcError:
        pass
    assert time.monotonic() < deadline, "the installed daemon did not serve within 60 s"
    time.sleep(0.1)

with ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, num_layers=2, num_tokens=64) as pool:
    for parts in pool.buffers:
        for buf in parts:
            buf.copy_(torch.randn(buf.shape))
    want = [[b.clone() for b in parts] for parts in pool.buffers]
    with KVClient(target, timeout=10) as client:
        client.register(model="wheel-check", pool=pool, start_layer=0, end_layer=2, num_layers=2,
                        host_tokens=64, page_size=16)
        host = client.alloc(32)
        device = torch.arange(32)
        assert client.write(host_indices=host, device_indices=device) > 0
        for parts in pool.buffers:
            for buf in parts:
                buf.zero_()
        assert client.load(host_indices=host, device_indices=device).wait(timeout=10) > 0
        # On the fast lane, in its binary format: the installed data plane's calls.
        assert client.lane is not None and client.lane.request_format == 1 and client.lane.calls == 2
        client.unregister()
    for parts, ref in zip(pool.buffers, want, strict=True):
        for buf, ref_buf in zip(parts, ref, strict=True):
            assert torch.equal(buf[:32], ref_buf[:32]), "the round trip through the installed daemon lost bytes"
print("the installed daemon served a round trip")
EOF
kill -TERM "$daemon"
wait "$daemon"
daemon=""
echo "wheel check passed in $((SECONDS - start)) s: $(basename "$wheel")"
