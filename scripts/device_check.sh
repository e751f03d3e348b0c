#!/usr/bin/env bash
# The GPU check on a lent GPU machine (see docs/gpu-check.md): installs wheels carried in .whl/
# (packages that machine lacks), then runs scripts/gpu_check.py (its JSON report goes to $OUT too)
# and scripts/gpu_hops.py.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
# The compiled modules, built for this machine's Python (a build that fails serves without them).
if timeout 120 python3 setup.py -q build_ext --inplace > "${OUT:-/tmp}/build.log" 2>&1; then
  echo "compiled modules built"
else
  echo "compiled modules not built (build.log): the daemon serves without them"
fi
python3 -c "from kvserver.protocol import compiled
for m in compiled.SOURCES:  # taken: built, and from these sources (its digest)
    print(m, 'taken' if compiled.extension(m) is not None else 'not taken: missing or stale (build.log)')"
python3 -c "import torch, cupy, grpc, google.protobuf as p; print('torch', torch.__version__, 'cupy', \
cupy.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__)"
export PYTHONUNBUFFERED=1
python3 scripts/gpu_check.py "$@" | tee "${OUT:-/tmp}/gpu_check.json"
check=${PIPESTATUS[0]}
# Then where a one-page round trip's time goes (its first version took 16 s on an H200; its
# report is $OUT/hops.json). It
# does not change the check's exit status.
timeout 120 python3 scripts/gpu_hops.py || echo "gpu_hops.py failed (exit $?)"
exit "$check"
