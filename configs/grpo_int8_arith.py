"""GRPO on byte-level arithmetic with int8 rollouts: grpo_arith sampling from a W8A8 copy.

Quantize-on-sync (seed technique 3.6, e.g. FP8 rollouts in veRL): at every step the sampler gets
an int8 copy of the policy's projection weights (per-channel scales, per-token int8 activations,
jaxrl.quant); the learner stays float32 and scores the rollouts itself. The sampler-learner gap
is reported every step (rl/logprob_gap, offpolicy/ratio_max) and token-level TIS (truncated at
rl.offpolicy.is_cap = 2) corrects it against a recomputed pi_prox.

Launch:
  bash launch/train.sh --config=configs/grpo_int8_arith.py
  bash launch/train.sh --config=configs/grpo_int8_arith.py:smoke

Expected on a 2-core CPU: see docs/results.md ("int8 rollouts"). `:smoke` runs in well under a
minute and only checks that everything moves.
Its table row was measured before grpo_arith's warm-start recipe changed (then: lr 3e-3, 64
problems x 900 steps; one seed), and rl.steps stays at the 250 those runs used. On the current
recipe the same two changes to grpo_arith (its 200 RL steps) were re-measured over seeds 0-4 on
both of XLA's ISA paths: held-out accuracy against float32, paired by seed, +0.000 [-0.010,
+0.011] (AVX2 path) and +0.005 [-0.011, +0.020] (native AVX-512 path) (docs/results.md, "int8 +
TIS over five seeds").
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "smoke"):
    raise ValueError(f"unknown config variant {arg!r}; valid: '' (full) or 'smoke'")
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(arg or None)
  c.workdir = "runs/grpo_int8_arith_smoke" if arg == "smoke" else "runs/grpo_int8_arith"
  c.rl.rollout.quantize = "int8"
  c.rl.offpolicy.is_correction = "tis"
  if arg != "smoke":
    c.rl.steps = 250
  return complete(c)
