"""Training objectives as train-step losses: GRPO (policy loss + KL to a reference) and SFT."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl.models.transformer import token_logprobs
from jaxrl.rl.kl import kl_estimate
from jaxrl.rl.losses import POLICY_LOSSES, aggregate


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
  """Clipped policy loss on group-relative advantages plus beta * KL(pi_theta || pi_ref).

  With beta = 0 the reference log-probs are never read (and the loop never computes them).
  The metrics include the sampler-vs-learner log-prob gap: on the first (only) epoch the learner's
  params are the sampler's, so any gap is numerical mismatch, not staleness.
  """

  graphdef: object
  temperature: float = 1.0
  policy_loss: str = "ppo_clip"
  eps_low: float = 0.2
  eps_high: float = 0.2
  beta: float = 0.0
  kl_estimator: str = "k3"
  aggregation: str = "token-mean"
  clip_c: float = 3.0  # dual-clip bound for negative advantages
  max_tokens: int | None = None  # the constant normaliser of "seq-mean-token-sum-norm"

  def _aggregate(self, per_token, mask):
    return aggregate(per_token, mask, self.aggregation, max_tokens=self.max_tokens)

  def denominator(self, batch):
    return self._aggregate(jnp.zeros_like(batch.loss_mask), batch.loss_mask)[1]

  def __call__(self, params, batch):
    logp, entropy = token_logprobs(
      self.graphdef,
      params,
      batch.tokens,
      batch.valid,
      temperature=self.temperature,
      with_entropy=True,
    )
    mask = batch.loss_mask
    loss_fn = POLICY_LOSSES.get(self.policy_loss)
    pg, clipped = loss_fn(
      logp,
      batch.old_logprobs,
      batch.advantages,
      eps_low=self.eps_low,
      eps_high=self.eps_high,
      mask=mask,
      clip_c=self.clip_c,
    )
    per_token = pg
    n = jnp.sum(mask)
    metrics = {}
    if self.beta > 0:
      kl = kl_estimate(logp, batch.ref_logprobs, self.kl_estimator)
      per_token = per_token + self.beta * kl
      metrics["rl/kl"] = (jnp.sum(kl * mask), n)
    total, denom = self._aggregate(per_token, mask)
    gap = jnp.abs(logp - batch.old_logprobs) * mask
    metrics.update(
      {
        "rl/loss": (total, denom),
        "rl/pg_loss": (jnp.sum(pg * mask), n),
        "rl/entropy": (jnp.sum(entropy * mask), n),
        "rl/clip_frac": (jnp.sum(clipped * mask), n),
        "rl/logprob_gap": (jnp.sum(gap), n),
      }
    )
    return total, metrics


@dataclasses.dataclass(frozen=True)
class SFTLoss:
  """Token-mean negative log-likelihood of the completion tokens (the warm-start objective)."""

  graphdef: object

  def denominator(self, batch):
    return jnp.sum(batch.loss_mask)

  def __call__(self, params, batch):
    logp = token_logprobs(self.graphdef, params, batch.tokens, batch.valid)
    mask = batch.loss_mask
    nll = -jnp.sum(logp * mask)
    n = jnp.sum(mask)
    return nll, {"sft/loss": (nll, n)}
