#!/usr/bin/env bash
# vLLM's own virtual environment for the tier tests (tests_vllm/): vLLM 0.33.0 pins its own torch (a CUDA
# build from PyPI, ~9.5 GB with its wheels), so it never goes into .venv. Built once and kept outside the
# clone, in ${SKIPPYD_VLLM_VENV:-~/.cache/skippyd/vllm-venv}; an environment that already holds the
# tested vLLM is used as it is. Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0
venv=${SKIPPYD_VLLM_VENV:-$HOME/.cache/skippyd/vllm-venv}
say() { echo "skippyd vllm-env: $*" >&2; }

ready() {
    [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version("vllm") == sys.argv[1] and all(md.version(p) for p in ("pytest", "pytest-timeout", "redis")) else 1)
PY
}

if ! ready; then
    python=${PYTHON:-$(command -v python3.11 || command -v python3)}
    say "building $venv with vllm==$VLLM_VERSION (the first time takes several minutes and ~10 GB)"
    mkdir -p "$(dirname "$venv")"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
    quiet "$venv/bin/python" -m pip install -q --upgrade pip
    quiet "$venv/bin/python" -m pip install -q "vllm==$VLLM_VERSION" pytest pytest-timeout redis msgpack blake3
    ready || { say "vllm==$VLLM_VERSION did not install into $venv"; exit 1; }
fi
echo "$venv/bin/python"
