#!/usr/bin/env bash
# The whole test suite from nothing: system packages, .venv, then ruff, mypy and pytest (real redis-server
# processes, real tmpfs files, real sockets). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
