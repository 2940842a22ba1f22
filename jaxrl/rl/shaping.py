"""Reward shaping on completions: DAPO's soft overlong punishment and truncation masking."""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, *, max_len: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
  """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), scaled by penalty:

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                  if |y| > L_max

  with L_max = max_len (the generation budget) and L_cache = buffer. The penalty grows linearly
  through the buffer, so the policy is told it is getting long before answers get cut. lengths:
  [B] completion lengths (incl. EOS). buffer = 0 disables it (all zeros). Added to the task reward.
  """
  lengths = np.asarray(lengths, np.float64)
  if buffer < 0 or buffer > max_len:
    raise ValueError(f"overlong buffer must be in [0, max_len={max_len}], got {buffer}")
  if buffer == 0:
    return np.zeros(lengths.shape, np.float32)
  start = max_len - buffer
  r = np.where(lengths <= start, 0.0, (start - lengths) / buffer)
  r = np.where(lengths > max_len, -1.0, r)
  return (penalty * r).astype(np.float32)


def truncation_keep(truncated) -> np.ndarray:
  """DAPO overlong filtering (arXiv 2503.14476, §3.4): completions cut at the budget (no EOS)
  carry a reward that judges an unfinished answer, so they are masked out of the loss.
  truncated: [B] bool. Returns [B] float32 row weights (0 = masked)."""
  return (~np.asarray(truncated, bool)).astype(np.float32)
