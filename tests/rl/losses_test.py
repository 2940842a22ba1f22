"""Policy losses and aggregation modes: hand values, gradients, numpy references, invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, cispo, dual_clip, gspo, ppo_clip


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


# ----------------------------------------------------------------------------- other losses


def _ragged(seed, shape=(7, 11), sigma=0.3):
  """old/new log-probs, advantages constant per sequence, and a ragged mask (one row empty)."""
  rng = np.random.default_rng(seed)
  old = rng.normal(-2.0, 1.0, size=shape).astype(np.float32)
  logp = (old + rng.normal(0.0, sigma, size=shape)).astype(np.float32)
  adv = np.repeat(rng.normal(size=(shape[0], 1)), shape[1], axis=1).astype(np.float32)
  lengths = rng.integers(1, shape[1] + 1, size=shape[0])
  lengths[2] = 0
  mask = np.arange(shape[1])[None] < lengths[:, None]
  return logp, old, adv, mask


def _np_dual_clip(logp, old_logp, adv, eps_low, eps_high, c):
  loss, clipped = _np_ppo_clip(logp, old_logp, adv, eps_low, eps_high)
  dual = (adv < 0) & (-c * adv < loss)
  return np.where(dual, -c * adv, loss), clipped | dual


def _np_gspo(logp, old_logp, adv, mask, eps_low, eps_high):
  loss = np.zeros(logp.shape)
  clipped = np.zeros(logp.shape, bool)
  for i in range(logp.shape[0]):
    d = logp[i][mask[i]].astype(np.float64) - old_logp[i][mask[i]]
    s = np.exp(d.mean()) if d.size else 1.0
    unclipped, clip = -s * adv[i], -np.clip(s, 1 - eps_low, 1 + eps_high) * adv[i]
    loss[i] = np.maximum(unclipped, clip)
    clipped[i] = (clip > unclipped) & mask[i]
  return loss, clipped


def _np_cispo(logp, old_logp, adv, eps_low, eps_high):
  ratio = np.exp(logp.astype(np.float64) - old_logp)
  w = np.clip(ratio, 1 - eps_low, 1 + eps_high)
  return -w * adv * logp, w != ratio


def test_dual_clip_hand_values_and_gradient():
  # (ratio, A, loss, clipped) with eps .2 / .28 and c = 3.
  cases = [
    (5.0, -1.0, 3.0, True),  # PPO keeps -ratio * A = 5; the dual clip bounds it at -c * A = 3
    (4.0, -2.0, 6.0, True),  # PPO 8, bound 6
    (2.0, -1.0, 2.0, False),  # PPO 2 is below the bound 3: unchanged
    (0.5, -1.0, 0.8, True),  # ordinary lower clip
    (5.0, 1.0, -1.28, True),  # A > 0: plain PPO (upper clip)
    (1.1, 2.0, -2.2, False),  # inside the range
  ]
  ratio, adv, want, want_clipped = map(np.array, zip(*cases, strict=True))
  logp = jnp.log(jnp.asarray(ratio, jnp.float32))
  old, a = jnp.zeros_like(logp), jnp.asarray(adv, jnp.float32)
  loss, clipped = dual_clip(logp, old, a, eps_low=0.2, eps_high=0.28, clip_c=3.0)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_array_equal(clipped, want_clipped)
  # Both clips are constants in the ratio: no gradient where either is active.
  f = lambda lp: jnp.sum(dual_clip(lp, old, a, eps_low=0.2, eps_high=0.28, clip_c=3.0)[0])  # noqa: E731
  want_grad = np.where(want_clipped, 0.0, -adv * ratio)
  np.testing.assert_allclose(jax.grad(f)(logp), want_grad, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="clip_c must be > 1"):
    dual_clip(logp, old, a, clip_c=1.0)


def test_dual_clip_matches_numpy_and_equals_ppo_for_positive_advantages():
  rng = np.random.default_rng(1)
  old = rng.normal(-2.0, 1.0, size=(13, 17)).astype(np.float32)
  logp = (old + rng.normal(0.0, 1.0, size=old.shape)).astype(np.float32)
  adv = rng.normal(size=old.shape).astype(np.float32)
  loss, clipped = dual_clip(logp, old, adv, eps_low=0.2, eps_high=0.28, clip_c=3.0)
  want, want_clipped = _np_dual_clip(logp, old, adv, 0.2, 0.28, 3.0)
  np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(clipped, want_clipped)
  # The draws must hit the dual clip for the comparison to test it.
  assert np.any((adv < 0) & (-3.0 * adv < _np_ppo_clip(logp, old, adv, 0.2, 0.28)[0]))
  pos = np.abs(adv)
  got = dual_clip(logp, old, pos, eps_low=0.2, eps_high=0.28, clip_c=3.0)
  ref = ppo_clip(logp, old, pos, eps_low=0.2, eps_high=0.28)
  np.testing.assert_array_equal(got[0], ref[0])
  np.testing.assert_array_equal(got[1], ref[1])


def test_gspo_by_hand():
  # Row 0: two valid tokens with log-ratios ln 4 and 0: s = exp(ln 4 / 2) = 2 > 1.28, A = 1 ->
  # every token gets -1.28, and the valid ones count as clipped. The padded log-prob is -inf and
  # must not leak into s. Row 1: one valid token, s = .9, A = -1: inside the range, loss .9.
  logp = jnp.array([[np.log(4.0), 0.0, -np.inf], [np.log(0.9), -np.inf, -np.inf]], jnp.float32)
  old = jnp.zeros_like(logp)
  adv = jnp.array([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
  mask = jnp.array([[True, True, False], [True, False, False]])
  loss, clipped = gspo(logp, old, adv, eps_low=0.2, eps_high=0.28, mask=mask)
  np.testing.assert_allclose(loss, [[-1.28] * 3, [0.9] * 3], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[True, True, False], [False, False, False]])
  total, denom = aggregate(loss, mask, "seq-mean-token-mean")
  np.testing.assert_allclose(total / denom, (-1.28 + 0.9) / 2, rtol=1e-6)
  # mask=None reads every token as valid; one-token sequences make it ppo_clip exactly.
  lp = jnp.log(jnp.array([[1.5], [0.5], [1.1]]))
  a = jnp.array([[1.0], [-1.0], [2.0]])
  np.testing.assert_allclose(gspo(lp, jnp.zeros_like(lp), a)[0], ppo_clip(lp, 0 * lp, a)[0])


def test_gspo_matches_numpy_and_clips_whole_sequences():
  logp, old, adv, mask = _ragged(2, sigma=0.5)
  loss, clipped = gspo(logp, old, adv, eps_low=0.05, eps_high=0.05, mask=mask)
  want, want_clipped = _np_gspo(logp, old, adv, mask, 0.05, 0.05)
  np.testing.assert_allclose(np.asarray(loss)[mask], want[mask], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(clipped, want_clipped)
  assert 0 < np.sum(want_clipped) < np.sum(mask)
  # Sequence-level: within a sequence every valid token is clipped or none is.
  for i in range(mask.shape[0]):
    assert len(set(np.asarray(clipped)[i][mask[i]].tolist())) <= 1


def test_cispo_hand_values_and_gradient_keeps_clipped_tokens():
  ratio, adv, _, _ = map(np.array, zip(*CASES, strict=True))
  logp = jnp.log(jnp.asarray(ratio, jnp.float32))
  old, a = jnp.zeros_like(logp), jnp.asarray(adv, jnp.float32)
  w = np.clip(ratio, 0.8, 1.28)
  loss, clipped = cispo(logp, old, a, eps_low=0.2, eps_high=0.28)
  np.testing.assert_allclose(loss, -w * adv * np.log(ratio), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(clipped, (ratio < 0.8) | (ratio > 1.28))
  # The gradient is -sg(w) * A everywhere: PPO zeroes clipped tokens, CISPO only caps their weight
  # (ratio 1.5, A = 1: -1.28 here where ppo_clip gives 0). Nothing flows into old_logp.
  f = lambda lp, o: jnp.sum(cispo(lp, o, a, eps_low=0.2, eps_high=0.28)[0])  # noqa: E731
  np.testing.assert_allclose(jax.grad(f)(logp, old), -w * adv, rtol=1e-6, atol=1e-7)
  assert np.all(np.asarray(jax.grad(f, argnums=1)(logp, old)) == 0.0)


def test_cispo_matches_numpy():
  logp, old, adv, _ = _ragged(3, sigma=0.5)
  loss, clipped = cispo(logp, old, adv, eps_low=0.2, eps_high=0.28)
  want, want_clipped = _np_cispo(logp, old, adv, 0.2, 0.28)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(clipped, want_clipped)
  assert 0 < np.sum(want_clipped) < want_clipped.size


def test_on_policy_gradients_agree_across_losses():
  # At ratio 1 every surrogate's gradient is -A / N per valid token (token-mean): PPO's ratio,
  # GSPO's length-normalised sequence ratio and CISPO's A * logp all differentiate to it.
  _, old, adv, mask = _ragged(4)
  logp = jnp.asarray(old)

  def grad(name):
    fn = POLICY_LOSSES.get(name)

    def loss(lp):
      per_token, _ = fn(lp, old, adv, eps_low=0.2, eps_high=0.28, mask=mask)
      total, denom = aggregate(per_token, mask)
      return total / denom

    return np.asarray(jax.grad(loss)(logp))

  want = np.where(mask, -adv / mask.sum(), 0.0)
  for name in ("ppo_clip", "dual_clip", "gspo", "cispo"):
    np.testing.assert_allclose(grad(name), want, rtol=1e-5, atol=1e-8, err_msg=name)


def _np_aggregate(per_token, mask, mode, max_tokens=None):
  per_token, mask = per_token.astype(np.float64), mask.astype(bool)
  if mode == "token-mean":
    return per_token[mask].sum(), mask.sum()
  rows = [per_token[i][mask[i]] for i in range(mask.shape[0]) if mask[i].any()]
  seq = {
    "seq-mean-token-mean": [r.mean() for r in rows],
    "seq-mean-token-sum": [r.sum() for r in rows],
    "seq-mean-token-sum-norm": [r.sum() / (max_tokens or 1) for r in rows],
  }[mode]
  return np.sum(seq), len(rows)


def test_aggregation_modes_by_hand():
  # Row 0 valid [1, 2] (mean 1.5, sum 3), row 1 valid [4, 5, 6] (mean 5, sum 15), row 2 empty;
  # the padded entry is inf and must not leak.
  per_token = jnp.array([[1.0, 2.0, jnp.inf], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
  want = {
    "token-mean": (18.0, 5.0),  # 18 / 5
    "seq-mean-token-mean": (6.5, 2.0),  # (1.5 + 5) / 2
    "seq-mean-token-sum": (18.0, 2.0),  # (3 + 15) / 2
    "seq-mean-token-sum-norm": (1.8, 2.0),  # (3 + 15) / 10 / 2
  }
  assert set(want) == set(AGGREGATIONS)
  for mode, (s, d) in want.items():
    total, denom = aggregate(per_token, mask, mode, max_tokens=10)
    np.testing.assert_allclose([total, denom], [s, d], rtol=1e-6, err_msg=mode)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_matches_numpy_and_microbatches_add_up(mode):
  rng = np.random.default_rng(5)
  per_token = rng.normal(size=(12, 13)).astype(np.float32)
  mask = rng.random((12, 13)) < rng.random((12, 1))
  mask[[3, 8]] = False  # empty sequences count in no denominator
  total, denom = aggregate(per_token, mask, mode, max_tokens=13)
  want_total, want_denom = _np_aggregate(per_token, mask, mode, max_tokens=13)
  np.testing.assert_allclose(total, want_total, rtol=1e-5, atol=1e-5)
  assert float(denom) == want_denom
  # Summing sums and denominators over micro-batches of whole sequences gives the full batch.
  parts = [
    aggregate(per_token[s], mask[s], mode, max_tokens=13) for s in np.split(np.arange(12), [5, 6])
  ]
  np.testing.assert_allclose(sum(float(p[0]) for p in parts), total, rtol=1e-5, atol=1e-5)
  assert sum(float(p[1]) for p in parts) == float(denom)


def test_aggregation_errors():
  with pytest.raises(ValueError, match=r"valid: \['token-mean', 'seq-mean-token-mean', 'seq-mean-"):
    aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "sum")
  with pytest.raises(ValueError, match="needs a constant max_tokens"):
    aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq-mean-token-sum-norm")


def test_registry_holds_every_policy_loss():
  assert POLICY_LOSSES.names() == ["cispo", "dual_clip", "gspo", "ppo_clip"]
  assert POLICY_LOSSES.get("gspo") is gspo
  # The common keyword set every caller may pass: token-level losses ignore mask and clip_c.
  x = jnp.zeros((2, 3))
  for name in POLICY_LOSSES.names():
    loss, clipped = POLICY_LOSSES.get(name)(
      x, x, x, eps_low=0.2, eps_high=0.2, mask=x > -1, clip_c=2.0
    )
    assert loss.shape == clipped.shape == (2, 3)
