#!/usr/bin/env bash
# Sets up skippyd (scripts/setup.sh) and runs the daemon in the foreground on its embedded default:
# its own redis-server and all state under ./.skippyd, the hot tier in /dev/shm; no root needed once the
# system packages are there. Extra arguments go to `skippyd serve` (see `.venv/bin/skippyd serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
state="${SKIPPYD_STATE_DIR:-$PWD/.skippyd}"
mkdir -p "$state"
sock="${SKIPPYD_SOCKET:-$state/skippyd.sock}"
if (( ${#sock} >= 100 )); then  # unix socket paths are short; fall back to the runtime dir
    sock="${XDG_RUNTIME_DIR:-/tmp}/skippyd-$(id -u).sock"
fi
cat >&2 <<TEXT
skippyd: starting on $sock (state in $state; Ctrl-C stops it). From this checkout, in another terminal:
    .venv/bin/skippyd status
    .venv/bin/skippyd doctor
    .venv/bin/python -c 'import skippyd; print(skippyd.Client().ping())'
  (or 'source .venv/bin/activate' first, then plain 'skippyd status'; elsewhere: export SKIPPYD_SOCKET=$sock)
TEXT
exec .venv/bin/skippyd serve --state-dir "$state" --socket "$sock" --l2-budget "${SKIPPYD_L2_BUDGET:-1GiB}" "$@"
