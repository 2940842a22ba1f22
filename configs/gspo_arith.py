"""GSPO on byte-level arithmetic: grpo_arith with the sequence-level clipped ratio.

GSPO (Zheng et al. 2025, arXiv 2507.18071): the ratio is the length-normalised sequence ratio
(pi(y) / pi_old(y))^(1/|y|), clipped as a whole to the paper's narrow range [1 - 3e-4, 1 + 4e-4],
with the sequence-mean of token-means aggregation of the paper's objective.

Launch:
  bash launch/train.sh --config=configs/gspo_arith.py
  bash launch/train.sh --config=configs/gspo_arith.py:smoke

Expected on a 2-core CPU (measured, docs/results.md, seed 0): the cost per step equals
grpo_arith's (about 6.5 minutes); from grpo_arith's warm-start (0.797 held-out accuracy) to 0.914
after 250 RL steps (grpo_arith: 0.910). With one PPO epoch the sequence clip only acts across
mini-batches. `:smoke` runs in well under a minute and only checks that everything moves.
Measured before grpo_arith's warm-start recipe changed (then: lr 3e-3, 64 problems x 900
steps, 0.797 on the AVX2 machine that measured it; now docs/results.md's seed sweep) and
not yet re-measured from the current one; rl.steps stays at the 250 those runs used.
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "smoke"):
    raise ValueError(f"unknown config variant {arg!r}; valid: '' (full) or 'smoke'")
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(arg or None)
  c.workdir = "runs/gspo_arith_smoke" if arg == "smoke" else "runs/gspo_arith"
  c.rl.loss.name = "gspo"
  c.rl.loss.eps_low = 3e-4
  c.rl.loss.eps_high = 4e-4
  c.rl.loss.aggregation = "seq-mean-token-mean"
  if arg != "smoke":
    c.rl.steps = 250
  return complete(c)
