#!/usr/bin/env bash
# Installs SGLang 0.5.23's Python code into an existing kvserver venv (default ./.venv, or $VENV) for
# the CPU-only SGLang tests (tests/sglang_env.py, docs/sglang-notes.md). Nothing here is a GPU build.
#
# - The sglang wheel goes in with --no-deps: it pins torch==2.14.1 (CUDA) and ~80 other packages,
#   and the venv's CPU torch must stay. The script fails if torch changed.
# - Then only the small packages that the import chain of sglang.srt.mem_cache (memory pools,
#   hicache_storage, unified_cache linker, UnifiedRadixCache) and sglang.srt.server_args needs,
#   each pinned, also with --no-deps (the list is closed: every dependency of each is in it or is
#   already in the kvserver venv).
# - GPU-only or heavy imports (triton, torchvision, IPython) are NOT installed: tests/sglang_standins/
#   holds stand-ins that tests/sglang_env.py puts on sys.path.
#
# The wheel is taken from $SGLANG_WHEEL, else ./.cache/wheels/ (cached), else /tmp/wheels/, else
# downloaded from PyPI into ./.cache/wheels/ (39 MB). Not ./.whl/: that folder is what the GPU check
# carries and installs on the GPU machine, where SGLang must not be (scripts/gpu_check_sglang.py).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
py="$venv/bin/python"
# Always `python -m pip`: a venv copied with `cp -a` keeps bin/pip's shebang on the original venv.
pip=("$py" -m pip --disable-pip-version-check)

SGLANG_VERSION=0.5.23
WHEEL_NAME="sglang-${SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"

# Pinned; every one installed with --no-deps. Grouped by the import that needs it.
PACKAGES=(
  # sglang/srt/utils/common.py, network.py (module level)
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 msgspec==0.23.0 pillow==13.0.0 starlette==1.10.0
  pyzmq==27.3.0
  requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  # sglang/__init__.py -> sglang.lang.backend.runtime_endpoint
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  # memory_pool.py -> sglang.srt.configs / layers.quantization / kernels (module level)
  dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 loguru==0.7.3
  gguf==0.19.0
  # unified_radix_cache.py -> managers.schedule_batch -> entrypoints.openai.protocol, function_call
  openai==2.8.0 httpx==0.28.1 httpcore==1.0.9 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  partial-json-parser==0.2.1.1.post7
)

# shellcheck source=scripts/engine_wheel.sh
source scripts/engine_wheel.sh
install_engine sglang "$SGLANG_VERSION" "$WHEEL_NAME" "${SGLANG_WHEEL:-}" '^sglang [0-9.]+ requires' "${PACKAGES[@]}"
