"""KL estimators k1/k2/k3: hand values, zero for identical policies, k3 >= 0, exact expectations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.kl import kl_estimate, kl_in_reward


@pytest.mark.parametrize(
  "p,q,k1,k2,k3",
  [
    # pi = .5, pi_ref = .25: r = .5, log r = -ln 2.
    (0.5, 0.25, math.log(2), 0.5 * math.log(2) ** 2, -0.5 + math.log(2)),
    # pi = .2, pi_ref = .6: r = 3, log r = ln 3.
    (0.2, 0.6, -math.log(3), 0.5 * math.log(3) ** 2, 2.0 - math.log(3)),
  ],
)
def test_hand_values(p, q, k1, k2, k3):
  logp, ref = jnp.log(jnp.float32(p)), jnp.log(jnp.float32(q))
  for kind, want in (("k1", k1), ("k2", k2), ("k3", k3)):
    np.testing.assert_allclose(kl_estimate(logp, ref, kind), want, rtol=1e-6, err_msg=kind)


def test_identical_policies_give_exactly_zero():
  logp = jnp.asarray(np.random.default_rng(0).normal(-3.0, 2.0, size=(5, 9)), jnp.float32)
  for kind in ("k1", "k2", "k3"):
    assert np.all(np.asarray(kl_estimate(logp, logp, kind)) == 0.0), kind


def test_k2_k3_nonnegative_and_k3_matches_numpy():
  rng = np.random.default_rng(1)
  logp = rng.normal(-3.0, 2.0, size=(64, 33)).astype(np.float32)
  ref = rng.normal(-3.0, 2.0, size=(64, 33)).astype(np.float32)
  k3 = np.asarray(kl_estimate(logp, ref, "k3"))
  assert np.all(k3 >= 0.0)
  assert np.all(np.asarray(kl_estimate(logp, ref, "k2")) >= 0.0)
  lr = ref.astype(np.float64) - logp
  np.testing.assert_allclose(k3, np.expm1(lr) - lr, rtol=1e-5, atol=1e-6)
  # Default kind is k3.
  np.testing.assert_array_equal(kl_estimate(logp, ref), k3)


def test_k1_and_k3_are_unbiased_under_exact_expectation():
  # Summing p(x) * k(x) over the whole support gives the true KL(p || q) for k1 and k3.
  rng = np.random.default_rng(2)
  p = rng.dirichlet(np.ones(11))
  q = rng.dirichlet(np.ones(11))
  want = np.sum(p * np.log(p / q))
  logp, ref = jnp.asarray(np.log(p), jnp.float32), jnp.asarray(np.log(q), jnp.float32)
  for kind in ("k1", "k3"):
    got = np.sum(p * np.asarray(kl_estimate(logp, ref, kind), np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=kind)


def test_unknown_kind_raises_listing_valid():
  with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*'k1', 'k2', 'k3'"):
    kl_estimate(jnp.zeros(2), jnp.zeros(2), "k4")


def test_kl_in_reward_by_hand():
  # pi = .5, pi_ref = .25: k1 = ln 2 per token. Reward 1 on the last valid token, beta .1; the
  # padded token (log-probs -inf) keeps its reward and gets no penalty.
  logp = jnp.log(jnp.array([[0.5, 0.5, 1.0]]))
  ref = jnp.log(jnp.array([[0.25, 0.5, 0.0]]))
  rewards = jnp.array([[0.0, 1.0, 0.0]])
  mask = jnp.array([[True, True, False]])
  got = kl_in_reward(rewards, logp, ref, 0.1, "k1", mask=mask)
  np.testing.assert_allclose(got, [[-0.1 * math.log(2), 1.0, 0.0]], rtol=1e-6)
  # k3 at r = 1/2: (1/2 - 1) + ln 2.
  got = kl_in_reward(rewards[:, :2], logp[:, :2], ref[:, :2], 0.1, "k3")
  np.testing.assert_allclose(got, [[-0.1 * (math.log(2) - 0.5), 1.0]], rtol=1e-6)


def test_kl_in_reward_matches_numpy_is_zero_for_identical_policies_and_has_no_gradient():
  rng = np.random.default_rng(3)
  logp = rng.normal(-3.0, 1.0, size=(5, 7)).astype(np.float32)
  ref = rng.normal(-3.0, 1.0, size=(5, 7)).astype(np.float32)
  rewards = rng.normal(size=(5, 7)).astype(np.float32)
  mask = rng.random((5, 7)) < 0.7
  got = kl_in_reward(rewards, logp, ref, 0.05, "k1", mask=mask)
  want = rewards - 0.05 * np.where(mask, logp.astype(np.float64) - ref, 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(kl_in_reward(rewards, logp, logp, 0.05), rewards)
  # The penalty is part of the reward, not a loss term: no gradient reaches the policy.
  g = jax.grad(lambda lp: jnp.sum(kl_in_reward(rewards, lp, ref, 0.05, "k3")))(jnp.asarray(logp))
  assert np.all(np.asarray(g) == 0.0)
