"""Off-policy corrections (registered): IS weights for sampler-learner mismatch and staleness."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.config import OffPolicyConfig
from jaxrl.registry import IS_CORRECTIONS, OFFPOLICY

NO_CORRECTION = OffPolicyConfig()  # config.rl.offpolicy's defaults: no correction at all

# Notation, all [B, T] float32 log-probs of the sampled tokens: logp = log pi_theta (the learner,
# differentiable), behav = log pi_behav (the sampler's, TrainBatch.old_logprobs), prox = log
# pi_prox (the learner-side policy at the start of the update, TrainBatch.prox_logprobs). Every
# weight, mask and bound below is a stop-gradient quantity: gradients flow only through the policy
# loss's ratio exp(logp - old).


class Adjust(NamedTuple):
  """What an OFFPOLICY function hands the policy loss."""

  old_logp: jax.Array  # [B, T] the denominator of the policy-loss ratio
  anchor_logp: jax.Array  # [B, T] IS corrections weigh the mismatch pi_anchor / pi_behav
  anchor_weight: bool  # with no IS correction, still weigh by pi_anchor / pi_behav (decoupled)
  keep: jax.Array  # [B, T] bool: tokens not masked out by this correction
  eps_low: jax.Array | float  # possibly per-token clip bounds
  eps_high: jax.Array | float
  contracted: jax.Array  # [B, T] bool: tokens whose clip range this correction tightened


def _where(mask, x):
  """x on the loss tokens, 0 elsewhere (padded log-probs may be -inf: no products with masks)."""
  return jnp.where(jnp.asarray(mask, bool), x, 0.0)


def _default_anchor(logp, prox):
  return jax.lax.stop_gradient(logp) if prox is None else prox


# ------------------------------------------------------------------ IS corrections (mismatch)
# Called as fn(log_rho, mask, cfg) with log_rho = log(pi_anchor / pi_behav) [B, T] (detached) and
# cfg the whole config.rl.offpolicy section (each reads its own fields). Return (weight [B, T],
# truncated [B, T] bool, masked [B, T] bool).


def sequence_log_ratio(log_rho, mask) -> jax.Array:
  """Per-sequence log of the geometric-mean ratio, mean_t log rho_t over the loss tokens, broadcast
  to [B, T]. Geometric mean, not the product: a product over hundreds of tokens under- or
  overflows, and one fixed [lo, hi] band would mean different things for short and long answers
  (GSPO, arXiv 2507.18071, length-normalises its sequence ratio for the same reason)."""
  m = jnp.asarray(mask, bool)
  n = jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1).astype(jnp.float32)
  return jnp.broadcast_to(jnp.sum(_where(m, log_rho), axis=-1, keepdims=True) / n, log_rho.shape)


@IS_CORRECTIONS.register("none")
def no_is(log_rho, mask, cfg: OffPolicyConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """No mismatch correction: weight 1."""
  del mask, cfg
  false = jnp.zeros(log_rho.shape, bool)
  return jnp.ones(log_rho.shape, jnp.float32), false, false


@IS_CORRECTIONS.register("tis")
def tis(log_rho, mask, cfg: OffPolicyConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Truncated importance sampling, token level (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"; DART): w_t = min(rho_t, C),
  rho_t = pi_anchor / pi_behav, stop-gradient. Truncation bounds the variance a single token with a
  huge sampler-learner mismatch can add; C >= 1 leaves on-policy tokens (rho = 1) untouched.
  """
  del mask
  rho = jnp.exp(jax.lax.stop_gradient(log_rho))
  return jnp.minimum(rho, cfg.is_cap), rho > cfg.is_cap, jnp.zeros(rho.shape, bool)


