"""Per-step rollout allocation: DAPO's dynamic-sampling filter on groups and the batch it fills."""

from __future__ import annotations

import numpy as np


def informative_groups(rewards) -> np.ndarray:
  """[num_groups, G] rewards -> [num_groups] bool: the group's rewards are not all equal.

  An all-equal group has zero group-relative advantage under every registered estimator, so it
  only dilutes the batch (DAPO, Yu et al. 2025, arXiv 2503.14476, §3.2 "dynamic sampling", eq. 11:
  0 < |{o_i correct}| < G). Exact equality, as the estimators' own tie test.
  """
  r = np.asarray(rewards)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [num_groups, G], got shape {r.shape}")
  return np.max(r, axis=1) != np.min(r, axis=1)


def fill_groups(informative, need: int) -> tuple[np.ndarray, np.ndarray]:
  """Pick `need` groups from those sampled so far (in sampling order): informative ones first.

  Returns (indices [need] into the sampled groups, filler [need] bool). When fewer than `need`
  groups are informative (the round cap was hit), the batch is filled with the earliest
  all-equal groups and `filler` marks them: the caller gives them zero loss weight, so the batch
  keeps its shape (the train step compiles once) but only informative groups carry loss.
  """
  informative = np.asarray(informative, bool)
  if informative.size < need:
    raise ValueError(f"need {need} groups, only {informative.size} were sampled")
  good = np.flatnonzero(informative)[:need]
  rest = np.flatnonzero(~informative)[: need - good.size]
  idx = np.concatenate([good, rest]).astype(np.int64)
  filler = np.arange(need) >= good.size
  return idx, filler


# ------------------------------------------------------------------ in-step allocation (rounds)
# A step's budget of B = prompts_per_step * group_size samples is spent in rounds: every prompt
# first gets `initial` samples, then an allocator reads the rewards so far and gives the rest to
# the prompts whose rewards vary. Every function here is pure and deterministic: ties go to the
# lower prompt index, and the budget is spent exactly (the batch keeps B rows).


def reward_variance(rewards: list[np.ndarray]) -> np.ndarray:
  """[P] population variance of each prompt's rewards so far (0 for fewer than 2)."""
  return np.array([float(np.var(r)) if len(r) > 1 else 0.0 for r in rewards])


def _give(order, counts, cap: int, budget: int, per: int, once: bool) -> np.ndarray:
  """Extra samples: `per` at a time to prompts in `order`, capped at `cap` samples each, until
  `budget` is spent (once: each prompt at most once)."""
  extra = np.zeros(len(counts), np.int64)
  while budget > 0:
    gave = False
    for i in order:
      room = cap - counts[i] - extra[i]
      k = min(per, room, budget)
      if k <= 0:
        continue
      extra[i] += k
      budget -= k
      gave = True
      if budget == 0:
        break
    if once or not gave:
      break
  return extra


def vigor_round(
  rewards: list[np.ndarray], counts, *, budget: int, increment: int, cap: int, last: bool
) -> np.ndarray:
  """VIGOR (VarIance Guided Online Rollout allocation): this round's `budget` goes `increment`
  samples at a time, round after round, to the prompts whose rewards vary so far, in descending
  order of their variance, each up to `cap`; prompts whose rewards all tie get none (their
  group has no gradient). What the varying prompts cannot take waits for the next round, whose
  samples may show more of them varying; on the `last` round it goes to the tied prompts, in
  index order, so the step's budget is spent and the batch keeps its shape."""
  var = reward_variance(rewards)
  counts = np.asarray(counts)
  varying = sorted((i for i in range(len(counts)) if var[i] > 0), key=lambda i: (-var[i], i))
  extra = _give(varying, counts, cap, budget, increment, once=False)
  rest = budget - int(extra.sum())
  if last and rest:
    tied = [i for i in range(len(counts)) if var[i] == 0]
    extra += _give(tied, counts + extra, cap, rest, increment, once=False)
  return extra


def pilot_commit(rewards: list[np.ndarray], counts, *, budget: int, cap: int) -> np.ndarray:
  """Pilot-Commit's commit stage: after the pilot (the first round), the remaining `budget`
  goes one sample at a time, round-robin, to the prompts whose pilot rewards vary (the
  high-leverage ones), in descending order of that variance; prompts that tied are skipped.
  Only when every varying prompt has reached `cap` (or none varies) do the others get the
  rest, so the budget is spent and the batch keeps its shape."""
  var = reward_variance(rewards)
  counts = np.asarray(counts)
  varying = sorted((i for i in range(len(counts)) if var[i] > 0), key=lambda i: (-var[i], i))
  extra = _give(varying, counts, cap, budget, 1, once=False)
  rest = budget - int(extra.sum())
  if rest:
    others = [i for i in range(len(counts)) if var[i] == 0]
    extra += _give(others, counts + extra, cap, rest, 1, once=False)
  return extra
