"""GRPO advantages: hand-computed groups, ragged masks, invariants, a numpy reference, registry."""

import math

import numpy as np
import pytest

from jaxrl.rl.advantages import ESTIMATORS, grpo


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
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'rloo'.*'grpo'"):
    ESTIMATORS.get("rloo")
  with pytest.raises(ValueError, match="registered twice"):
    ESTIMATORS.register("grpo")(lambda r: r)
