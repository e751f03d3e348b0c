#!/usr/bin/env bash
# Installs vLLM 0.33.0's Python code into an existing kvserver venv (default ./.venv, or $VENV) for
# the CPU-only vLLM tests (tests/vllm_env.py, docs/vllm-notes.md). Nothing here is a GPU build.
#
# - The vllm wheel goes in with --no-deps and --no-compile: it pins torch==2.14.0 (CUDA), flashinfer,
#   tilelang, cutlass-dsl and ~80 other packages, and the venv's CPU torch must stay. The script fails
#   if torch changed. The wheel is HUGE: 336 MB to download, 812 MB installed (its CUDA .so files:
#   vllm_flash_attn 480 MB, _C 92 MB, _moe_C 46 MB, deep_gemm 29 MB...), none of which loads on a CPU.
# - Then only the small packages that the import chains of vllm.distributed.kv_transfer (the
#   KVConnectorBase_V1 / factory), vllm.v1.core.sched.scheduler and vllm.config.ModelConfig's
#   architecture inspection (a subprocess importing vllm.model_executor.models) need, each pinned,
#   also with --no-deps. Everything else they import is already in the kvserver venv (which has
#   SGLang's packages: scripts/install_sglang.sh).
# - openai is raised from SGLang's 2.8.0 to 2.25.0 (vLLM's floor: vllm/tool_parsers imports
#   openai.types.responses.NamespaceTool). tests/test_sglang_env.py still passes with it.
#
# The wheel is taken from $VLLM_WHEEL, else ./.cache/wheels/ (cached), else /tmp/wheels/, else
# downloaded from PyPI into ./.cache/wheels/. Not ./.whl/: that folder is what the GPU check
# carries and installs on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
py="$venv/bin/python"
# Always `python -m pip`: a venv copied with `cp -a` keeps bin/pip's shebang on the original venv.
pip=("$py" -m pip --disable-pip-version-check)

VLLM_VERSION=0.33.0
WHEEL_NAME="vllm-${VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"

# Pinned; every one installed with --no-deps. Grouped by the import that needs it.
PACKAGES=(
  # vllm/config -> vllm/utils/hashing.py (module level)
  cbor2==6.3.0
  # kv_connector/v1/base.py -> v1/core/sched/output.py -> reasoning, tool_parsers, parser
  oss-harmony==0.0.11 openai==2.25.0 fastapi==0.136.3
  # multimodal/cache, sampling_params, v1/serial_utils, v1/utils (usage_lib), outputs (metrics)
  cachetools==8.0.2 cloudpickle==3.1.3 py-cpuinfo==9.0.0 prometheus_client==0.26.0
  # v1/request.py -> v1/structured_output (xgrammar; backend_guidance's class body needs llguidance)
  xgrammar==0.2.8 llguidance==1.7.6
  # ModelConfig's architecture inspection -> models/llama.py -> layers/attention -> vit_attn_wrappers
  einops==0.8.2
)

# shellcheck source=scripts/engine_wheel.sh
source scripts/engine_wheel.sh
install_engine vllm "$VLLM_VERSION" "$WHEEL_NAME" "${VLLM_WHEEL:-}" '^(vllm|sglang) [0-9.]+ requires' "${PACKAGES[@]}"
