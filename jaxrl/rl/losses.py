"""Policy losses (registered, per token) and loss aggregation returning (sum, denominator)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.config import LOSS_AGGREGATIONS as AGGREGATIONS
from jaxrl.registry import POLICY_LOSSES

# Every policy loss is called as fn(logp, old_logp, advantages, *, eps_low, eps_high, mask=None,
# **options) on [B, T] float32 arrays and returns (loss [B, T], clipped [B, T] bool). Callers pass
# one common set of options, so each loss ignores the ones it does not use via **_. Token-level
# losses ignore mask (aggregate applies it); sequence-level ones need it.


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
  logp, old_logp, advantages, *, eps_low: float = 0.2, eps_high: float = 0.2, mask=None, **_
) -> tuple[jax.Array, jax.Array]:
  """PPO clipped surrogate (Schulman et al. 2017, eq. 7), per token, with the asymmetric range
  [1 - eps_low, 1 + eps_high] (eps_high > eps_low is DAPO's clip-higher).

  loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), ratio = exp(logp - old_logp).
  Returns (loss [...], clipped [...] bool: the clipped branch is the active one).
  """
  del mask
  ratio = jnp.exp(logp - old_logp)
  unclipped = -ratio * advantages
  clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
  return jnp.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("dual_clip")
def dual_clip(
  logp,
  old_logp,
  advantages,
  *,
  eps_low: float = 0.2,
  eps_high: float = 0.2,
  clip_c: float = 3.0,
  mask=None,
  **_,
) -> tuple[jax.Array, jax.Array]:
  """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv 1912.09729):
  for A < 0 the objective max(min(ratio A, clip(ratio) A), c A) also bounds the loss by -c A, so a
  huge ratio on a bad (often stale, off-policy) token cannot blow the loss up. For A >= 0 it is
  ppo_clip exactly. clip_c > 1. clipped marks tokens where either clip is the active branch.
  TBPO/QaRL uses it for low-precision rollouts.
  """
  del mask
  if not clip_c > 1.0:
    raise ValueError(f"dual_clip: clip_c must be > 1, got {clip_c}")
  loss, clipped = ppo_clip(logp, old_logp, advantages, eps_low=eps_low, eps_high=eps_high)
  bound = -clip_c * advantages
  dual = (advantages < 0) & (bound < loss)
  return jnp.where(dual, bound, loss), clipped | dual


@POLICY_LOSSES.register("gspo")
def gspo(
  logp, old_logp, advantages, *, eps_low: float = 0.2, eps_high: float = 0.2, mask=None, **_
) -> tuple[jax.Array, jax.Array]:
  """GSPO sequence-level clipped surrogate (Zheng et al. 2025, arXiv 2507.18071, GSPO objective):
  s_i = exp(mean_{t valid} (logp - old_logp)) = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), and every
  token of sequence i gets loss -min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A), so the whole
  sequence is clipped or kept together. The paper's ranges are ~1e-3 wide (length-normalised
  ratios sit near 1). With A constant within a sequence and seq-mean-token-mean aggregation this
  is the paper's objective. mask [B, T] (None: every token valid) marks the tokens of |y_i|.
  """
  mask = jnp.ones(logp.shape, bool) if mask is None else jnp.asarray(mask, bool)
  n = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  # where, not a product: padded log-probs may be -inf, and 0 * inf would poison the sum.
  log_ratio = jnp.where(mask, logp - old_logp, 0.0)
  s = jnp.exp(jnp.sum(log_ratio, axis=-1, keepdims=True) / jnp.maximum(n, 1.0))  # [B, 1]
  unclipped = -s * advantages
  clipped = -jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high) * advantages
  return jnp.maximum(unclipped, clipped), (clipped > unclipped) & mask


@POLICY_LOSSES.register("cispo")
def cispo(
  logp,
  old_logp,
  advantages,
  *,
  eps_low: float = 0.2,
  eps_high: float = 0.2,
  mask=None,
  detached_logp=None,
  **_,
) -> tuple[jax.Array, jax.Array]:
  """CISPO (MiniMax-M1, MiniMax 2025, arXiv 2506.13585): REINFORCE with a clipped,
  stop-gradient importance weight, loss = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp.
  Unlike PPO no token's gradient is dropped, only its weight is bounded (MiniMax sets a large
  eps_low, i.e. effectively no lower bound). The loss value is not a surrogate of the return;
  only its gradient is meaningful. clipped marks tokens whose weight was clipped. detached_logp
  (default logp) is what the weight reads: a finite-difference check freezes it at fixed params.
  """
  del mask
  ratio = jnp.exp((logp if detached_logp is None else detached_logp) - old_logp)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  return -weight * advantages * logp, weight != ratio


def aggregate(
  per_token, mask, mode: str = "token-mean", *, max_tokens: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """Reduce a per-token quantity [..., T] to (weighted_sum, denominator); never a mean of means.

  sum / denominator is the loss, and summing both over micro-batches that split the batch along
  whole sequences gives the full-batch value (the train step divides once, at the end).
  - token-mean: every unmasked token of the batch weighs the same (DAPO's token-level loss).
  - seq-mean-token-mean: mean over sequences of each sequence's token mean (GRPO's original
    1/G sum_i 1/|y_i| sum_t; the sum carries each sequence's token mean).
  - seq-mean-token-sum: mean over sequences of each sequence's token sum.
  - seq-mean-token-sum-norm: token sums divided by the constant max_tokens, then the mean over
    sequences (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783: a constant normaliser has no length
    bias).
  For the seq-mean modes the denominator counts sequences with at least one valid token.
  """
  m = jnp.asarray(mask).astype(jnp.float32)
  # where, not a product: a padded token's loss may be inf or nan, and 0 * inf is nan.
  masked = jnp.where(m > 0, per_token, 0.0)
  if mode == "token-mean":
    return jnp.sum(masked), jnp.sum(m)
  if mode not in AGGREGATIONS:
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {list(AGGREGATIONS)}")
  n = jnp.sum(m, axis=-1)
  num_seqs = jnp.sum((n > 0).astype(jnp.float32))
  seq_sum = jnp.sum(masked, axis=-1)
  if mode == "seq-mean-token-mean":
    return jnp.sum(seq_sum / jnp.maximum(n, 1.0)), num_seqs
  if mode == "seq-mean-token-sum":
    return jnp.sum(seq_sum), num_seqs
  if max_tokens is None or max_tokens <= 0:
    raise ValueError(
      f"loss aggregation {mode!r} needs a constant max_tokens > 0 (e.g. the generation budget);"
      f" got {max_tokens!r}"
    )
  return jnp.sum(seq_sum) / max_tokens, num_seqs
