#!/usr/bin/env bash
# A virtual environment holding the LOWEST transformers that pyproject.toml declares (the floor of the
# `transformers` extra), for running the transformers tests against it: a declared range must be true at
# both ends (.venv tests the newest). Built once and kept outside the clone, in
# ${SKIPPYD_TRANSFORMERS_FLOOR_VENV:-~/.cache/skippyd/transformers-floor-venv}, with torch 2.13.0 (the CPU
# wheel), the floor transformers, skippyd's own dependencies and pytest; skippyd itself is not installed
# there: run the tests with PYTHONPATH set to the clone (its built C extension is used from there).
# An environment that already holds these versions is used as it is. Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
# The floor: the first version the integration supports, the lower bound of pyproject.toml's extra.
FLOOR=$(sed -n 's/^transformers = \[.*"transformers>=\([0-9.]*\),.*$/\1/p' pyproject.toml)
[[ -n "$FLOOR" ]] || { echo "skippyd transformers-floor-env: no transformers>=X in pyproject.toml" >&2; exit 1; }
venv=${SKIPPYD_TRANSFORMERS_FLOOR_VENV:-$HOME/.cache/skippyd/transformers-floor-venv}
say() { echo "skippyd transformers-floor-env: $*" >&2; }

# skippyd's own runtime dependencies, read from pyproject.toml so the two never drift apart
deps=$(python3 - <<'PY'
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
)
ready() {
    [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - "$FLOOR" "$TORCH_VERSION" $deps <<'PY' 2>/dev/null
import importlib.metadata as md, re, sys
floor, torch, *deps = sys.argv[1:]
ok = md.version("transformers") == floor and md.version("torch").split("+")[0] == torch
names = [re.split(r"[<>=!~ \[]", d)[0] for d in deps] + ["pytest", "pytest-timeout", "hypothesis"]
sys.exit(0 if ok and all(md.version(n) for n in names) else 1)
PY
}

if ! ready; then
    python=${PYTHON:-$(command -v python3.11 || command -v python3)}
    say "building $venv with transformers==$FLOOR and torch==$TORCH_VERSION (the first time takes a few minutes)"
    mkdir -p "$(dirname "$venv")"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    # shellcheck disable=SC2086  # $deps is a list of requirement strings without spaces
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" \
        "transformers==$FLOOR" $deps pytest pytest-timeout hypothesis 2>&1 \
        | grep -v -E "is ignored: it is neither a file nor a directory" >&2 || true
    ready || { say "transformers==$FLOOR did not install into $venv"; exit 1; }
fi
echo "$venv/bin/python"
