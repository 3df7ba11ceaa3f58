#!/usr/bin/env bash
# SGLang's own virtual environment for the HiCache storage tests (tests_sglang/): SGLang 0.5.23 pins its
# own torch (a CUDA build from PyPI, ~11 GB with its wheels), so it never goes into .venv. Built once and
# kept outside the clone, in ${SKIPPYD_SGLANG_VENV:-~/.cache/skippyd/sglang-venv}; an environment that
# already holds the tested SGLang is used as it is. Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
venv=${SKIPPYD_SGLANG_VENV:-$HOME/.cache/skippyd/sglang-venv}
say() { echo "skippyd sglang-env: $*" >&2; }

ready() {
    [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - "$SGLANG_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version("sglang") == sys.argv[1] and all(md.version(p) for p in ("pytest", "pytest-timeout", "redis")) else 1)
PY
}

if ! ready; then
    python=${PYTHON:-$(command -v python3.11 || command -v python3)}
    say "building $venv with sglang==$SGLANG_VERSION (the first time takes several minutes and ~11 GB)"
    mkdir -p "$(dirname "$venv")"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
    quiet "$venv/bin/python" -m pip install -q --upgrade pip
    quiet "$venv/bin/python" -m pip install -q "sglang==$SGLANG_VERSION" pytest pytest-timeout redis msgpack blake3
    ready || { say "sglang==$SGLANG_VERSION did not install into $venv"; exit 1; }
fi
echo "$venv/bin/python"
