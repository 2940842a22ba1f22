"""Per-token KL(pi_theta || pi_ref) estimators from sampled log-probs (Schulman, "Approximating
KL divergence", 2020): k1 = log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r with r = pi_ref/pi."""

from __future__ import annotations

import jax.numpy as jnp


def kl_estimate(logp, ref_logp, kind: str = "k3"):
  """logp, ref_logp: [...] float32 log-probs of the sampled tokens. Returns the per-token KL."""
  log_ratio = ref_logp - logp  # log(pi_ref / pi_theta)
  if kind == "k1":
    return -log_ratio
  if kind == "k2":
    return 0.5 * jnp.square(log_ratio)
  if kind == "k3":
    return jnp.expm1(log_ratio) - log_ratio
  raise ValueError(f"unknown KL estimator {kind!r}; valid: ['k1', 'k2', 'k3']")
