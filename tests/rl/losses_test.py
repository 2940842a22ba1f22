"""PPO-clip per-token loss and aggregation: hand values, gradients, a numpy reference, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.losses import POLICY_LOSSES, aggregate, ppo_clip


def _np_ppo_clip(logp, old_logp, adv, eps_low, eps_high):
  ratio = np.exp(logp.astype(np.float64) - old_logp.astype(np.float64))
  unclipped = -ratio * adv
  clipped = -np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv
  return np.maximum(unclipped, clipped), clipped > unclipped


def _call(ratio, adv, eps_low=0.2, eps_high=0.28):
  """ppo_clip at the given ratios (old_logp = 0, so logp = log ratio)."""
  logp = jnp.log(jnp.asarray(ratio, jnp.float32))
  adv = jnp.asarray(adv, jnp.float32)
  loss, clipped = ppo_clip(logp, jnp.zeros_like(logp), adv, eps_low=eps_low, eps_high=eps_high)
  return np.asarray(loss), np.asarray(clipped)


# (ratio, advantage, expected loss, expected clipped) with eps_low = .2, eps_high = .28.
CASES = [
  (1.1, 2.0, -2.2, False),  # inside the range: -ratio * A
  (0.9, -3.0, 2.7, False),  # inside, negative advantage
  (1.5, 1.0, -1.28, True),  # A > 0 and ratio above 1 + eps_high: clipped at 1.28
  (0.5, -1.0, 0.8, True),  # A < 0 and ratio below 1 - eps_low: clipped at 0.8
  (0.5, 1.0, -0.5, False),  # A > 0, ratio below range: the min keeps the unclipped term
  (1.5, -1.0, 1.5, False),  # A < 0, ratio above range: the min keeps the unclipped term
  (1.25, 1.0, -1.25, False),  # clip-higher: 1.25 < 1 + eps_high is not clipped ...
  (0.78, -2.0, 1.6, True),  # ... but 0.78 < 1 - eps_low is (0.8 * 2)
  (3.0, 0.0, 0.0, False),  # zero advantage: zero loss, never counted as clipped
]


def test_hand_values():
  ratio, adv, want, want_clipped = map(np.array, zip(*CASES, strict=True))
  loss, clipped = _call(ratio, adv)
  np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(clipped, want_clipped)


def test_symmetric_eps_clips_where_clip_higher_does_not():
  loss, clipped = _call([1.25], [1.0], eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(loss, [-1.2], rtol=1e-6)
  assert clipped.tolist() == [True]
  loss, clipped = _call([1.25], [1.0], eps_low=0.2, eps_high=0.28)
  np.testing.assert_allclose(loss, [-1.25], rtol=1e-6)
  assert clipped.tolist() == [False]


def test_gradient_is_zero_where_clipped_and_minus_a_ratio_elsewhere():
  ratio, adv, _, want_clipped = map(np.array, zip(*CASES, strict=True))
  logp = jnp.log(jnp.asarray(ratio, jnp.float32))
  old = jnp.zeros_like(logp)
  a = jnp.asarray(adv, jnp.float32)
  grad = jax.grad(lambda lp: jnp.sum(ppo_clip(lp, old, a, eps_low=0.2, eps_high=0.28)[0]))(logp)
  want = np.where(want_clipped, 0.0, -adv * ratio)
  np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)
  # The gradient wrt the behaviour log-probs is minus that: only the ratio matters.
  g_old = jax.grad(lambda o: jnp.sum(ppo_clip(logp, o, a, eps_low=0.2, eps_high=0.28)[0]))(old)
  np.testing.assert_allclose(g_old, -want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
def test_matches_numpy_reference(eps_low, eps_high):
  rng = np.random.default_rng(0)
  old = rng.normal(-2.0, 1.0, size=(13, 17)).astype(np.float32)
  logp = (old + rng.normal(0.0, 0.3, size=old.shape)).astype(np.float32)
  adv = rng.normal(size=old.shape).astype(np.float32)
  loss, clipped = ppo_clip(logp, old, adv, eps_low=eps_low, eps_high=eps_high)
  want, want_clipped = _np_ppo_clip(logp, old, adv, eps_low, eps_high)
  np.testing.assert_allclose(loss, want, atol=1e-6)
  np.testing.assert_array_equal(clipped, want_clipped)
  # The random draws must exercise both branches for the comparison to mean anything.
  assert 0 < np.sum(want_clipped) < want_clipped.size


def test_aggregate_token_mean_returns_sum_and_denominator():
  per_token = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  for mask in ([[1, 1, 0], [0, 1, 1]], [[True, True, False], [False, True, True]]):
    total, denom = aggregate(per_token, jnp.asarray(mask))
    assert float(total) == 14.0  # 1 + 2 + 5 + 6
    assert float(denom) == 4.0
  # Every token weighs the same: (1 + 2 + 3 + 4) / 4 = 2.5, not the mean of the per-sequence
  # means (1 + 3) / 2 = 2.
  per_token = jnp.array([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]])
  total, denom = aggregate(per_token, jnp.array([[1, 0, 0], [1, 1, 1]]))
  assert float(total / denom) == 2.5
  assert float(total / denom) != (1.0 + 3.0) / 2


def test_unknown_names_raise_listing_the_valid_ones():
  with pytest.raises(ValueError, match=r"unknown loss aggregation 'seq-mean'.*token-mean"):
    aggregate(jnp.ones(3), jnp.ones(3), "seq-mean")
  with pytest.raises(ValueError, match=r"unknown policy loss 'reinforce'.*'ppo_clip'"):
    POLICY_LOSSES.get("reinforce")
  assert POLICY_LOSSES.get("ppo_clip") is ppo_clip
