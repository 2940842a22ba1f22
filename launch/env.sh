#!/usr/bin/env bash
# Creates (once) and activates the repo's .venv.
#   source launch/env.sh [runtime]  jaxrl and its runtime dependencies (launch/train.sh)
#   source launch/env.sh test       and the [test] extra: pytest, ruff, torch, transformers, ...
#                                   (launch/test.sh)
# Idempotent: a stamp file per layer records the hash of the packaging files it was built from;
# the test layer holds the runtime one, so either script run after the other installs nothing
# it already has.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.jaxrl-stamp"
TEST_STAMP="$VENV/.jaxrl-test-stamp"
want="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/launch/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ "${1:-}" = test ] && [ "$(cat "$TEST_STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[jaxrl] installing jaxrl and its test dependencies into $VENV (first run only)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU torch wheel must be installed before transformers, or pip resolves a CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  echo "$want" > "$STAMP"
  echo "$want" > "$TEST_STAMP"
elif [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[jaxrl] installing jaxrl into $VENV (first run only)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
