"""PPO with a critic on byte-level arithmetic: one sample per prompt, GAE advantages.

PPO (Schulman et al. 2017, arXiv 1707.06347) as in RLHF practice (Ouyang et al. 2022; verl's
`adv_estimator=gae`): a value model initialised from the warm-started policy (scalar head at zero)
and trained alongside it with the clipped value loss, GAE(gamma = 1, lambda = 0.95) on the
terminal exact-match reward, whitened advantages, PPO-clip eps = 0.2, and 5 critic warm-up steps
during which only the critic trains. No groups: 512 prompts x 1 sample per step (the same 512
rollouts per step as grpo_arith's 64 x 8); the critic is the baseline.

Launch:
  bash launch/train.sh --config=configs/ppo_arith.py
  bash launch/train.sh --config=configs/ppo_arith.py:smoke

Expected on a 2-core CPU (measured, docs/results.md, seed 0): from grpo_arith's warm-start
(0.797 held-out accuracy) to 0.945 after 250 RL steps (grpo_arith: 0.910); the critic adds a
forward for the values and a train step per update, about 1.5x grpo_arith's RL time.
`:smoke` runs in well under a minute and only checks that everything moves.
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
  c.workdir = "runs/ppo_arith_smoke" if arg == "smoke" else "runs/ppo_arith"
  c.rl.advantage = "gae"
  c.rl.prompts_per_step *= c.rl.group_size  # same rollouts per step, one per prompt
  c.rl.group_size = 1
  c.rl.critic = dict(
    learning_rate=1e-4 if arg != "smoke" else 1e-3,
    warmup_steps=5 if arg != "smoke" else 2,
    value_clip=0.2,
    gamma=1.0,
    lam=0.95,
    whiten=True,
    grad_clip=1.0,
  )
  if arg != "smoke":
    c.rl.steps = 250
  return complete(c)
