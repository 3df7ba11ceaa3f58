#!/usr/bin/env bash
# vLLM's own virtual environment for the tier tests (tests_vllm/): vLLM (the version pyproject.toml's
# `vllm` extra pins) pins its own torch, so it never goes into .venv. Built once, in
# ${SKIPPYD_VLLM_VENV:-~/.cache/skippyd/vllm-venv}, by scripts/engine-env.sh. Prints the environment's python.
set -euo pipefail
exec "$(dirname "$0")/engine-env.sh" vllm "${SKIPPYD_VLLM_VENV:-$HOME/.cache/skippyd/vllm-venv}" "~10 GB"
