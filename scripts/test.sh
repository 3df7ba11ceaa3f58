#!/usr/bin/env bash
# The whole test suite from nothing: system packages, .venv, then ruff, mypy and pytest (real redis-server
# processes, real tmpfs files, real sockets); then the transformers tests again against the lowest
# transformers pyproject.toml declares (scripts/transformers-floor-env.sh); then the vLLM tier tests
# (tests_vllm/) in vLLM's own environment and the SGLang HiCache storage tests (tests_sglang/) in SGLang's
# (scripts/vllm-env.sh and scripts/sglang-env.sh); each environment is built once, outside the clone,
# and every daemon runs from .venv.
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
    "$vllm_python" -m pytest -c tests_vllm/pytest.ini tests_vllm
sglang_python=$(scripts/sglang-env.sh)
SKIPPYD_DAEMON_PYTHON="$PWD/.venv/bin/python" PYTHONPATH="$PWD" \
    exec "$sglang_python" -m pytest -c tests_sglang/pytest.ini tests_sglang
