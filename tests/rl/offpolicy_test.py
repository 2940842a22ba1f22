"""Off-policy corrections: hand values, numpy references on ragged masks, on-policy invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import OffPolicyConfig
from jaxrl.rl import offpolicy
from jaxrl.rl.losses import ppo_clip
from jaxrl.rl.offpolicy import IS_CORRECTIONS, OFFPOLICY

B, T = 5, 11


def _arrays(seed, spread=0.4):
  """Random log-probs, ragged masks (one row empty) and per-sequence advantages."""
  rng = np.random.default_rng(seed)
  behav = -rng.uniform(0.1, 3.0, size=(B, T))
  logp = behav + rng.normal(0.0, spread, size=(B, T))
  start = rng.integers(0, 4, size=(B, 1))
  end = rng.integers(5, T + 1, size=(B, 1))
  cols = np.arange(T)[None]
  mask = (cols >= start) & (cols < end)
  mask[2] = False  # a row with no loss tokens
  adv = rng.normal(size=(B, 1)) * np.ones((1, T))
  logp[~mask] = -np.inf  # padded log-probs may be -inf: nothing may read them
  return logp, behav, mask, adv


def _j(*xs):
  return [jnp.asarray(x, jnp.float32) if x.dtype != bool else jnp.asarray(x) for x in xs]


# ---------------------------------------------------------------------------- numpy references


def np_seq_log_ratio(log_rho, mask):
  n = np.maximum(mask.sum(-1, keepdims=True), 1)
  return np.broadcast_to(np.where(mask, log_rho, 0).sum(-1, keepdims=True) / n, log_rho.shape)


def np_is(name, log_rho, mask, cap=2.0, lo=0.5, hi=2.0):
  if name.endswith("_seq"):
    log_rho = np_seq_log_ratio(log_rho, mask)
  rho = np.exp(log_rho)
  if name.startswith("tis"):
    return np.minimum(rho, cap), rho > cap, np.zeros_like(mask)
  out = (rho < lo) | (rho > hi)
  return np.where(out, 0.0, rho), np.zeros_like(mask), out


def np_m2po_keep(log_ratio, mask, tau):
  """Literal greedy: drop the largest (log r)^2 one by one until the kept mean is <= tau."""
  keep = mask.copy()
  sq = np.where(mask, log_ratio, 0.0) ** 2
  while keep.sum() and sq[keep].mean() > tau:
    flat = np.where(keep, sq, -1.0)
    keep[np.unravel_index(np.argmax(flat), flat.shape)] = False
  return keep


def np_sat_bounds(log_ratio, mask, adv, eps_low, eps_high, k):
  d = np.where(mask, np.abs(np.where(mask, log_ratio, 0.0)), 0.0)
  rms = np.sqrt((d**2).sum() / max(mask.sum(), 1))
  excess = np.maximum(d - k * rms, 0.0)
  tail = mask & (excess > 0)
  lo = np.where(tail & (adv < 0), eps_low * np.exp(-excess / eps_low), eps_low)
  hi = np.where(tail & (adv > 0), eps_high * np.exp(-excess / eps_high), eps_high)
  return lo, hi, tail & (adv != 0)


# --------------------------------------------------------------------------------- hand values


def test_token_level_is_hand_values():
  rho = np.array([[0.3, 0.6, 1.0, 1.5, 2.5, 9.0]])
  mask = np.ones_like(rho, bool)
  (log_rho,) = _j(np.log(rho))
  w, trunc, masked = offpolicy.tis(log_rho, mask, OffPolicyConfig(is_cap=2.0))
  np.testing.assert_allclose(w, [[0.3, 0.6, 1.0, 1.5, 2.0, 2.0]], rtol=1e-6)
  assert trunc.tolist() == [[False, False, False, False, True, True]] and not masked.any()
  w, trunc, masked = offpolicy.mis(log_rho, mask, OffPolicyConfig(mis_low=0.5, mis_high=2.0))
  np.testing.assert_allclose(w, [[0.0, 0.6, 1.0, 1.5, 0.0, 0.0]], rtol=1e-6)
  assert masked.tolist() == [[True, False, False, False, True, True]] and not trunc.any()


def test_sequence_level_uses_the_geometric_mean_ratio():
  # Row 0: ratios 4 and 1/4 -> geometric mean 1 (a product would also be 1); row 1: 4 and 4 on
  # two valid tokens, the third padded -> geometric mean 4, the product 16.
  rho = np.array([[4.0, 0.25, 1.0], [4.0, 4.0, 123.0]])
  mask = np.array([[True, True, False], [True, True, False]])
  (log_rho,) = _j(np.log(rho))
  w, trunc, _ = offpolicy.tis_seq(log_rho, mask, OffPolicyConfig(is_cap=3.0))
  np.testing.assert_allclose(w, [[1.0] * 3, [3.0] * 3], rtol=1e-6)
  assert trunc[1].all() and not trunc[0].any()
  w, _, masked = offpolicy.mis_seq(log_rho, mask, OffPolicyConfig(mis_low=0.5, mis_high=5.0))
  np.testing.assert_allclose(w, [[1.0] * 3, [4.0] * 3], rtol=1e-6)
  assert not masked.any()
  _, _, masked = offpolicy.mis_seq(log_rho, mask, OffPolicyConfig(mis_low=0.5, mis_high=2.0))
  assert masked.tolist() == [[False] * 3, [True] * 3]


def test_m2po_hand_values():
  # (log r)^2 = 0, .01, .04, .25 (mean .075). tau = .05: drop .25 -> mean .0167 <= .05.
  log_r = np.array([[0.0, 0.1, -0.2, 0.5]])
  mask = np.ones_like(log_r, bool)
  keep = offpolicy.m2po_keep(jnp.asarray(log_r, jnp.float32), mask, 0.05)
  assert keep.tolist() == [[True, True, True, False]]
  keep = offpolicy.m2po_keep(jnp.asarray(log_r, jnp.float32), mask, 0.075)  # already at tau
  assert keep.all()
  keep = offpolicy.m2po_keep(jnp.asarray(log_r, jnp.float32), mask, 0.004)  # only 0 survives
  assert keep.tolist() == [[True, False, False, False]]


def test_sat_contracts_only_the_sign_selected_endpoint_of_tail_tokens():
  # d = |log r| = [0, 0, 0, 0, 0, 0, 0, 1.2]: RMS = 1.2 / sqrt(8) = .424, tail (k = 2) at .849.
  log_r = np.zeros((1, 8))
  log_r[0, -1] = 1.2
  mask = np.ones_like(log_r, bool)
  for a, side in ((1.0, "high"), (-1.0, "low")):
    adv = np.full_like(log_r, a)
    lo, hi, contracted = offpolicy.sat_bounds(
      *_j(log_r), mask, jnp.asarray(adv), eps_low=0.2, eps_high=0.28, sat_tail=2.0
    )
    excess = 1.2 - 2.0 * 1.2 / np.sqrt(8)
    want_lo = np.full(8, 0.2)
    want_hi = np.full(8, 0.28)
    if side == "high":
      want_hi[-1] = 0.28 * np.exp(-excess / 0.28)
    else:
      want_lo[-1] = 0.2 * np.exp(-excess / 0.2)
    np.testing.assert_allclose(lo[0], want_lo, rtol=1e-5)
    np.testing.assert_allclose(hi[0], want_hi, rtol=1e-5)
    assert contracted.tolist() == [[False] * 7 + [True]]


# ------------------------------------------------------------------------ numpy on ragged masks


@pytest.mark.parametrize("name", ["tis", "tis_seq", "mis", "mis_seq"])
def test_is_corrections_match_numpy(name):
  logp, behav, mask, _ = _arrays(seed=1, spread=0.6)
  shift = np.array([[-0.9], [0.0], [0.3], [0.8], [0.1]])  # so whole sequences leave the band
  log_rho = np.where(mask, logp - behav + shift, 0.0)
  w, trunc, masked = IS_CORRECTIONS.get(name)(
    jnp.asarray(log_rho, jnp.float32), mask, OffPolicyConfig(is_cap=1.5, mis_low=0.6, mis_high=1.7)
  )
  want_w, want_t, want_m = np_is(name, log_rho, mask, cap=1.5, lo=0.6, hi=1.7)
  np.testing.assert_allclose(np.where(mask, w, 0), np.where(mask, want_w, 0), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(trunc) & mask, want_t & mask)
  np.testing.assert_array_equal(np.asarray(masked) & mask, want_m & mask)
  assert 0 < (want_t | want_m)[mask].sum() < mask.sum()  # both outcomes occur


@pytest.mark.parametrize("tau", [0.01, 0.05, 0.2, 10.0])
def test_m2po_matches_the_literal_greedy(tau):
  logp, behav, mask, _ = _arrays(seed=2, spread=0.3)
  log_r = np.where(mask, logp - behav, 0.0)
  keep = offpolicy.m2po_keep(jnp.asarray(log_r, jnp.float32), mask, tau)
  want = np_m2po_keep(log_r, mask, tau)
  np.testing.assert_array_equal(keep, want)
  kept = log_r[want] ** 2
  assert kept.size == 0 or kept.mean() <= tau


def test_sat_matches_numpy():
  logp, behav, mask, adv = _arrays(seed=3, spread=0.5)
  log_r = np.where(mask, logp - behav, 0.0)
  lo, hi, contracted = offpolicy.sat_bounds(
    *_j(log_r), mask, jnp.asarray(adv, jnp.float32), eps_low=0.2, eps_high=0.28, sat_tail=1.5
  )
  want_lo, want_hi, want_c = np_sat_bounds(log_r, mask, adv, 0.2, 0.28, 1.5)
  np.testing.assert_allclose(lo, want_lo, rtol=1e-5)
  np.testing.assert_allclose(hi, want_hi, rtol=1e-5)
  np.testing.assert_array_equal(contracted, want_c)
  assert 0 < want_c.sum() < mask.sum()
  assert np.all(lo <= 0.2 + 1e-7) and np.all(hi <= 0.28 + 1e-7)  # inside the PPO interval


@pytest.mark.parametrize("offp", OFFPOLICY.names())
@pytest.mark.parametrize("isc", IS_CORRECTIONS.names())
def test_composed_loss_matches_numpy(offp, isc):
  """correct() + ppo_clip, token by token, against a numpy composition (prox given, as the loop
  fills it for IS corrections and recomputed decoupled)."""
  logp, behav, mask, adv = _arrays(seed=4, spread=0.5)
  rng = np.random.default_rng(5)
  prox = np.where(mask, behav + rng.normal(0.0, 0.3, size=(B, T)), 0.0)
  cfg = OffPolicyConfig(
    method=offp,
    is_correction=isc,
    is_cap=1.5,
    mis_low=0.6,
    mis_high=1.7,
    m2po_tau=0.1,
    sat_tail=1.5,
  )
  jl, jb, ja, jp = _j(np.where(mask, logp, 0.0), behav, adv, prox)
  corr = offpolicy.correct(jl, jb, mask, ja, cfg, prox=jp, eps_low=0.2, eps_high=0.28)
  loss, _ = ppo_clip(jl, corr.old_logp, ja, eps_low=corr.eps_low, eps_high=corr.eps_high)
  got = np.where(mask, np.where(corr.weight > 0, corr.weight * loss, 0.0), 0.0)

  lp = np.where(mask, logp, 0.0)
  lo, hi, keep = 0.2, 0.28, mask.copy()
  if offp == "m2po":
    keep = np_m2po_keep(np.where(mask, lp - behav, 0.0), mask, 0.1)
  if offp == "sat":
    lo, hi, _ = np_sat_bounds(lp - behav, mask, adv, 0.2, 0.28, 1.5)
  log_rho = np.where(mask, prox - behav, 0.0)
  if isc == "none":
    w = np.exp(log_rho) if offp == "decoupled" else np.ones_like(lp)
    out = np.zeros_like(mask)
  else:
    w, _, out = np_is(isc, log_rho, mask, cap=1.5, lo=0.6, hi=1.7)
  w = np.where(out | ~keep, 0.0, w)
  ratio = np.exp(lp - prox)
  ppo = np.maximum(-ratio * adv, -np.clip(ratio, 1 - lo, 1 + hi) * adv)
  want = np.where(mask, w * ppo, 0.0)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(corr.masked), (out | ~keep) & mask)


def test_interpolated_prox_by_version_lag():
  logp, behav = np.array([[-1.0, -1.0, -1.0]]), np.array([[-2.0, -2.0, -2.0]])
  lag = np.array([[0.0, 1.0, 3.0]])  # alpha = 0, 1/2, 3/4
  prox = offpolicy.interpolated_prox(*_j(logp, behav, lag))
  np.testing.assert_allclose(prox, [[-2.0, -1.5, -1.25]], rtol=1e-6)


# ------------------------------------------------------------------------ on-policy invariance


@pytest.mark.parametrize("offp", OFFPOLICY.names())
@pytest.mark.parametrize("isc", IS_CORRECTIONS.names())
def test_on_policy_data_is_left_unchanged(offp, isc):
  """ratio 1 everywhere (behaviour = learner, no prox, lag 0) => weight 1, nothing masked or
  contracted, PPO's own bounds: the same loss and gradient as no correction."""
  logp, _, mask, adv = _arrays(seed=6)
  lp = jnp.asarray(np.where(mask, logp, 0.0), jnp.float32)
  ja = jnp.asarray(adv, jnp.float32)

  def total(lp_, name_off, name_is):
    cfg = OffPolicyConfig(method=name_off, is_correction=name_is)
    corr = offpolicy.correct(jax.lax.stop_gradient(lp_), lp, mask, ja, cfg)
    loss, _ = ppo_clip(lp_, corr.old_logp, ja, eps_low=corr.eps_low, eps_high=corr.eps_high)
    return jnp.sum(jnp.where(mask, corr.weight * loss, 0.0)), corr

  (v, corr), g = jax.value_and_grad(total, has_aux=True)(lp, offp, isc)
  (v0, _), g0 = jax.value_and_grad(total, has_aux=True)(lp, "none", "none")
  assert not np.asarray(corr.masked).any() and not np.asarray(corr.clipped).any()
  np.testing.assert_array_equal(np.asarray(corr.weight)[mask], 1.0)
  np.testing.assert_allclose(v, v0, rtol=0, atol=0)
  np.testing.assert_allclose(g, g0, rtol=0, atol=0)


