#!/usr/bin/env bash
# Prepares a fresh Debian machine for skippyd: the system packages it uses (redis-server for the embedded
# Redis; redis-tools and systemd for the test suite), then a virtual environment in .venv with skippyd,
# torch (CPU wheel, pinned) and, with --dev, the test tools. Safe to run again: it only adds what is
# missing, and skips pip entirely when nothing it installs from has changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[[ "${1:-}" == "--dev" ]] && dev=1

say() { echo "skippyd setup: $*" >&2; }

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        say "need root (or sudo) to run: $*"; return 1; fi
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
    say "installing ${missing[*]} (apt-get)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv with $("$python" --version 2>&1)"
    "$python" -m venv .venv
fi
extras="torch"
[[ $dev -eq 1 ]] && extras="torch,dev,transformers"  # the test suite runs real transformers models
# What the install depends on: when none of it changed since the last install and the extras installed
# then include these, pip is not run at all (a restart of run.sh takes seconds).
stamp=".venv/.skippyd-setup"
wanted=$({ .venv/bin/python --version; cat pyproject.toml setup.py skippyd/_native/chain.c; } | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" ]] && .venv/bin/python - "$stamp" "$wanted" "$extras" <<'PY' && .venv/bin/python -c "import skippyd, torch" 2>/dev/null
import sys
lines = open(sys.argv[1]).read().split()
sys.exit(0 if len(lines) == 2 and lines[0] == sys.argv[2] and set(sys.argv[3].split(",")) <= set(lines[1].split(",")) else 1)
PY
then
    exit 0
fi
if [[ ! -f "$stamp" ]]; then
    say "installing skippyd with torch 2.13.0 (CPU) and [$extras] into .venv: the first time takes a few minutes"
else
    say "pyproject.toml, setup.py or the C extension changed: updating .venv"
fi
# torch is pinned so pip takes the CPU wheel; an unpinned torch pulls a multi-GB CUDA build. The editable
# install is in "compat" mode (a path in a .pth file), so a program run next to a clone named skippyd still
# imports this package, not that directory.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" \
    --config-settings editable_mode=compat -e ".[${extras}]" 2>&1 \
    | grep -v -E "is ignored: it is neither a file nor a directory" >&2 || true
.venv/bin/python -c "import skippyd, torch" || { say "install failed"; exit 1; }
echo "$wanted $extras" > "$stamp"
say "done: .venv/bin/skippyd and .venv/bin/python are ready"
