"""GRPO on a small code task, rewarded by running the completion against tests in the sandbox.

The prompt shows f at x = 0, 1, 2 and opens `def f(x):return `; the model writes the body
("3*x+2"), and `code_tests` runs it with four tests at unseen inputs in a sandboxed process
(jaxrl.rewards.sandbox: namespaces where the host allows them, CPU/wall/memory/file/process
limits always): 1.0 iff all four pass. Coefficients in [-20, 20], linear f (task.name='functions').

Launch:
  bash launch/train.sh --config=configs/grpo_code.py
  bash launch/train.sh --config=configs/grpo_code.py:quadratic  # room for RL (see below)
  bash launch/train.sh --config=configs/grpo_code.py:smoke      # about a minute

Every distinct completion is a process: ~30-60 ms each on a 2-core CPU, `reward.sandbox.workers`
at a time (identical programs in a batch run once, `reward.sandbox.dedupe`: on ':quadratic' about
half of a step's 512 are copies, and its rollout + scoring went from ~8.2 s to ~5.8 s a step).
Expected (docs/results.md, "The code task", seed 0 only, not a claim over seeds): held-out 0.969
after the warm-start, with a training reward of ~1.0 from the first RL step: GRPO has little left
to do on this task.
':quadratic' (f = c*x*x + a*x + b, coefficients in [-9, 9], a 600-step warm-start) leaves room:
seed-0 probes gave held-out 0.10 greedy after 300 warm-start steps, 0.71 greedy / 0.30 sampled
after 600 (0.94 greedy after 1,200), training reward 0.33 at RL step 1; 100 GRPO steps from it,
seeds 0-4 (native ISA, AMD EPYC with AVX-512): greedy 0.681 -> 0.736 (0.688-0.766), gain
+0.055 [+0.010, +0.099]; sampled 0.373 -> 0.420 (0.344-0.496), gain +0.048 [+0.010, +0.085];
the training reward up on every seed. On XLA's AVX2 path, the same seeds: greedy 0.686 -> 0.755
(0.727-0.781), gain +0.069 [+0.023, +0.115]; sampled gain +0.044 [+0.034, +0.053]; paired with
native, greedy gain +0.014 [-0.022, +0.050]. ':smoke' only checks that everything moves.
"""

from pathlib import Path

import ml_collections

from jaxrl.config import complete, config_module

VARIANTS = ("", "quadratic", "smoke")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = arg or ""
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; valid: {VARIANTS}")
  smoke = arg == "smoke"
  c = config_module(Path(__file__).with_name("grpo_arith.py")).get_config(
    "smoke" if smoke else None
  )
  c.workdir = "runs/grpo_code" + (f"_{arg}" if arg else "")
  c.task = dict(name="functions", max_coef=20, max_degree=1, held_out_fraction=0.1)
  if arg == "quadratic":
    c.task.update(max_coef=9, max_degree=2)
  # A completion that does not compile or fails a test scores 0 (not an error); only a sandbox
  # that cannot start is one, and it should stop the run.
  c.reward = dict(
    name="code_tests",
    on_error="raise",
    sandbox=dict(isolation="auto", cpu_s=2, wall_s=5.0, memory_mb=512, workers=2),
  )
  c.sft.careless_rate = 0.0  # correct demonstrations: the canonical body of f
  c.rl.max_prompt_len = 48  # BOS + "f(0)=-20,f(1)=-40,f(2)=-60\ndef f(x):return " (44) + spare
  c.rl.max_new_tokens = 16  # "-20*x-20" + EOS (9) + spare
  c.eval.num_examples = 128  # of the ~168 held-out problems
  if smoke:
    c.eval.num_examples = 32
  else:
    c.sft.steps = 600 if arg == "quadratic" else 1200
    c.rl.steps = 100
    c.rl.optim.learning_rate = 3e-5  # 1e-4 lost greedy accuracy on seeds 0-2 (docs/results.md)
    c.eval.every = 20
  return complete(c)