# --------------------------------------------------------------------------------- diagnostics


def test_diagnostics_match_numpy():
  logp, behav, mask, adv = _arrays(seed=7, spread=0.5)
  jl, jb, ja = _j(np.where(mask, logp, 0.0), behav, adv)
  cfg = OffPolicyConfig(method="m2po", is_correction="tis", m2po_tau=0.1)
  corr = offpolicy.correct(jl, jb, mask, ja, cfg)
  got = {k: (float(s), float(c)) for k, (s, c) in offpolicy.diagnostics(jl, jb, mask, corr).items()}
  lr_full = np.where(mask, logp - behav, 0.0)
  lr = lr_full[mask]
  r = np.exp(lr)
  n = mask.sum()
  want = {
    "offpolicy/kl_k1": (np.sum(-lr), n),
    "offpolicy/kl_k3": (np.sum(np.expm1(lr) - lr), n),
    "offpolicy/clipped_frac": ((r > 2.0).sum(), n),
    "offpolicy/masked_frac": ((~np_m2po_keep(lr_full, mask, 0.1))[mask].sum(), n),
  }
  assert got.keys() == want.keys()
  for k, (s, c) in want.items():
    np.testing.assert_allclose(got[k][0], s, rtol=1e-5, atol=1e-6, err_msg=k)
    assert got[k][1] == c, k
  assert want["offpolicy/kl_k3"][0] >= 0 and want["offpolicy/masked_frac"][0] > 0
  stats = offpolicy.ratio_stats(jl, jb, mask)
  np.testing.assert_allclose(stats["offpolicy/ratio_max"], r.max(), rtol=1e-5)
  np.testing.assert_allclose(stats["offpolicy/ratio_p99"], np.percentile(r, 99), rtol=1e-5)
  # The mismatch monitor: |log r| mean and p99, token KL (k3), over the loss tokens only.
  np.testing.assert_allclose(stats["mismatch/abs_logp_mean"], np.abs(lr).mean(), rtol=1e-5)
  np.testing.assert_allclose(
    stats["mismatch/abs_logp_p99"], np.percentile(np.abs(lr), 99), rtol=1e-5
  )
  np.testing.assert_allclose(stats["mismatch/kl_k3"], np.mean(np.expm1(lr) - lr), rtol=1e-5)


def test_masked_quantile_matches_numpy():
  rng = np.random.default_rng(8)
  x = rng.normal(size=(4, 9))
  mask = rng.random((4, 9)) < 0.6
  for q in (0.0, 0.5, 0.9, 0.99, 1.0):
    got = offpolicy.masked_quantile(jnp.asarray(x, jnp.float32), mask, q)
    np.testing.assert_allclose(got, np.quantile(x[mask], q), rtol=1e-5, atol=1e-6)
  assert float(offpolicy.masked_quantile(jnp.zeros((2, 3)), np.zeros((2, 3), bool), 0.99)) == 0.0


def test_unknown_names_list_the_valid_ones():
  args = _j(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), np.zeros((1, 2)))
  with pytest.raises(ValueError, match=r"unknown off-policy correction 'x'; valid: \[.*'m2po'"):
    offpolicy.correct(*args, OffPolicyConfig(method="x"))
  with pytest.raises(ValueError, match=r"importance-sampling correction 'y'; valid: \[.*'tis'"):
    offpolicy.correct(*args, OffPolicyConfig(is_correction="y"))
