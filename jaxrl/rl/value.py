"""PPO critic maths: per-token rewards, GAE(gamma, lambda) and the clipped value loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def terminal_rewards(rewards, mask) -> jax.Array:
  """Place each sequence's scalar reward on its last loss token. rewards: [B]; mask: [B, T].

  Returns [B, T] float32, zero elsewhere (rows with no loss token get nothing). Per-token terms
  such as a folded-in KL penalty (`jaxrl.rl.kl.kl_in_reward`) are added on top.
  """
  mask = jnp.asarray(mask, jnp.float32)
  t = mask.shape[1]
  # Index of the last 1 in each row: T - 1 - argmax of the reversed row.
  last = t - 1 - jnp.argmax(mask[:, ::-1], axis=1)
  has_any = jnp.any(mask > 0, axis=1)
  onehot = jax.nn.one_hot(last, t, dtype=jnp.float32) * has_any[:, None]
  return onehot * jnp.asarray(rewards, jnp.float32)[:, None]


def gae(
  rewards, values, mask, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16).

  rewards, values, mask: [B, T] over token columns; column t is the action "emit token t" and
  values[:, t] is V(s_t), the critic's estimate before that token. Only columns with mask = 1 are
  steps of the episode (the completion); the episode ends after its last masked column, so there
  is no bootstrap past it:
    delta_t = r_t + gamma * V(s_{t'}) * [t' exists] - V(s_t),   t' = the next masked column,
    A_t = delta_t + gamma * lam * A_{t'}.
  Masked-out columns (prompt, padding) are skipped, not treated as zero-reward steps, so left
  padding or a prompt in front does not change the result. Returns (advantages, returns) [B, T]
  float32 with returns = A + V on masked columns and zeros elsewhere; both carry no gradient.
  """
  if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
    raise ValueError(f"gae needs gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jax.lax.stop_gradient(jnp.asarray(values, jnp.float32))
  m = jnp.asarray(mask, jnp.float32)

  def step(carry, x):
    next_value, next_adv = carry  # at the next masked column (0 after the episode ends)
    r, v, mt = x
    delta = r + gamma * next_value - v
    adv = delta + gamma * lam * next_adv
    # An unmasked column passes the carry through untouched.
    carry = (jnp.where(mt > 0, v, next_value), jnp.where(mt > 0, adv, next_adv))
    return carry, adv * mt

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  xs = (rewards.T[::-1], values.T[::-1], m.T[::-1])  # time-major, reversed
  _, adv = jax.lax.scan(step, (zeros, zeros), xs)
  adv = adv[::-1].T
  return adv, (adv + values) * m


def value_loss(
  values, old_values, returns, mask, *, clip: float | None = 0.2
) -> tuple[jax.Array, jax.Array]:
  """Clipped value loss of PPO2 (OpenAI baselines; Engstrom et al. 2020, "Implementation Matters",
  arXiv 2005.12729): 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token.

  clip=None is the plain squared error. Returns (per-token loss [B, T], clipped [B, T] bool: the
  clipped branch is strictly larger) — aggregate with the mask as the policy loss is.
  """
  err = jnp.square(values - returns)
  if clip is None:
    return 0.5 * err * mask, jnp.zeros(values.shape, bool)
  if clip <= 0:
    raise ValueError(f"value clip must be > 0 or None, got {clip}")
  v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
  err_clipped = jnp.square(v_clipped - returns)
  return 0.5 * jnp.maximum(err, err_clipped) * mask, (err_clipped > err) & (mask > 0)
