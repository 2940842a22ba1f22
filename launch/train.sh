#!/usr/bin/env bash
# Quickstart 1: train the embedded default (tiny model, arithmetic, SFT warm-start then GRPO) on CPU.
# Installs jaxrl and its runtime dependencies into .venv on first use (not the test stack).
# Extra arguments go to launch/train.py, e.g. --config=configs/grpo_arith.py:smoke --config.rl.kl.beta=0.0
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh" runtime
cd "$ROOT"
if [[ " $* " != *" --config="* ]]; then
  set -- --config=configs/grpo_arith.py "$@"
fi
exec python -m launch.train "$@"
