#!/usr/bin/env bash
# Installs kvserver with its test extra into ./.venv (and SGLang's and vLLM's code, for the integration tests),
# runs the linter and the whole suite, then checks what a user installs: the built wheel, in a fresh
# virtual environment (scripts/check_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
scripts/install_sglang.sh  # SGLang 0.5.23 without its dependencies, for the integration tests
scripts/install_vllm.sh  # vLLM 0.33.0's Python code without its dependencies (after SGLang's packages)
.venv/bin/ruff check .
# Two workers (the machine's two cores), each running whole files; the modules that run daemons on
# the node's default socket and port take a lock (tests/conftest.py: default_socket_lock).
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
scripts/check_wheel.sh
