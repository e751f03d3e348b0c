#!/usr/bin/env bash
# Installs kvserver with its test extra into ./.venv, runs the linter and the whole suite, then checks
# what a user installs: the built wheel, in a fresh virtual environment (scripts/check_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
scripts/check_wheel.sh
