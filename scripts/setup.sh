#!/usr/bin/env bash
# Prepares a fresh Debian machine for skippyd: the system packages it uses (redis-server for the embedded
# Redis; redis-tools and systemd for the test suite), then a virtual environment in .venv with skippyd,
# torch (CPU wheel, pinned) and, with --dev, the test tools. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[[ "${1:-}" == "--dev" ]] && dev=1

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "skippyd setup: need root (or sudo) to run: $*" >&2; return 1; fi
}

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
if [[ $dev -eq 1 ]]; then
    command -v systemd-analyze >/dev/null || missing+=(systemd)
fi
python=${PYTHON:-}
if [[ -z "$python" ]]; then
    python=$(command -v python3.11 || command -v python3)
fi
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then missing+=(python3-venv); fi
if ((${#missing[@]})); then
    echo "skippyd setup: installing ${missing[*]}" >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
    "$python" -m venv .venv
fi
extras="torch"
[[ $dev -eq 1 ]] && extras="torch,dev,transformers"  # the test suite runs real transformers models
# torch is pinned so pip takes the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[${extras}]" 2>&1 \
    | grep -v -E "is ignored: it is neither a file nor a directory" >&2 || true
.venv/bin/python -c "import skippyd, torch" || { echo "skippyd setup: install failed" >&2; exit 1; }
