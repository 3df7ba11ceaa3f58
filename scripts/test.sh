#!/usr/bin/env bash
# The whole test suite from nothing: system packages, .venv, then ruff, mypy and pytest (real redis-server
# processes, real tmpfs files, real sockets); then the transformers tests again against the lowest
# transformers pyproject.toml declares (scripts/transformers-floor-env.sh builds that environment once,
# outside the clone); then the vLLM tier tests (tests_vllm/) in vLLM's own environment
# (scripts/vllm-env.sh builds it once, outside the clone), both against daemons run from .venv.
# Extra arguments go to the main pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
floor_python=$(scripts/transformers-floor-env.sh)
SKIPPYD_DAEMON_PYTHON="$PWD/.venv/bin/python" PYTHONPATH="$PWD" \
    "$floor_python" -m pytest -q tests/test_transformers.py tests/test_transformers_blocks.py
vllm_python=$(scripts/vllm-env.sh)
SKIPPYD_DAEMON_PYTHON="$PWD/.venv/bin/python" PYTHONPATH="$PWD" \
    exec "$vllm_python" -m pytest -c tests_vllm/pytest.ini tests_vllm
