"""The checked-in generated modules match proto/ (regenerated into a temp dir and compared)."""

from __future__ import annotations

import filecmp
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    # The script installs its pinned generator on first use (from the package registry).
    subprocess.run(["bash", "scripts/gen_proto.sh", str(tmp_path)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    for name in ("kvserver_pb2.py", "kvserver_pb2.pyi", "kvserver_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "kvserver/v1" / name, ROOT / "kvserver/v1" / name, shallow=False), (
            f"kvserver/v1/{name} is stale: run scripts/gen_proto.sh"
        )


def test_generated_code_asks_little_of_the_runtime():
    """Engines pin their own protobuf and grpcio: the modules must not demand the newest ones."""
    pb2 = (ROOT / "kvserver/v1/kvserver_pb2.py").read_text()
    assert "Protobuf Python Version: 4.25" in pb2 and "ValidateProtobufRuntimeVersion" not in pb2
    assert "GRPC_GENERATED_VERSION" not in (ROOT / "kvserver/v1/kvserver_pb2_grpc.py").read_text()
