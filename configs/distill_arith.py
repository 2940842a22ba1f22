"""On-policy distillation on byte-level arithmetic: the warm-started model learns from the
GRPO-trained grpo_arith model on its own samples, instead of from rewards.

On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649): the
student samples completions, the teacher scores every sampled token, and the student minimises
the per-token reverse KL(student || teacher) on its own samples: a dense, per-token signal where
GRPO has one 0/1 reward per completion. Student: grpo_arith's 900-step SFT warm-start (the same
params grpo_arith starts RL from), 256 prompts x 1 sample per step. Teacher: grpo_arith's final
model, exported as an HF checkpoint (same architecture and byte vocabulary).

Launch (the teacher first):
  bash launch/train.sh --config=configs/grpo_arith.py
  python -m launch.export --config=configs/grpo_arith.py --out=runs/grpo_arith/hf
  bash launch/train.sh --config=configs/distill_arith.py
  bash launch/train.sh --config=configs/distill_arith.py:smoke   # random teacher, no export

Expected on a 2-core CPU (measured, docs/results.md, seed 0): held-out accuracy 0.797 after the
warm-start -> 0.898 after 100 steps of 256 rollouts (grpo_arith: 0.893 after 100 steps of 512),
about 3 minutes of RL after the ~2-minute warm-start. `:smoke` distils from a randomly
initialised arith_small (a pipeline check only) in about a minute.
Measured before grpo_arith's warm-start recipe changed (then: lr 3e-3, 64 problems x 900
steps, 0.797 on the AVX2 machine that measured it) and not yet re-measured from the
current one (docs/results.md).
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "smoke"):
    raise ValueError(f"unknown config variant {arg!r}; valid: '' (full) or 'smoke'")
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(arg or None)
  c.workdir = "runs/distill_arith_smoke" if arg == "smoke" else "runs/distill_arith"
  if arg != "smoke":
    c.rl.steps = 100
  c.rl.group_size = 1  # no group baseline is needed: the teacher scores every token
  c.rl.prompts_per_step = 256 if arg != "smoke" else 16
  c.rl.optim.learning_rate = 1e-4 if arg != "smoke" else 3e-4
  teacher = dict(path="runs/grpo_arith/hf", preset="", seed=0, dtype="float32")
  if arg == "smoke":
    teacher = dict(path="", preset="arith_small", seed=1, dtype="float32")
  c.distill = dict(
    enabled=True,
    teacher=teacher,
    loss="reverse_kl",
    alpha=0.5,
    top_k=16,
    window=0,
    adaptive=False,
    probe_every=10,
    align_low=0.8,
    align_high=0.95,
  )
  return complete(c)
