#!/usr/bin/env bash
# The GPU check on a lent GPU machine (see docs/gpu-check.md): installs wheels carried in .whl/
# (packages that machine lacks), then runs scripts/gpu_check.py; the JSON report goes to $OUT too.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, cupy, grpc, google.protobuf as p; print('torch', torch.__version__, 'cupy', \
cupy.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__)"
export PYTHONUNBUFFERED=1
python3 scripts/gpu_check.py "$@" | tee "${OUT:-/tmp}/gpu_check.json"
exit "${PIPESTATUS[0]}"
