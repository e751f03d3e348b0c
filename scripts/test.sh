#!/usr/bin/env bash
# Installs kvserver with its test, cluster and events extras into ./.venv (and SGLang's and vLLM's code, for
# the integration tests), runs the linter and the whole suite, then checks what a user installs: the
# built wheel, in a fresh virtual environment (scripts/check_wheel.sh), and the compiled code under
# the sanitizers (scripts/sanitize.sh; KVSERVER_SKIP_SANITIZE=1 leaves it out).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_cluster_deps.sh  # libibverbs1, which Mooncake Store's client loads (the cluster tier)
scripts/install.sh test,cluster,events
scripts/install_sglang.sh  # SGLang 0.5.23 without its dependencies, for the integration tests
scripts/install_vllm.sh  # vLLM 0.33.0's Python code without its dependencies (after SGLang's packages)
.venv/bin/ruff check .
.venv/bin/lint-imports  # the shape of the code: layers, no circles (contracts in pyproject.toml)
# The wheel check (a wheel built from this tree, installed in a fresh venv, its daemon on a private
# socket) runs beside the suite: it is mostly pip and disk, and overlaps the suite's waits.
wheel_log=$(mktemp)
scripts/check_wheel.sh >"$wheel_log" 2>&1 &
wheel_pid=$!
trap 'kill "$wheel_pid" 2>/dev/null || true; rm -f "$wheel_log"' EXIT
# Two workers (the machine's two cores), each running whole files; the modules that run daemons on
# the node's default socket and port take a lock (tests/conftest.py: default_socket_lock). The log
# ends with why each skipped test was skipped and the slowest tests (what to make cheaper).
rc=0
.venv/bin/python -m pytest -q -n 2 --dist loadfile -rs --durations=25 "$@" || rc=$?
wheel_rc=0
wait "$wheel_pid" || wheel_rc=$?
cat "$wheel_log"
[ "$rc" -eq 0 ] || exit "$rc"
[ "$wheel_rc" -eq 0 ] || { echo "the wheel check failed ($wheel_rc)" >&2; exit "$wheel_rc"; }
# The compiled code under AddressSanitizer and UndefinedBehaviorSanitizer: the request and index
# fuzzers for a bounded time, then the bad-input, lane, data-plane, deadline and index tests
# against sanitized builds.
if [ -z "${KVSERVER_SKIP_SANITIZE:-}" ]; then
    scripts/sanitize.sh
fi
