#!/usr/bin/env bash
# SGLang's own virtual environment for the HiCache storage tests (tests_sglang/): SGLang (the version
# pyproject.toml's `sglang` extra pins) pins its own torch, so it never goes into .venv. Built once, in
# ${SKIPPYD_SGLANG_VENV:-~/.cache/skippyd/sglang-venv}, by scripts/engine-env.sh. Prints the environment's
# python.
set -euo pipefail
exec "$(dirname "$0")/engine-env.sh" sglang "${SKIPPYD_SGLANG_VENV:-$HOME/.cache/skippyd/sglang-venv}" "~11 GB"
