# Sourced by scripts/install_sglang.sh and scripts/install_vllm.sh: installs one engine's pinned
# wheel and its few small packages into the kvserver venv without dependency resolution, keeping
# the venv's CPU torch. The caller sets `venv`, `py` and `pip` (an array: python -m pip ...) first.
#
#   install_engine NAME VERSION WHEEL_FILE OVERRIDE IGNORE_REGEX PACKAGE...
#
# The wheel is OVERRIDE (a path, may be empty), else ./.cache/wheels/WHEEL_FILE (cached), else
# /tmp/wheels/WHEEL_FILE, else downloaded from PyPI into ./.cache/wheels/. Not ./.whl/: that
# folder is what the GPU check carries to the GPU machine, where no engine must be. pip's lines
# about the engine's own unmet pins (IGNORE_REGEX, an extended regex) are expected and left out.

install_engine() {
  local name="$1" version="$2" wheel_file="$3" wheel="$4" ignore="$5"
  shift 5
  if [[ ! -x "$py" ]]; then
    echo "no venv at $venv: run scripts/install.sh test first" >&2
    return 1
  fi
  local torch_before torch_after log rc=0
  torch_before="$("$py" -c 'import torch; print(torch.__version__)')"
  if [[ -z "$wheel" ]]; then
    for cand in ".cache/wheels/$wheel_file" "/tmp/wheels/$wheel_file"; do
      if [[ -f "$cand" ]]; then wheel="$cand"; break; fi
    done
  fi
  if [[ -z "$wheel" ]]; then
    mkdir -p .cache/wheels
    "${pip[@]}" download -q --no-deps --only-binary=:all: "${name}==${version}" -d .cache/wheels
    wheel=".cache/wheels/$wheel_file"
  fi
  # One pip call, no dependency resolution, no byte-compiling.
  log="$(mktemp)"
  "${pip[@]}" install -q --no-compile --no-deps "$wheel" "$@" >"$log" 2>&1 || rc=$?
  grep -v -E -e "$ignore" -e "dependency resolver does not currently" \
    -e "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  if [[ $rc -ne 0 ]]; then echo "pip install failed ($rc)" >&2; return "$rc"; fi
  "$py" -c "from importlib.metadata import version as v; assert v('$name') == '$version', v('$name')" \
    || { echo "$name $version did not install" >&2; return 1; }
  torch_after="$("$py" -c 'import torch; print(torch.__version__)')"
  if [[ "$torch_after" != "$torch_before" ]]; then
    echo "torch changed from $torch_before to $torch_after: the CPU torch must stay" >&2
    return 1
  fi
  echo "$name $version installed in $venv without its dependencies (torch $torch_after kept)"
}
