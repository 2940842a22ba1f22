"""GRPO with a calculator tool: 3-digit multiplication, which the tiny model cannot do in its
head, and a GSM8K-style calculator it can call in the middle of its answer.

The model writes "<<123*45=" (a turn ends at '='); the calculator environment
(jaxrl.rollout.multiturn.CalculatorEnv, rl.rollout.env='calculator') answers "5535>>", fed
back as tokens the loss leaves out; the model then writes the answer. The warm-start's
demonstrations use the call in `sft.tool_rate` of the problems and answer the rest in one go;
the reward (final_number: the last number written) is the same either way, so GRPO can only
raise accuracy by calling the tool more often and copying its answer.

Launch:
  bash launch/train.sh --config=configs/grpo_calculator.py
  bash launch/train.sh --config=configs/grpo_calculator.py:smoke      # about a minute

Expected (docs/results.md, "Tool use", seeds 0-4 on a 2-core AMD EPYC with AVX-512): held-out
greedy accuracy 0.450 (0.430-0.471) after the warm-start, 0.998 (0.992-1.000) after the 100 RL
steps, at least 0.992 at every evaluation from RL step 20 on; the calculator called in 160
(138-180) of 512 episodes at RL step 1, 505 (501-511) at step 100. XLA's AVX2 path, seeds 0-4:
0.461 (0.441-0.484) -> 0.999 (0.998-1.000). A run (warm-start included)
takes ~22 minutes on that CPU, two at a time. ':smoke' (1- and 2-digit products) only checks
that everything moves. The control `--config.sft.tool_rate=0.0` (no demonstration shows the
call; seeds 0-2, native path): the calculator is never called and RL gains -0.007 (-0.027 to
+0.012), 0.305 -> 0.298.
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "smoke"):
    raise ValueError(f"unknown config variant {arg!r}; valid: '' (full) or 'smoke'")
  smoke = arg == "smoke"
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(arg or None)
  c.workdir = "runs/grpo_calculator_smoke" if smoke else "runs/grpo_calculator"
  c.task = dict(name="arithmetic", max_digits=3, ops="*", held_out_fraction=0.1,
                allow_negative=False, operand_dist="by_digits")  # fmt: skip
  c.reward = dict(name="final_number", on_error="raise")
  c.sft.careless_rate = 0.0
  c.sft.tool_rate = 0.3
  c.rl.max_prompt_len = 10  # BOS + "999*999=" + 1 spare
  # "<<999*999=" (10) + "998001>>" (8, the tool's) + "998001" + EOS (7) + spare
  c.rl.max_new_tokens = 32
  c.rl.rollout.env = "calculator"
  c.rl.rollout.max_turns = 2
  c.rl.rollout.turn_tokens = 12
  if smoke:
    c.task.max_digits = 2
    # Prefill calls of exactly 16 prompts: the tool's answers come back to be prefilled in every
    # count, and each count compiled a program of its own (63 -> 37 s for the smoke, cold).
    c.rl.rollout.prefill_batch_prompts = 16
  else:
    c.rl.steps = 100
    c.eval.every = 10
  return complete(c)
