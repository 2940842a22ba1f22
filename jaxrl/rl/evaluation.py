"""Held-out evaluation through the rollout sampler: greedy accuracy, and sampled accuracy at the
RL temperature (eval.num_samples per problem), plus the task's own breakdown if it has one."""

from __future__ import annotations

import numpy as np

from jaxrl.rl.run import Run
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import Sampler

# The run-seed part of the sampled evaluation's engine seed (RL rounds use (step, round)).
EVAL_SEED = 2**31 - 1
GREEDY = SamplingParams(temperature=0.0)


class Evaluator:
  """`evaluator(params) -> {"eval/...": float}` on the run's held-out records."""

  def __init__(self, run: Run, sampler: Sampler):
    self.run, self.sampler = run, sampler

  def __call__(self, params) -> dict[str, float]:
    run = self.run
    recs = run.held_out
    prompts = run.encode(recs)
    # Every held-out prompt at once: the driver queues what does not fit the slots.
    out, _ = self.sampler(params, prompts, group_size=1, seed=run.seed(), sampling=GREEDY)
    texts = run.completions(out.tokens, out.lengths)
    r, _ = run.score(texts, recs)
    ev = {
      "eval/accuracy": float(np.mean(r)),
      "eval/response_length": float(np.mean(out.lengths)),
    }
    # A task may split its accuracy by kind of problem (arithmetic: carries, careless answers).
    breakdown = getattr(run.task, "eval_breakdown", None)
    if breakdown is not None:
      ev.update({f"eval/{k}": v for k, v in breakdown(recs, texts).items()})
    k = run.cfg.eval.num_samples
    if k:
      # The same seed at every evaluation: the curve compares policies on the same draws.
      out, _ = self.sampler(params, prompts, group_size=k, seed=run.seed(EVAL_SEED))
      texts = run.completions(out.tokens, out.lengths)
      r, _ = run.score(texts, [rec for rec in recs for _ in range(k)])
      ev["eval/sampled_accuracy"] = float(np.mean(r))
    return ev
