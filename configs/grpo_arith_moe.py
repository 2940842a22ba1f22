"""GRPO with a tiny MoE policy and fp8 rollouts, with and without routing replay (R3).

grpo_arith (the careless-teacher warm-start, the same reward and held-out set) on
`arith_small_moe` (8 experts, top 2), sampled from an fp8 (e4m3, per-channel W8A8) copy of the
attention and dense projections: the sampler's hidden states differ a little from the
learner's, so for some tokens its router picks other experts. The engine records every token's
experts (rl.rollout.routes='record': the learner reports moe/route_agree per layer and routes
itself); ':replay' forces the learner's loss and pi_prox forwards through the recorded experts,
gated by its own router's softmax over them ("Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", R3, arXiv 2510.11370). Token-level TIS corrects the rest of the
mismatch in both variants, so the two differ only in the routing.

Launch:
  bash launch/train.sh --config=configs/grpo_arith_moe.py            # routes recorded
  bash launch/train.sh --config=configs/grpo_arith_moe.py:replay     # routing replay (R3)
  bash launch/train.sh --config=configs/grpo_arith_moe.py:smoke      # (or replay_smoke)

Expected (docs/results.md, seeds 0-2, AMD EPYC AVX2 VM, ~13 min a seed): held-out accuracy
0.656 after SFT -> 0.936 after RL with routes recorded, 0.942 with replay (paired +0.007
[-0.008, +0.021]); replay lowers KL(sampler || learner) by ~44%. On an AMD EPYC with AVX-512
(seeds 0-2, ~12 min a seed there): 0.611 -> 0.857 recorded, 0.887 replay (+0.030 [-0.070,
+0.130]), KL -43%. `:smoke` takes about a minute and only checks that everything moves.
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module

VARIANTS = ("", "replay", "smoke", "replay_smoke")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = arg or ""
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; valid: {VARIANTS}")
  smoke = arg.endswith("smoke")
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(
    "smoke" if smoke else None
  )
  c.workdir = "runs/grpo_arith_moe_" + (arg or "record")
  c.model.preset = "arith_small_moe"
  # The experts' grouped matmul as one batched jnp matmul over row tiles: on a CPU ~3-4x
  # faster than XLA's ragged_dot at this model's shapes, gradients included, same values
  # (bench/grouped_matmul_cpu.py).
  c.model.moe_kernel = "tiled"
  # Keeps the warm-start from collapsing onto a few experts (Switch Transformer's loss).
  c.sft.load_balance_coef = 0.01
  c.rl.rollout.quantize = "fp8"
  c.rl.offpolicy.is_correction = "tis"
  c.rl.rollout.routes = "replay" if arg.startswith("replay") else "record"
  return complete(c)
