#!/usr/bin/env bash
# Installs kvserver with its test extra into ./.venv, then runs the linter and the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
