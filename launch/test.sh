#!/usr/bin/env bash
# Quickstart 2: run the test suite (installs into .venv on first use). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh"
cd "$ROOT"
ruff check jaxrl configs launch tests bench
ruff format --check jaxrl configs launch tests bench
exec python -m pytest -n 2 -q "$@"
