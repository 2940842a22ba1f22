#!/usr/bin/env bash
# Creates (once) and activates the repo's .venv with jaxrl and its test dependencies.
# Idempotent: a stamp file records the hash of the packaging files it was built from.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.jaxrl-stamp"
want="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/launch/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[jaxrl] installing dependencies into $VENV (first run only)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU torch wheel must be installed before transformers, or pip resolves a CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
