"""Policy losses (registered, per token) and loss aggregation returning (sum, denominator)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl.rl.registry import Registry

POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = ("token-mean",)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logp, old_logp, advantages, *, eps_low: float = 0.2, eps_high: float = 0.2):
  """PPO clipped surrogate (Schulman et al. 2017, eq. 7), per token, with the asymmetric range
  [1 - eps_low, 1 + eps_high] (eps_high > eps_low is DAPO's clip-higher).

  loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), ratio = exp(logp - old_logp).
  Returns (loss [...], clipped [...] bool: the clipped branch is the active one).
  """
  ratio = jnp.exp(logp - old_logp)
  unclipped = -ratio * advantages
  clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
  return jnp.maximum(unclipped, clipped), clipped > unclipped


def aggregate(per_token, mask, mode: str = "token-mean"):
  """Reduce a per-token quantity to (weighted_sum, denominator); never a mean of means.

  token-mean: every unmasked token of the whole batch weighs the same (DAPO's token-level loss).
  """
  mask = mask.astype(jnp.float32)
  if mode == "token-mean":
    return jnp.sum(per_token * mask), jnp.sum(mask)
  raise ValueError(f"unknown loss aggregation {mode!r}; valid: {list(AGGREGATIONS)}")
