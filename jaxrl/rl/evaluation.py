"""Held-out evaluation through the rollout sampler: greedy accuracy, and sampled accuracy at the
RL temperature (eval.num_samples per problem) with unbiased pass@k, plus the task's own
breakdown if it has one."""

from __future__ import annotations

import numpy as np

from jaxrl.rl.run import Run
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import Sampler

# The run-seed part of the sampled evaluation's engine seed (RL rounds use (step, round)).
EVAL_SEED = 2**31 - 1
GREEDY = SamplingParams(temperature=0.0)


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem from `n` samples of which `c` are correct:
  1 - C(n - c, k) / C(n, k), the estimator of "Evaluating Large Language Models Trained on
  Code" (Chen et al., 2021, arXiv:2107.03374), as a product (no huge binomials)."""
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_ks(correct: np.ndarray) -> dict[int, float]:
  """Mean pass@k over problems for k = 1, 2, 4, ... and n, from a [problems, n] bool array."""
  n = correct.shape[1]
  ks = sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n})
  counts = correct.sum(axis=1)
  return {k: float(np.mean([pass_at_k(n, int(c), k) for c in counts])) for k in ks}


class Evaluator:
  """`evaluator(params) -> {"eval/...": float}` on the run's held-out records."""

  def __init__(self, run: Run, sampler: Sampler, *, view=None):
    # `view(params)`: what the sampler reads (`ComputeCast.view`: the matrices in the compute
    # dtype, as the rounds' sampler reads them, so evaluation runs the same engine programs).
    self.run, self.sampler, self.view = run, sampler, view

  def __call__(self, params) -> dict[str, float]:
    run = self.run
    if self.view is not None:
      params = self.view(params)
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
      # A sample is correct when it earns the full reward (1.0; partial credit is not a pass).
      for kk, v in pass_at_ks(np.asarray(r).reshape(len(recs), k) >= 1.0).items():
        ev[f"eval/pass@{kk}"] = v
    return ev
