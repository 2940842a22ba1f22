"""Advantage estimators: hand values, ragged masks, invariants, numpy references, registry."""

import math

import numpy as np
import pytest

from jaxrl.rl.advantages import (
  ESTIMATORS,
  dr_grpo,
  grpo,
  reinforce_pp,
  reinforce_pp_baseline,
  rloo,
  robust_median,
  whiten,
)
from jaxrl.rl.value import gae


def _np_grpo(rewards, mask, eps=1e-6, scale_by_std=True):
  """Straightforward per-group loop in float64 (Bessel-corrected std, as TRL/verl)."""
  out = np.zeros(rewards.shape, np.float64)
  for i in range(rewards.shape[0]):
    r = rewards[i][mask[i]].astype(np.float64)
    if r.size < 2:
      continue
    a = r - r.mean()
    if scale_by_std:
      a = a / (r.std(ddof=1) + eps)
    out[i, mask[i]] = a
  return out


def test_one_correct_of_four_by_hand():
  # mean .25; centred [.75, -.25, -.25, -.25]; sample var (.5625 + 3 * .0625) / 3 = .25, std .5.
  adv = grpo(np.array([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
  np.testing.assert_allclose(adv, [[1.5, -0.5, -0.5, -0.5]], rtol=1e-6)
  # The default eps only perturbs the 7th digit.
  np.testing.assert_allclose(grpo(np.array([[1.0, 0.0, 0.0, 0.0]])), adv, rtol=1e-5)


def test_ties_by_hand():
  # mean .5; centred +-.5; var 4 * .25 / 3 = 1/3; adv = +-.5 * sqrt(3) = +-sqrt(3)/2.
  adv = grpo(np.array([[1.0, 1.0, 0.0, 0.0]]), eps=0.0)
  h = math.sqrt(3) / 2
  np.testing.assert_allclose(adv, [[h, h, -h, -h]], rtol=1e-6)


def test_all_equal_groups_are_exactly_zero():
  rewards = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
  adv = np.asarray(grpo(rewards))
  assert np.all(adv == 0.0)
  assert np.all(np.asarray(grpo(rewards, scale_by_std=False)) == 0.0)


def test_ragged_group_by_hand():
  # Valid [2, 0]: mean 1, centred [1, -1], var 2 / 1, std sqrt(2). Masked entries (huge values)
  # must neither leak into the mean/std nor get an advantage.
  rewards = np.array([[2.0, 0.0, 100.0, -50.0], [1.0, 0.0, 0.0, 7.0]])
  mask = np.array([[True, True, False, False], [True, True, True, False]])
  adv = np.asarray(grpo(rewards, mask, eps=0.0))
  s = 1 / math.sqrt(2)
  # Second group [1, 0, 0]: mean 1/3, centred [2/3, -1/3, -1/3], var (4/9 + 2/9) / 2 = 1/3.
  t = math.sqrt(3)
  np.testing.assert_allclose(
    adv, [[s, -s, 0.0, 0.0], [2 / 3 * t, -1 / 3 * t, -1 / 3 * t, 0.0]], rtol=1e-6
  )


def test_single_valid_sample_and_empty_groups_get_zero():
  rewards = np.array([[3.0, 1.0, 2.0], [5.0, 6.0, 7.0]])
  mask = np.array([[True, False, False], [False, False, False]])
  adv = np.asarray(grpo(rewards, mask))
  assert np.all(adv == 0.0)
  assert np.all(np.isfinite(adv))


def test_scale_by_std_false_gives_centred_rewards():
  adv = grpo(np.array([[1.0, 0.0, 0.0, 0.0]]), scale_by_std=False)
  np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25]], rtol=1e-6)
  rewards = np.array([[4.0, 2.0, 9.0]])
  adv = grpo(rewards, np.array([[True, True, False]]), scale_by_std=False)
  np.testing.assert_allclose(adv, [[1.0, -1.0, 0.0]], rtol=1e-6)


def test_matches_numpy_reference_on_random_ragged_groups():
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=(37, 7)).astype(np.float32)
  lengths = rng.integers(0, 8, size=37)
  mask = np.arange(7)[None] < lengths[:, None]
  # Shuffle the masks within each row: valid samples need not be a prefix.
  mask = np.take_along_axis(mask, rng.permuted(np.tile(np.arange(7), (37, 1)), axis=1), axis=1)
  for scale in (True, False):
    adv = np.asarray(grpo(rewards, mask, scale_by_std=scale))
    # rtol: a float32 mean carries ~1 ulp of |r|, which is relatively larger in r - mean when a
    # group's rewards nearly tie (row 28 here: ~2e-6); that is float32, not the estimator.
    want = _np_grpo(rewards, mask, scale_by_std=scale)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)


