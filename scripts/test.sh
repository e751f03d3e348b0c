#!/usr/bin/env bash
# Installs kvserver with its test extra into ./.venv (and SGLang's code, for the integration tests),
# runs the linter and the whole suite, then checks what a user installs: the built wheel, in a fresh
# virtual environment (scripts/check_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
scripts/install_sglang.sh  # SGLang 0.5.23 without its dependencies, for the integration tests
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
scripts/check_wheel.sh
