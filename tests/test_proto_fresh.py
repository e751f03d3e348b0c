"""The checked-in generated modules match proto/ (regenerated into a temp dir and compared)."""

from __future__ import annotations

import filecmp
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "proto/kvserver/v1/kvserver.proto"],
        cwd=ROOT, check=True,
    )
    for name in ("kvserver_pb2.py", "kvserver_pb2.pyi", "kvserver_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "kvserver/v1" / name, ROOT / "kvserver/v1" / name, shallow=False), (
            f"kvserver/v1/{name} is stale: run scripts/gen_proto.sh"
        )
