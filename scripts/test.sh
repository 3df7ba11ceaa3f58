#!/usr/bin/env bash
# The whole test suite from nothing: system packages, .venv, then ruff, mypy and pytest (real redis-server
# processes, real tmpfs files, real sockets); then the vLLM tier tests (tests_vllm/) in vLLM's own
# environment (scripts/vllm-env.sh builds it once, outside the clone), against daemons run from .venv.
# Extra arguments go to the main pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
vllm_python=$(scripts/vllm-env.sh)
SKIPPYD_DAEMON_PYTHON="$PWD/.venv/bin/python" PYTHONPATH="$PWD" \
    exec "$vllm_python" -m pytest -c tests_vllm/pytest.ini tests_vllm
