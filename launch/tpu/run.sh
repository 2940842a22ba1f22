#!/usr/bin/env bash
# Train on a Cloud TPU VM: ship this checkout (git HEAD), install it with jax[tpu] on every
# worker, start launch.train there. Needs gcloud. See `python -m launch.remote tpu --help`.
#   bash launch/tpu/run.sh --name=my-tpu --zone=us-central2-b --accelerator=v4-8 --create \
#       --config=configs/grpo_gsm8k.py [--dry-run] [-- --config.rl.steps=200]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
exec "${PYTHON:-python3}" -m launch.remote tpu "$@"
