#!/usr/bin/env bash
# The whole test suite from nothing: system packages, .venv, then ruff, mypy and pytest (real redis-server
# processes, real tmpfs files, real sockets); then the vLLM tier tests (tests_vllm/) in vLLM's own
# environment and the SGLang HiCache storage tests (tests_sglang/) in SGLang's (scripts/vllm-env.sh and
# scripts/sglang-env.sh build them once, outside the clone), against daemons run from .venv.
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
    "$vllm_python" -m pytest -c tests_vllm/pytest.ini tests_vllm
sglang_python=$(scripts/sglang-env.sh)
SKIPPYD_DAEMON_PYTHON="$PWD/.venv/bin/python" PYTHONPATH="$PWD" \
    exec "$sglang_python" -m pytest -c tests_sglang/pytest.ini tests_sglang
