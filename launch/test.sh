#!/usr/bin/env bash
# Quickstart 2: run the test suite (installs jaxrl and the [test] extra into .venv on first use).
# Extra arguments go to pytest.
#   bash launch/test.sh            # every tier: what CI runs
#   bash launch/test.sh --fast     # the unit and integration tiers, for the edit-test loop
# The tiers and their times: tests/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh" test
cd "$ROOT"
# libtpu, the version jax[tpu] pins, beside the venv (never imported by it): the TPU compile
# tests (tests/kernels/tpu_compile_test.py) hand it to child processes to compile the Pallas
# TPU kernels for real TPU generations on this CPU.
export JAXRL_LIBTPU_DIR="$ROOT/.venv/libtpu"
libtpu_spec="$(python - <<'PY'
import importlib.metadata as md
print(next(r.split(";")[0].replace(" ", "") for r in md.requires("jax") if r.startswith("libtpu") and 'extra == "tpu"' in r))
PY
)"
if [ "$(cat "$JAXRL_LIBTPU_DIR/.spec" 2>/dev/null)" != "$libtpu_spec" ]; then
  echo "[jaxrl] installing $libtpu_spec into $JAXRL_LIBTPU_DIR (first run only)" >&2
  rm -rf "$JAXRL_LIBTPU_DIR"
  python -m pip install -q --no-deps --target "$JAXRL_LIBTPU_DIR" "$libtpu_spec"
  echo "$libtpu_spec" > "$JAXRL_LIBTPU_DIR/.spec"
fi
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not e2e"); else args+=("$a"); fi
done
ruff check jaxrl configs launch tests bench
ruff format --check jaxrl configs launch tests bench
# --dist loadgroup: the tests that share one expensive module fixture (an end-to-end job asserted
# by several tests) carry one xdist_group and run on one worker; everything else spreads.
exec python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder -q "${args[@]}"
