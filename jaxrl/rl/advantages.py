"""Advantage estimators on grouped rewards: registered pure functions with masks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.registry import ADVANTAGES as ESTIMATORS
from jaxrl.rl import value

# Every advantage kind is in one registry, with two traits: `groupless` (works with
# group_size = 1; every other estimator baselines within the group) and `needs_critic` (reads a
# value model: the critic calls it on per-token rewards and values, jaxrl.rl.critic).
# A group estimator is called as fn(rewards [num_groups, G], mask=None, **options) and returns
# [num_groups, G] float32 with zeros at masked entries. Callers pass one common set of options
# (e.g. scale_by_std), so each estimator ignores the ones it does not use via **_.

ESTIMATORS.register("gae", needs_critic=True, groupless=True)(value.gae)


def _prepare(rewards, mask):
  rewards = jnp.asarray(rewards, jnp.float32)
  mask = jnp.ones_like(rewards, bool) if mask is None else jnp.asarray(mask, bool)
  m = mask.astype(jnp.float32)
  return rewards, mask, m, jnp.sum(m, axis=-1, keepdims=True)


def _centred(values, m, axis):
  """v - mean(valid v), zero at masked entries, and exactly zero when the valid values all tie:
  a float32 mean of equal values (3 x 0.1) can miss them by an ulp, and dividing that residue by
  an equally tiny std would turn a no-signal group into +-1 advantages."""
  n = jnp.sum(m, axis=axis, keepdims=True)
  mean = jnp.sum(values * m, axis=axis, keepdims=True) / jnp.maximum(n, 1.0)
  hi = jnp.max(jnp.where(m > 0, values, -jnp.inf), axis=axis, keepdims=True)
  lo = jnp.min(jnp.where(m > 0, values, jnp.inf), axis=axis, keepdims=True)
  return jnp.where(hi == lo, 0.0, (values - mean) * m)


@ESTIMATORS.register("grpo")
def grpo(rewards, mask=None, *, eps: float = 1e-6, scale_by_std: bool = True, **_) -> jax.Array:
  """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 3 / §4.1.2):
  A_i = (r_i - mean(r_group)) / (std(r_group) + eps), std with Bessel's correction as in TRL/verl.

  rewards, mask: [num_groups, G] (mask marks real samples; groups may be ragged). Returns [.., G];
  groups with a single sample or all-equal rewards get zero advantage.
  """
  rewards, mask, m, n = _prepare(rewards, mask)
  centred = _centred(rewards, m, -1)
  adv = centred
  if scale_by_std:
    var = jnp.sum(centred**2, axis=-1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
    adv = centred / (jnp.sqrt(var) + eps)
  return jnp.where(mask & (n > 1), adv, 0.0)


@ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards, mask=None, **_) -> jax.Array:
  """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783):
  A_i = r_i - mean(r_group). Dropping GRPO's 1/std removes its question-difficulty bias (groups
  with a small spread no longer get up-weighted). scale_by_std is ignored on purpose.
  """
  rewards, mask, m, n = _prepare(rewards, mask)
  return jnp.where(mask & (n > 1), _centred(rewards, m, -1), 0.0)


@ESTIMATORS.register("rloo")
def rloo(rewards, mask=None, **_) -> jax.Array:
  """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740; Kool 2019):
  A_i = r_i - (1 / (n - 1)) sum_{j != i} r_j = n / (n - 1) * (r_i - mean(r_group)), with n the
  number of valid samples of the group. A baseline that excludes r_i keeps the gradient unbiased.
  Groups with fewer than two valid samples have no baseline and get zero advantage.
  """
  rewards, mask, m, n = _prepare(rewards, mask)
  adv = _centred(rewards, m, -1) * n / jnp.maximum(n - 1.0, 1.0)
  return jnp.where(mask & (n > 1), adv, 0.0)


def whiten(values, mask=None, eps: float = 1e-6) -> jax.Array:
  """The one whitening of jaxrl: (v - mean) / (std + eps) over every valid entry (any shape),
  std Bessel-corrected (n - 1, as TRL and verl), exactly 0 where the valid values all tie or
  there is at most one. REINFORCE++'s global normalisation and PPO's GAE advantages use it."""
  values = jnp.asarray(values, jnp.float32)
  mask = jnp.ones_like(values, bool) if mask is None else jnp.asarray(mask, bool)
  m = mask.astype(jnp.float32)
  n = jnp.sum(m)
  centred = _centred(values, m, None)
  std = jnp.sqrt(jnp.sum(centred**2) / jnp.maximum(n - 1.0, 1.0))
  return jnp.where(mask & (n > 1), centred / (std + eps), 0.0)


@ESTIMATORS.register("reinforce_pp", groupless=True)
def reinforce_pp(rewards, mask=None, *, eps: float = 1e-6, **_) -> jax.Array:
  """REINFORCE++ (Hu 2025, arXiv 2501.03262, "global advantage normalization"):
  A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps), statistics over every valid sample of the
  batch, ignoring the grouping. Global normalisation is less noisy than per-prompt statistics and
  does not over-weight low-spread prompts. Outcome rewards only: a per-token KL penalty folded into
  the reward (kl.kl_in_reward) would be summed into r_i by the caller first.
  """
  rewards, mask, _, _ = _prepare(rewards, mask)
  return whiten(rewards, mask, eps)


@ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards, mask=None, *, eps: float = 1e-6, **_) -> jax.Array:
  """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262, the group-mean-baseline variant):
  A_i = whiten_batch(r_i - mean(r_group)). The group mean removes prompt difficulty, the global
  whitening sets the scale. Single-sample groups contribute a centred 0 (they still count in the
  batch std: they are real samples with no signal).
  """
  rewards, mask, m, _ = _prepare(rewards, mask)
  return whiten(_centred(rewards, m, -1), mask, eps)


@ESTIMATORS.register("robust_median")
def robust_median(rewards, mask=None, *, min_frac: float = 0.5, **_) -> jax.Array:
  """GAPO robust baseline (GAPO, group adaptive policy optimisation for real-world code
  editing): sort the group's valid rewards s_1 <= ... <= s_n, pick the contiguous interval
  [i, j] of that order with the highest SNR = mean / std, set Q = median(s_i..s_j) and
  A_k = r_k - Q (no std scaling).

  The abstract leaves the details open; this implementation fixes them as follows.
  - Intervals hold at least k_min = max(min(2, n), ceil(min_frac * n)) samples, so Q is the centre
    of a bulk of the group rather than one sample (an interval of one has no spread at all).
  - std is the population std (ddof 0) of the interval.
  - Zero spread (s_i == s_j, exactly) gives SNR = +inf for a positive mean, -inf for a negative
    one and 0 for a zero mean (0 / 0 reads as "no signal").
  - Ties in SNR go to the longest interval, then to the lowest start: an all-equal group selects
    the whole group, so its advantages are exactly zero.
  SNR = mean / std is not shift-invariant; it assumes non-negative scores as in the paper
  (e.g. similarity rewards in [0, 1]). A single valid sample gets Q = r, so A = 0.
  Cost: O(num_groups * G^3) time and memory (every interval's members), fine for G up to ~64.
  """
  if not 0.0 < min_frac <= 1.0:
    raise ValueError(f"robust_median: min_frac must be in (0, 1], got {min_frac}")
  rewards, mask, _, _ = _prepare(rewards, mask)
  return _robust_median(rewards, mask, min_frac)


# Jitted: the O(G^3) interval search is ~40 small ops, slow to dispatch one by one.
@functools.partial(jax.jit, static_argnames="min_frac")
def _robust_median(rewards, mask, min_frac):
  n = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  g = rewards.shape[-1]
  # Masked entries sort to the end; positions >= n are never inside an interval.
  s = jnp.sort(jnp.where(mask, rewards, jnp.inf), axis=-1)  # [num_groups, G]
  idx = jnp.arange(g)
  i, j = idx[:, None], idx[None, :]  # interval start, end (inclusive)
  length = (j - i + 1).astype(jnp.float32)  # [G, G]
  # The 1e-6 keeps float rounding (0.3 * 10 = 3.0000001) from adding a sample to k_min.
  k_min = jnp.maximum(jnp.minimum(2.0, n), jnp.ceil(min_frac * n - 1e-6))[..., None]
  ok = (j >= i) & (j[None] < n[..., None]) & (length >= k_min)  # [num_groups, G, G]
  # Member k of interval (i, j): [G, G, G]; an explicit mean/std (no prefix-sum differences) keeps
  # float32 cancellation out of near-tied intervals.
  member = (idx[None, None, :] >= i[..., None]) & (idx[None, None, :] <= j[..., None])
  w = member.astype(jnp.float32)
  s_fin = jnp.where(jnp.isfinite(s), s, 0.0)[:, None, None, :]  # [num_groups, 1, 1, G]
  mean = jnp.sum(w * s_fin, axis=-1) / length
  std = jnp.sqrt(jnp.sum(w * (s_fin - mean[..., None]) ** 2, axis=-1) / length)
  flat = s[:, :, None] == s[:, None, :]  # s_i == s_j: exact zero spread, [num_groups, G, G]
  flat_snr = jnp.where(mean > 0, jnp.inf, jnp.where(mean < 0, -jnp.inf, 0.0))
  snr = jnp.where(flat, flat_snr, mean / jnp.where(flat, 1.0, std))
  # Lexicographic argmax over (snr, length, -start) among admissible intervals.
  best = jnp.max(jnp.where(ok, snr, -jnp.inf), axis=(-2, -1), keepdims=True)
  cand = ok & (snr == best)
  longest = jnp.max(jnp.where(cand, length, 0.0), axis=(-2, -1), keepdims=True)
  cand = cand & (length == longest)
  # Flattened (i, j) is start-major, so the first candidate has the lowest start.
  pick = jnp.argmax(cand.reshape(s.shape[0], -1), axis=-1)
  lo, hi = pick // g, pick % g
  mid_lo = jnp.take_along_axis(s, ((lo + hi) // 2)[:, None], -1)
  mid_hi = jnp.take_along_axis(s, ((lo + hi + 1) // 2)[:, None], -1)
  q = 0.5 * (mid_lo + mid_hi)  # [num_groups, 1]
  # Groups with no valid sample have no admissible interval; their q is garbage but masked out.
  return jnp.where(mask & (n > 0), rewards - jnp.where(jnp.isfinite(q), q, 0.0), 0.0)


def ragged_groups(values: np.ndarray, sizes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Prompt-major rows in groups of `sizes` as (padded [num_groups, max size], mask, rows [B]:
  each row's index into the flattened padded array). Equal sizes give the plain reshape."""
  sizes = np.asarray(sizes, np.int64)
  if sizes.sum() != values.shape[0]:
    raise ValueError(f"group sizes sum to {sizes.sum()}, the batch has {values.shape[0]} rows")
  width = int(sizes.max())
  group = np.repeat(np.arange(sizes.size), sizes)
  within = np.arange(values.shape[0]) - np.repeat(np.cumsum(sizes) - sizes, sizes)
  rows = group * width + within
  padded = np.zeros(sizes.size * width, values.dtype)
  padded[rows] = values
  mask = np.zeros(sizes.size * width, bool)
  mask[rows] = True
  return padded.reshape(sizes.size, width), mask.reshape(sizes.size, width), rows


def group_advantages(fn, rewards, sizes, **options) -> tuple[jax.Array, np.ndarray]:
  """A group estimator `fn` over prompt-major rows [B] in groups of `sizes` (variable with
  rl.allocation): it sees them padded to the largest group with a mask, so each group's
  baseline reads its own samples only. Returns (advantages [B] on the device, [num_groups]
  bool: the group's rewards all tie)."""
  rewards = np.asarray(rewards, np.float32)
  padded, mask, rows = ragged_groups(rewards, sizes)
  adv = fn(jax.device_put(padded), jax.device_put(mask), **options).reshape(-1)
  adv = adv if padded.size == rewards.size else jnp.take(adv, jnp.asarray(rows))
  tied = np.where(mask, padded, -np.inf).max(axis=1) == np.where(mask, padded, np.inf).min(axis=1)
  return adv, tied
