"""Per-token KL(pi_theta || pi_ref) estimators from sampled log-probs (Schulman, "Approximating
KL divergence", 2020): k1 = log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r with r = pi_ref/pi."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kl_estimate(logp, ref_logp, kind: str = "k3") -> jax.Array:
  """logp, ref_logp: [...] float32 log-probs of the sampled tokens. Returns the per-token KL."""
  log_ratio = ref_logp - logp  # log(pi_ref / pi_theta)
  if kind == "k1":
    return -log_ratio
  if kind == "k2":
    return 0.5 * jnp.square(log_ratio)
  if kind == "k3":
    return jnp.expm1(log_ratio) - log_ratio
  raise ValueError(f"unknown KL estimator {kind!r}; valid: ['k1', 'k2', 'k3']")


def kl_in_reward(
  rewards_per_token, logp, ref_logp, beta: float, kind: str = "k1", mask=None
) -> jax.Array:
  """Per-token reward with the KL penalty folded in: r_t - beta * KL_t (Ziegler et al. 2019,
  eq. 2; Ouyang et al. 2022 InstructGPT eq. 2; REINFORCE++ Hu 2025 eq. 1).

  rewards_per_token, logp, ref_logp, mask: [B, T]. The penalty is a reward, not a loss term, so it
  carries no gradient (stop_gradient). k1 by default: its per-token values sum to the sequence
  log-ratio log(pi(y) / pi_ref(y)), the usual reward-shaping choice. Masked tokens keep r_t and
  get no penalty.
  """
  kl = jax.lax.stop_gradient(kl_estimate(logp, ref_logp, kind))
  if mask is not None:
    kl = jnp.where(jnp.asarray(mask, bool), kl, 0.0)
  return rewards_per_token - beta * kl
