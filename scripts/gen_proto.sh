#!/usr/bin/env bash
# Regenerates the checked-in Python modules from proto/ (tests/test_proto_fresh.py checks them).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/kvserver/v1/kvserver.proto
