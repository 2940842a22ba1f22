#!/usr/bin/env bash
# Train on one GPU host over ssh: ship this checkout (git HEAD), install it with jax[cuda],
# start launch.train there on all (or --gpus) of its GPUs. See `python -m launch.remote gpu --help`.
#   bash launch/gpu/run.sh --host=me@gpu-box --config=configs/grpo_gsm8k.py [--dry-run] \
#       [-- --config.rl.steps=200]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
exec "${PYTHON:-python3}" -m launch.remote gpu "$@"
