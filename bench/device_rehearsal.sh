#!/usr/bin/env bash
# The device rehearsal (bench/device_rehearsal.py): decode against the HBM roofline and HF
# `generate`, a GRPO train step's MFU, peak memory, compile times and TRL, on one GPU in under
# 8 minutes. Run from anywhere; it works from the repository root.
#
#   bash bench/device_rehearsal.sh            # on the GPU machine: JSON + logs under $OUT
#   bash bench/device_rehearsal.sh --smoke    # on a CPU: the same code path at toy shapes
#
# Writes $OUT/device_rehearsal.json (bench/results/ without $OUT), each phase's log in
# device_rehearsal_logs/ beside it and nvidia-smi's table where there is one. Extra arguments
# go to device_rehearsal.py (--phases, --budget, --batches, ...). TRL, where it is not
# installed, is installed from the wheels in REHEARSAL_WHEELS (default bench/wheels/; no
# network needed) into a temporary prefix, never into the interpreter's own packages. PYTHON picks the interpreter (default:
# .venv/bin/python when there is one, else python3). REHEARSAL_TOTAL_S (default 470) bounds the
# whole run: the phases get what is left after the set-up.
set -uo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
out_dir=${OUT:-bench/results}
mkdir -p "$out_dir"
total=${REHEARSAL_TOTAL_S:-470}
wheels=${REHEARSAL_WHEELS:-bench/wheels}

# One phase at a time owns the device: each may take most of its memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export PYTHONUNBUFFERED=1
"$py" --version
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi 2>&1 | tee "$out_dir/nvidia_smi.txt"
fi

if ! "$py" -c "import trl" >/dev/null 2>&1 && compgen -G "$wheels/*.whl" >/dev/null; then
  prefix=${TMPDIR:-/tmp}/device_rehearsal_trl
  export DEVICE_REHEARSAL_TRL_LOG="$out_dir/trl_install.log"
  echo "installing trl from $wheels into $prefix"
  timeout 120 "$py" -m pip install --no-index --find-links "$wheels" --prefix "$prefix" trl \
    >"$DEVICE_REHEARSAL_TRL_LOG" 2>&1 || tail -5 "$DEVICE_REHEARSAL_TRL_LOG"
  site=$("$py" -c 'import sys, sysconfig
print(sysconfig.get_path("purelib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$prefix")
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

exec "$py" bench/device_rehearsal.py --out "$out_dir/device_rehearsal.json" \
  --deadline "$((total - SECONDS))" "$@"