def test_invariants_zero_sum_unit_std_and_affine_invariance():
  rng = np.random.default_rng(1)
  rewards = rng.normal(size=(16, 5)).astype(np.float32)
  mask = rng.random((16, 5)) < 0.8
  mask[:, :2] = True  # at least two valid samples per group
  adv = np.asarray(grpo(rewards, mask, eps=0.0))
  np.testing.assert_allclose(np.sum(adv * mask, axis=1), 0.0, atol=1e-5)
  for i in range(16):
    np.testing.assert_allclose(np.std(adv[i][mask[i]], ddof=1), 1.0, rtol=1e-5)
  # Group-relative and scale-free: a positive affine map of the rewards changes nothing.
  np.testing.assert_allclose(grpo(3.0 * rewards - 2.0, mask, eps=0.0), adv, atol=1e-5)


def test_registry_lookup_and_error_lists_valid_names():
  assert ESTIMATORS.get("grpo") is grpo
  assert "grpo" in ESTIMATORS.names()
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'vapo'.*'grpo'"):
    ESTIMATORS.get("vapo")
  with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
    ESTIMATORS.register("grpo")(lambda r: r)


# ------------------------------------------------------------------------------ other estimators


def _random_ragged(seed, shape=(37, 7), uniform=False):
  """Rewards and a ragged mask whose valid entries are not a prefix (0..G valid per group)."""
  rng = np.random.default_rng(seed)
  num_groups, g = shape
  rewards = (rng.random(shape) if uniform else rng.normal(size=shape)).astype(np.float32)
  lengths = rng.integers(0, g + 1, size=num_groups)
  mask = np.arange(g)[None] < lengths[:, None]
  perm = rng.permuted(np.tile(np.arange(g), (num_groups, 1)), axis=1)
  return rewards, np.take_along_axis(mask, perm, axis=1)


def _np_rloo(rewards, mask):
  out = np.zeros(rewards.shape, np.float64)
  for i in range(rewards.shape[0]):
    idx = np.flatnonzero(mask[i])
    if idx.size < 2:
      continue
    r = rewards[i].astype(np.float64)
    for k in idx:
      others = [r[j] for j in idx if j != k]
      out[i, k] = r[k] - np.mean(others)
  return out


def _np_whiten(values, mask, eps=1e-6):
  out = np.zeros(values.shape, np.float64)
  v = values[mask].astype(np.float64)
  if v.size > 1:
    out[mask] = (v - v.mean()) / (v.std(ddof=1) + eps)
  return out


def _np_robust_median(rewards, mask, min_frac=0.5):
  """Enumerate every interval of the sorted valid rewards; the tie rules of the docstring."""
  out = np.zeros(rewards.shape, np.float64)
  for g in range(rewards.shape[0]):
    r = rewards[g][mask[g]].astype(np.float64)
    n = r.size
    if n == 0:
      continue
    s = np.sort(r)
    k_min = max(min(2, n), math.ceil(min_frac * n - 1e-6))
    best = None
    for i in range(n):
      for j in range(i + k_min - 1, n):
        seg = s[i : j + 1]
        if seg[0] == seg[-1]:
          snr = 0.0 if seg.mean() == 0 else math.copysign(math.inf, seg.mean())
        else:
          snr = seg.mean() / seg.std()
        key = (snr, j - i + 1, -i)
        if best is None or key > best[0]:
          best = (key, np.median(seg))
    out[g, mask[g]] = r - best[1]
  return out


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo, reinforce_pp_baseline, robust_median])
def test_all_equal_groups_and_masked_entries_are_exactly_zero(fn):
  # reinforce_pp is left out on purpose: with no group baseline an all-equal group still gets
  # the batch-relative advantage of its reward (see test_reinforce_pp_by_hand).
  rewards = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
  assert np.all(np.asarray(fn(rewards)) == 0.0)
  # The estimators take the loop's common keyword set and ignore what they do not use.
  assert np.all(np.asarray(fn(rewards, scale_by_std=False)) == 0.0)
  rewards, mask = _random_ragged(3)
  adv = np.asarray(fn(rewards, mask))
  assert np.all(np.isfinite(adv))
  assert np.all(adv[~mask] == 0.0)