@IS_CORRECTIONS.register("tis_seq")
def tis_seq(log_rho, mask, cfg: OffPolicyConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sequence-level TIS: every token of sequence i weighs min(rho_i, C), with rho_i the
  geometric-mean ratio of the sequence (see sequence_log_ratio)."""
  return tis(sequence_log_ratio(log_rho, mask), mask, cfg)


@IS_CORRECTIONS.register("mis")
def mis(log_rho, mask, cfg: OffPolicyConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Masked importance sampling, token level (IcePop, Ring-1T 2025; Yao et al. 2025 MIS): the
  weight is rho_t inside [lo, hi] and 0 outside, so tokens the sampler and learner disagree on
  too much are dropped from the gradient instead of being down-weighted. lo <= 1 <= hi leaves
  on-policy tokens untouched.
  """
  del mask
  rho = jnp.exp(jax.lax.stop_gradient(log_rho))
  out = (rho < cfg.mis_low) | (rho > cfg.mis_high)
  return jnp.where(out, 0.0, rho), jnp.zeros(rho.shape, bool), out


@IS_CORRECTIONS.register("mis_seq")
def mis_seq(log_rho, mask, cfg: OffPolicyConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sequence-level MIS: a whole sequence is masked when its geometric-mean ratio leaves
  [lo, hi]; otherwise every token weighs the sequence ratio."""
  return mis(sequence_log_ratio(log_rho, mask), mask, cfg)


# ------------------------------------------------------------------- off-policy (staleness)
# Called as fn(logp, behav, mask, advantages, cfg, *, prox, lag, eps_low, eps_high) on [B, T]
# arrays (prox may be None, lag is versions behind the learner, 0 on-policy), cfg the whole
# config.rl.offpolicy section and eps_low / eps_high the policy loss's clip range. Return Adjust.


@OFFPOLICY.register("none")
def no_offpolicy(
  logp, behav, mask, advantages, cfg, *, prox=None, lag=0.0, eps_low, eps_high
) -> Adjust:
  """Plain PPO ratio against the learner-side old policy when the batch carries one, else against
  the behaviour policy."""
  del advantages, cfg, lag
  old = behav if prox is None else prox
  false = jnp.zeros(logp.shape, bool)
  keep = jnp.asarray(mask, bool)
  return Adjust(old, _default_anchor(logp, prox), False, keep, eps_low, eps_high, false)


def interpolated_prox(logp, behav, lag) -> jax.Array:
  """Approximate proximal log-probs when no learner forward recomputed them (after A-3PO and the
  PPO-EWMA fallback of decoupled asynchronous RL): log-linear interpolation by version lag,

    log pi_prox = log pi_behav + alpha * (log pi_theta - log pi_behav),  alpha = lag / (lag + 1),

  detached. The behaviour policy is `lag` versions behind the start of the update and pi_theta at
  most one update past it; if the log-policy moves about equally per version, the start of the
  update sits lag / (lag + 1) of the way from behaviour to now. lag = 0 gives pi_prox = pi_behav,
  i.e. plain PPO with weight 1.
  """
  lag = jnp.maximum(jnp.asarray(lag, jnp.float32), 0.0)
  alpha = lag / (lag + 1.0)
  return behav + alpha * (jax.lax.stop_gradient(logp) - behav)


@OFFPOLICY.register("decoupled")
def decoupled(
  logp, behav, mask, advantages, cfg, *, prox=None, lag=0.0, eps_low, eps_high
) -> Adjust:
  """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", arXiv
  2110.00641; AReaL): ratio = [pi_prox / pi_behav] x [pi_theta / pi_prox],
  the PPO clip on pi_theta / pi_prox (the trust region around the recent learner policy) and
  pi_prox / pi_behav a stop-gradient weight (the staleness / mismatch correction; an IS
  correction, if configured, truncates or masks this weight). pi_prox is the batch's
  prox_logprobs (recomputed by a learner forward before the first minibatch moves the policy), or
  interpolated_prox by version lag when the batch has none.
  """
  del advantages, cfg
  if prox is None:
    prox = interpolated_prox(logp, behav, lag)
  false = jnp.zeros(logp.shape, bool)
  return Adjust(prox, prox, True, jnp.asarray(mask, bool), eps_low, eps_high, false)


def m2po_keep(log_ratio, mask, tau: float) -> jax.Array:
  """M2PO second-moment trust mask (arXiv 2510.01161): drop the tokens
  with the largest squared log-ratio, one at a time, until the mean of (log r)^2 over the kept
  loss tokens is <= tau; keep everything if it already is. Sorted ascending, the running mean of
  the k smallest values grows with k, so the kept set is the largest prefix whose mean is <= tau.
  Ties are broken by position. log_ratio, mask: [..., T]; returns bool [..., T].
  """
  m = jnp.asarray(mask, bool).reshape(-1)
  v = jnp.where(m, jnp.square(jax.lax.stop_gradient(log_ratio)).reshape(-1), jnp.inf)
  order = jnp.argsort(v, stable=True)
  sorted_v = v[order]
  n = jnp.sum(m)
  j = jnp.arange(1, v.size + 1)
  running = jnp.cumsum(jnp.where(j <= n, sorted_v, 0.0)) / j
  k = jnp.sum((running <= tau) & (j <= n))
  rank = jnp.zeros(v.size, jnp.int32).at[order].set(jnp.arange(v.size, dtype=jnp.int32))
  return ((rank < k) & m).reshape(jnp.shape(mask))


@OFFPOLICY.register("m2po")
def m2po(logp, behav, mask, advantages, cfg, *, prox=None, lag=0.0, eps_low, eps_high) -> Adjust:
  """M2PO (arXiv 2510.01161): mask only the extreme-ratio tokens so that the batch's second
  moment of log(pi_theta / pi_behav) is <= tau (m2po_keep). The paper drops PPO's clip and relies
  on this mask alone; pair it with wide eps_low / eps_high (or cispo) to reproduce that. With
  micro-batches the moment is taken per micro-batch (the tokens one loss call sees).
  """
  del advantages, lag
  old = behav if prox is None else prox
  keep = m2po_keep(logp - behav, mask, cfg.m2po_tau)
  false = jnp.zeros(logp.shape, bool)
  return Adjust(old, _default_anchor(logp, prox), False, keep, eps_low, eps_high, false)


def sat_bounds(
  log_ratio, mask, advantages, *, eps_low, eps_high, sat_tail: float = 2.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Staleness-adaptive clip bounds (SAT). What the abstract states, and
  how each part is read here:
  - staleness proxy: "the detached sampled log-ratio": d_t = |sg(log pi_theta - log pi_behav)|
    (not the version lag: the abstract's proxy also sees engine mismatch and routing drift);
  - "identifies high-mismatch tails within each batch via staleness-based kernel scaling": a token
    is in the tail when d_t > tau = sat_tail * RMS(d) over the batch's loss tokens, and its
    endpoint shrinks by the kernel k_t = exp(-(d_t - tau)_+ / eps) (eps the endpoint's nominal
    half-width, so excesses small against the clip range barely move it; an assumption);
  - "contracts only the sign-selected endpoint": the endpoint an outward update heads for, the
    upper one 1 + eps_high * k_t when A > 0 (the update raises the ratio) and the lower one
    1 - eps_low * k_t when A < 0. Ordinary tokens (d_t <= tau) keep the PPO interval exactly,
    the contracted interval lies inside the nominal one and the loss is never below PPO's
    (the abstract's containment and pessimism).
  Returns (eps_low [B, T], eps_high [B, T], contracted [B, T] bool).
  """
  m = jnp.asarray(mask, bool)
  d = _where(m, jnp.abs(jax.lax.stop_gradient(log_ratio)))
  rms = jnp.sqrt(jnp.sum(jnp.square(d)) / jnp.maximum(jnp.sum(m), 1))
  excess = jnp.maximum(d - sat_tail * rms, 0.0)
  tail = m & (excess > 0)
  up = tail & (advantages > 0)
  down = tail & (advantages < 0)
  lo = jnp.where(down, eps_low * jnp.exp(-excess / eps_low), eps_low)
  hi = jnp.where(up, eps_high * jnp.exp(-excess / eps_high), eps_high)
  return lo, hi, up | down


@OFFPOLICY.register("sat")
def sat(logp, behav, mask, advantages, cfg, *, prox=None, lag=0.0, eps_low, eps_high) -> Adjust:
  """SAT staleness-adaptive trust region: PPO (or GSPO, as in the
  paper's SAT-GSPO) with the per-token bounds of sat_bounds."""
  del lag
  old = behav if prox is None else prox
  lo, hi, contracted = sat_bounds(
    logp - behav, mask, advantages, eps_low=eps_low, eps_high=eps_high, sat_tail=cfg.sat_tail
  )
  keep = jnp.asarray(mask, bool)
  return Adjust(old, _default_anchor(logp, prox), False, keep, lo, hi, contracted)


# ----------------------------------------------------------------------------- composition


class Correction(NamedTuple):
  old_logp: jax.Array  # [B, T] ratio denominator for the policy loss
  weight: jax.Array  # [B, T] stop-gradient multiplier of the per-token loss (0 = masked out)
  eps_low: jax.Array | float
  eps_high: jax.Array | float
  clipped: jax.Array  # [B, T] bool: weight truncated or clip range contracted
  masked: jax.Array  # [B, T] bool: masked out by MIS or M2PO


def correct(
  logp,
  behav,
  mask,
  advantages,
  cfg: OffPolicyConfig = NO_CORRECTION,
  *,
  prox=None,
  lag=0.0,
  eps_low: float = 0.2,
  eps_high: float = 0.2,
) -> Correction:
  """Apply an OFFPOLICY correction, then an IS correction of the mismatch pi_anchor / pi_behav.

  pi_anchor is pi_prox when the batch carries it (or decoupled interpolates it): then the policy
  loss's ratio is pi_theta / pi_prox and the weight corrects only the sampler-learner gap, Yao et
  al.'s exact form. Without pi_prox the anchor is sg(pi_theta), i.e. the weight is computed from
  sg(pi_theta / pi_behav) as written in TIS / MIS; either way rho = 1 on on-policy data and the
  loss is then exactly the uncorrected one. Under decoupled with is_correction 'none' the weight
  is the raw pi_prox / pi_behav. `cfg` is config.rl.offpolicy, handed over whole.
  """
  adj = OFFPOLICY.get(cfg.method)(
    logp, behav, mask, advantages, cfg, prox=prox, lag=lag, eps_low=eps_low, eps_high=eps_high
  )
  log_rho = jax.lax.stop_gradient(adj.anchor_logp - behav)
  log_rho = _where(mask, log_rho)
  if cfg.is_correction == "none" and adj.anchor_weight:
    w, truncated, masked = jnp.exp(log_rho), jnp.zeros(logp.shape, bool), ~adj.keep
  else:
    w, truncated, masked = IS_CORRECTIONS.get(cfg.is_correction)(log_rho, mask, cfg)
    masked = masked | ~adj.keep
  m = jnp.asarray(mask, bool)
  weight = jnp.where(masked, 0.0, w)
  return Correction(
    adj.old_logp,
    jax.lax.stop_gradient(weight),
    adj.eps_low,
    adj.eps_high,
    (truncated | adj.contracted) & m,
    masked & m,
  )


def masked_quantile(x, mask, q: float) -> jax.Array:
  """The q-quantile (numpy's default linear interpolation) of x over mask; 0 if mask is empty."""
  m = jnp.asarray(mask, bool).reshape(-1)
  v = jnp.sort(jnp.where(m, x.reshape(-1), -jnp.inf))
  n = jnp.sum(m)
  start = v.size - n  # the valid values are the last n of the ascending sort
  pos = q * jnp.maximum(n - 1, 0).astype(jnp.float32)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  a, b = v[jnp.minimum(start + lo, v.size - 1)], v[jnp.minimum(start + hi, v.size - 1)]
  return jnp.where(n > 0, a + (pos - lo) * (b - a), 0.0)


def diagnostics(logp, behav, mask, corr: Correction) -> dict:
  """Per-step off-policy metrics as {name: (sum, count)} (the train step divides, so they are
  the same however the batch is split into micro-batches): KL(pi_behav || pi_theta) by
  k1 = -log r and k3 = (r - 1) - log r with r = pi_theta / pi_behav (Schulman 2020; unbiased
  since the tokens were sampled from pi_behav), and the fractions of loss tokens clipped (weight
  truncated or range contracted) and masked out. The max and percentiles of r are not sums:
  ratio_stats reports them over a whole batch.
  """
  m = jnp.asarray(mask, bool)
  mf = m.astype(jnp.float32)
  n = jnp.sum(mf)
  log_r = _where(m, jax.lax.stop_gradient(logp) - behav)
  return {
    "offpolicy/kl_k1": (jnp.sum(_where(m, -log_r)), n),
    "offpolicy/kl_k3": (jnp.sum(_where(m, jnp.expm1(log_r) - log_r)), n),
    "offpolicy/clipped_frac": (jnp.sum(corr.clipped * mf), n),
    "offpolicy/masked_frac": (jnp.sum(corr.masked * mf), n),
  }


def ratio_stats(logp, behav, mask) -> dict:
  """Whole-batch statistics of the sampler-learner mismatch over the loss tokens, taken at the
  start of each update, before any minibatch moves the policy: the IS ratio r = pi_theta /
  pi_behav's max and 99th percentile, and |log pi_theta - log pi_behav|'s mean and 99th
  percentile with the token KL(pi_behav || pi_theta) (k3): with k = 0 these measure what the
  sampler computes differently (quantized weights, another kernel), with a lag the drift too.
  Returns {name: float32 scalar}."""
  m = jnp.asarray(mask, bool)
  log_r = _where(m, logp - behav)
  r = jnp.exp(log_r)
  n = jnp.maximum(jnp.sum(m), 1)
  gap = jnp.abs(log_r)
  return {
    "offpolicy/ratio_max": jnp.max(jnp.where(m, r, 0.0)),
    "offpolicy/ratio_p99": masked_quantile(r, m, 0.99),
    "mismatch/abs_logp_mean": jnp.sum(jnp.where(m, gap, 0.0)) / n,
    "mismatch/abs_logp_p99": masked_quantile(gap, m, 0.99),
    "mismatch/kl_k3": jnp.sum(jnp.where(m, jnp.expm1(log_r) - log_r, 0.0)) / n,
  }
