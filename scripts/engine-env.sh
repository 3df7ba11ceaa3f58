#!/usr/bin/env bash
# An engine's own virtual environment for its integration tests: vLLM and SGLang each pin their own torch
# (a CUDA build from PyPI, ~10 GB with its wheels), so neither ever goes into .venv. Built once and kept
# outside the clone; an environment that already holds the tested version is used as it is. Prints the
# environment's python. The version is the one pyproject.toml's extra of the same name pins.
#   scripts/engine-env.sh PACKAGE VENV SIZE      (scripts/vllm-env.sh and scripts/sglang-env.sh call it)
set -euo pipefail
cd "$(dirname "$0")/.."

package=$1 venv=$2 size=$3
say() { echo "skippyd $package-env: $*" >&2; }
version=$(sed -n "s/^$package = \\[\"$package==\\([0-9.]*\\)\"\\]\$/\\1/p" pyproject.toml)
[[ -n "$version" ]] || { say "pyproject.toml pins no $package==X in an extra named $package"; exit 1; }

ready() {
    [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - "$package" "$version" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version(sys.argv[1]) == sys.argv[2] and all(md.version(p) for p in ("pytest", "pytest-timeout", "redis")) else 1)
PY
}

if ! ready; then
    python=${PYTHON:-$(command -v python3.11 || command -v python3)}
    say "building $venv with $package==$version (the first time takes several minutes and $size)"
    mkdir -p "$(dirname "$venv")"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
    quiet "$venv/bin/python" -m pip install -q --upgrade pip
    quiet "$venv/bin/python" -m pip install -q "$package==$version" pytest pytest-timeout redis msgpack blake3
    ready || { say "$package==$version did not install into $venv"; exit 1; }
fi
echo "$venv/bin/python"
