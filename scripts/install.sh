#!/usr/bin/env bash
# Installs kvserver into ./.venv. Usage: scripts/install.sh [extra,...]   (e.g. "test" or "cuda")
# torch comes first and explicitly: the CPU build unless a torch is already in the venv, so that
# plain dependency resolution never pulls a multi-GB CUDA build onto a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
py=.venv/bin/python
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q --only-binary=:all: "torch==${KVSERVER_TORCH_VERSION:-2.13.0}+cpu" \
    || "$py" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
"$py" -m pip install -q -e ".${extras:+[$extras]}"
echo "kvserver installed in .venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