def test_dr_grpo_by_hand_and_equals_unscaled_grpo():
  np.testing.assert_allclose(
    dr_grpo(np.array([[1.0, 0.0, 0.0, 0.0]])), [[0.75, -0.25, -0.25, -0.25]]
  )
  adv = dr_grpo(np.array([[4.0, 2.0, 9.0]]), np.array([[True, True, False]]))
  np.testing.assert_allclose(adv, [[1.0, -1.0, 0.0]])
  rewards, mask = _random_ragged(4)
  want = _np_grpo(rewards, mask, scale_by_std=False)
  np.testing.assert_allclose(dr_grpo(rewards, mask), want, rtol=1e-5, atol=1e-6)
  # Unlike GRPO, scale_by_std does not rescale it.
  np.testing.assert_array_equal(dr_grpo(rewards, mask, scale_by_std=True), dr_grpo(rewards, mask))


def test_rloo_by_hand():
  # One correct of four: the correct sample's baseline is 0, the others' is 1/3.
  np.testing.assert_allclose(
    rloo(np.array([[1.0, 0.0, 0.0, 0.0]])), [[1.0, -1 / 3, -1 / 3, -1 / 3]], rtol=1e-6
  )
  # Valid [3, 1, 2]: baselines (1 + 2) / 2, (3 + 2) / 2, (3 + 1) / 2 -> [1.5, -1.5, 0].
  rewards = np.array([[3.0, 1.0, 2.0, 100.0], [5.0, 6.0, 7.0, 8.0]])
  mask = np.array([[True, True, True, False], [False, True, False, False]])
  np.testing.assert_allclose(rloo(rewards, mask), [[1.5, -1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_rloo_is_g_over_g_minus_1_times_centred_and_matches_numpy():
  rng = np.random.default_rng(5)
  for g in (2, 3, 8):
    rewards = rng.normal(size=(11, g)).astype(np.float32)
    want = g / (g - 1) * (rewards - rewards.mean(axis=1, keepdims=True))
    np.testing.assert_allclose(rloo(rewards), want, rtol=1e-5, atol=1e-6)
  rewards, mask = _random_ragged(6)
  np.testing.assert_allclose(rloo(rewards, mask), _np_rloo(rewards, mask), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.sum(np.asarray(rloo(rewards, mask)), axis=1), 0.0, atol=1e-5)


def test_whiten_masked_moments_bessel_corrected():
  """The one whitening (REINFORCE++ and PPO's GAE): masked mean 0, Bessel std 1, 0 elsewhere."""
  x = np.array([[1.0, 2.0, 3.0, 100.0]])
  m = np.array([[1.0, 1.0, 1.0, 0.0]])
  w = np.asarray(whiten(x, m, eps=0.0))
  np.testing.assert_allclose(w[0, :3], [-1.0, 0.0, 1.0], atol=1e-6)  # std(1, 2, 3; ddof=1) = 1
  assert w[0, 3] == 0.0
  assert np.all(np.asarray(whiten(np.full((2, 3), 0.7))) == 0.0)  # ties: exactly 0


def test_reinforce_pp_by_hand():
  # All four valid: [1, 0, 1, 1], mean .75, centred [.25, -.75, .25, .25], var .75 / 3, std .5.
  rewards = np.array([[1.0, 0.0], [1.0, 1.0]])
  np.testing.assert_allclose(reinforce_pp(rewards, eps=0.0), [[0.5, -1.5], [0.5, 0.5]], rtol=1e-6)
  # Valid [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3], var (6/9) / 2 = 1/3: scale sqrt(3).
  mask = np.array([[True, True], [True, False]])
  t = math.sqrt(3)
  want = [[t / 3, -2 * t / 3], [t / 3, 0.0]]
  np.testing.assert_allclose(reinforce_pp(rewards, mask, eps=0.0), want, rtol=1e-6)
  # Baseline variant: group-centred [.5, -.5, 0, 0], mean 0, var .5 / 3: +-.5 * sqrt(6).
  h = 0.5 * math.sqrt(6)
  want = [[h, -h], [0.0, 0.0]]
  np.testing.assert_allclose(reinforce_pp_baseline(rewards, eps=0.0), want, rtol=1e-6)
  # Only an all-equal batch gives REINFORCE++ zero advantage; masked entries are zero.
  assert np.all(np.asarray(reinforce_pp(np.full((3, 4), 0.3))) == 0.0)
  rewards, mask = _random_ragged(3)
  assert np.all(np.asarray(reinforce_pp(rewards, mask))[~mask] == 0.0)


def test_reinforce_pp_variants_match_numpy_and_are_globally_whitened():
  rewards, mask = _random_ragged(7)
  adv = np.asarray(reinforce_pp(rewards, mask))
  np.testing.assert_allclose(adv, _np_whiten(rewards, mask), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.std(adv[mask], ddof=1), 1.0, rtol=1e-5)
  centred = _np_grpo(rewards, mask, scale_by_std=False)
  adv = np.asarray(reinforce_pp_baseline(rewards, mask))
  np.testing.assert_allclose(adv, _np_whiten(centred, mask), rtol=1e-5, atol=1e-6)
  # Affine invariance of both: global whitening removes any positive scale and shift.
  for fn in (reinforce_pp, reinforce_pp_baseline):
    np.testing.assert_allclose(fn(2.0 * rewards + 5.0, mask), fn(rewards, mask), atol=2e-5)


def test_robust_median_by_hand():
  # Sorted [0, .79, .8, .81, .82], intervals of >= 3: [.8, .81, .82] has SNR .81 / .00816 = 99.2,
  # above [.79, .8, .81] (98.0) and all wider ones; Q = .81, so the outlier 0 does not drag the
  # baseline down as the GRPO mean (.644) would.
  adv = robust_median(np.array([[0.8, 0.82, 0.81, 0.0, 0.79]]))
  np.testing.assert_allclose(adv, [[-0.01, 0.01, 0.0, -0.81, -0.02]], atol=1e-6)
  # Valid [3, 1, 2], k_min = 2: SNR [1, 2] 3, [2, 3] 5, [1, 2, 3] 2.45: Q = 2.5.
  adv = robust_median(np.array([[3.0, 1.0, 2.0, 9.0, 0.0]]), np.array([[1, 1, 1, 0, 0]]))
  np.testing.assert_allclose(adv, [[0.5, -1.5, -0.5, 0.0, 0.0]], atol=1e-6)
  # Sorted [.2, .8, .85, .9]: [.85, .9] (SNR 35) beats [.8, .85] (33): Q = .875.
  adv = robust_median(np.array([[0.2, 0.9, 0.8, 0.85]]))
  np.testing.assert_allclose(adv, [[-0.675, 0.025, -0.075, -0.025]], atol=1e-6)


def test_robust_median_ties_and_zero_spread():
  # [1, 1] has zero spread and a positive mean: SNR +inf wins; Q = 1.
  np.testing.assert_allclose(robust_median(np.array([[1.0, 1.0, 0.0, 0.0]])), [[0, 0, -1, -1]])
  # Two flat runs of equal length: the lower start wins, Q = 2.
  adv = robust_median(np.array([[3.0, 2.0, 3.0, 2.0, 3.0, 2.0]]))
  np.testing.assert_allclose(adv, [[1, 0, 1, 0, 1, 0]])
  # k_min = 3 of 5: [1, 1, 1] is the only flat interval. Flat negative runs read -inf, zeros 0.
  np.testing.assert_allclose(
    robust_median(np.array([[1.0, 2.0, 1.0, 2.0, 1.0]])), [[0, 1, 0, 1, 0]]
  )
  np.testing.assert_allclose(robust_median(np.array([[-1.0, -1.0, 0.0, 0.0]])), [[-1, -1, 0, 0]])
  np.testing.assert_allclose(robust_median(np.array([[-1.0, -1.0, -1.0, -1.0]])), [[0, 0, 0, 0]])
  # One valid sample: Q = r, A = 0; no valid sample: zeros.
  adv = robust_median(np.array([[4.0, 1.0], [2.0, 3.0]]), np.array([[True, False], [False, False]]))
  assert np.all(np.asarray(adv) == 0.0)
  with pytest.raises(ValueError, match="min_frac"):
    robust_median(np.ones((1, 3)), min_frac=0.0)


@pytest.mark.parametrize("min_frac", [0.5, 0.3, 1.0])
def test_robust_median_matches_numpy(min_frac):
  rewards, mask = _random_ragged(8, uniform=True)
  got = robust_median(rewards, mask, min_frac=min_frac)
  np.testing.assert_allclose(got, _np_robust_median(rewards, mask, min_frac), atol=1e-6)
  if min_frac == 1.0:
    # The interval is the whole group: Q is the group median.
    want = np.zeros(rewards.shape)
    for i in range(rewards.shape[0]):
      if mask[i].any():
        want[i, mask[i]] = rewards[i, mask[i]] - np.median(rewards[i, mask[i]])
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_registry_holds_every_advantage_kind_with_its_traits():
  assert ESTIMATORS.names() == sorted(
    ["dr_grpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "robust_median"]
  )
  # GAE reads a critic; it and REINFORCE++ need no group (group_size = 1 is valid with them).
  assert ESTIMATORS.names(needs_critic=True) == ["gae"] and ESTIMATORS.get("gae") is gae
  assert ESTIMATORS.names(groupless=True) == ["gae", "reinforce_pp"]
  assert ESTIMATORS.traits("grpo") == {}
  assert ESTIMATORS.get("rloo") is rloo
  with pytest.raises(ValueError, match=r"valid: \['dr_grpo', 'gae', 'grpo', 'reinforce_pp'"):
    ESTIMATORS.get("gapo")
