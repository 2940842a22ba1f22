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
