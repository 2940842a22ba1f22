"""GRPO on a long-tailed task: digit chains summed with a scratchpad (task.name='chain').

"3+5+2+8=" -> "8,10,18": the number of terms k follows P(k) ~ k**-2 on [2, 10], so most
completions are 2-6 tokens and a few run to ~27. A synchronous rollout phase waits on those
few; the ':partial' variant keeps 1.5x the step's groups in flight, ends the phase once 64 are
complete and carries the rest (rl.partial, jaxrl.rl.partial). Both train the same loss: the
ratio of every token is taken against the policy version that drew it.

Launch:
  bash launch/train.sh --config=configs/grpo_chain.py            # synchronous rollouts
  bash launch/train.sh --config=configs/grpo_chain.py:partial    # partial rollouts
  bash launch/train.sh --config=configs/grpo_chain.py:smoke      # (or partial_smoke) a minute

Expected (bench/partial_rollouts.py, docs/benchmarks.md, 2026-12-04, seeds 0-4, rollout phases
with a 600-step warm-start held fixed, AMD AVX2 VM): ':partial' completes 1.22x (0.72-1.54) the
groups per second of synchronous rollouts counting compiles, 1.32x (1.07-1.54) without them, in
43% of the decode steps. Over training (docs/results.md, "Partial vs synchronous rollouts on
the chain task", native ISA, the earlier engine): held-out greedy accuracy ends within the
synchronous arm's, paired by seed (+0.002 [-0.025, +0.029], seeds 0-4), in about 0.36x the
decode steps; run alone with this engine (seeds 0-1 only), 1.19x the groups per second over all
60 steps and 1.53x from step 11. A seed takes ~10-15 minutes of SFT and ~3-8 of RL on a
2-core CPU. ':smoke' takes about a minute and only checks that everything moves.
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module

VARIANTS = ("", "partial", "smoke", "partial_smoke")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = arg or ""
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; valid: {VARIANTS}")
  smoke = arg.endswith("smoke")
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(
    "smoke" if smoke else None
  )
  c.workdir = "runs/grpo_chain_" + (arg or "sync")
  c.task = dict(name="chain", min_terms=2, max_terms=10, tail=2.0, held_out_fraction=0.1)
  c.reward = dict(name="final_number", on_error="raise")
  # Correct demonstrations of the scratchpad; long chains are rare in them, as in RL.
  c.sft.careless_rate = 0.0
  c.rl.max_prompt_len = 24  # BOS + "d+d+...+d=" of 10 terms (21) + spare
  c.rl.max_new_tokens = 32  # 9 running sums of up to 2 digits, commas, EOS (27) + spare
  c.rl.rollout.steps_per_call = 4  # a finished slot waits at most 4 steps to be seen
  # Prefill calls of exactly 16 prompts: a resume batch of any count reuses one program per
  # length bucket (padded to powers of two, each count compiled its own, ~2 s apiece here).
  c.rl.rollout.prefill_batch_prompts = 16
  if not smoke:
    c.sft.steps = 600
    # The arithmetic job's 1e-4 unlearns here: the warm-start's errors are not one systematic
    # slip but scattered, so each step's signal is weak and Adam's per-parameter steps of ~lr
    # mostly add noise. Held-out greedy accuracy fell 0.641 -> 0.541 and 0.705 -> 0.477 over
    # 100 steps (seeds 0, 1); at 1e-5 seed 0 rose 0.641 -> 0.676, most of it by step 60.
    c.rl.optim.learning_rate = 1e-5
    c.rl.steps = 60
    c.eval.every = 20
  if arg.startswith("partial"):
    c.rl.partial = dict(enabled=True, over_provision=1.5, max_age=2)
    # The synchronous arm's slots (CoPRIS's fixed concurrency): the 1.5x groups in flight
    # queue for them. A slot per in-flight sample makes every decode step 1.5x dearer on a
    # CPU, where an idle slot costs what a live one does.
    c.rl.rollout.slots = c.rl.prompts_per_step * c.rl.group_size
  return complete(c)
