"""Training objectives as train-step losses: GRPO (policy loss + KL to a reference) and SFT."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.models.transformer import token_logprobs
from jaxrl.rl import offpolicy as offpolicy_lib
from jaxrl.rl.kl import kl_estimate
from jaxrl.rl.losses import POLICY_LOSSES, aggregate


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
  """Clipped policy loss on group-relative advantages plus beta * KL(pi_theta || pi_ref), minus
  entropy_coef * entropy, with optional off-policy corrections (jaxrl.rl.offpolicy).

  With beta = 0 the reference log-probs are never read (and the loop never computes them).
  The metrics include the sampler-vs-learner log-prob gap: on the first (only) epoch the learner's
  params are the sampler's, so any gap is numerical mismatch, not staleness; and every step the
  off-policy diagnostics of offpolicy.diagnostics.
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
  entropy_coef: float = 0.0  # bonus on the tempered predictive entropy of completion tokens
  offpolicy: str = "none"  # a name in offpolicy.OFFPOLICY
  is_correction: str = "none"  # a name in offpolicy.IS_CORRECTIONS
  is_cap: float = 2.0  # TIS truncation C
  mis_low: float = 0.5  # MIS band [mis_low, mis_high]
  mis_high: float = 2.0
  m2po_tau: float = 0.04  # M2PO second-moment threshold
  sat_tail: float = 2.0  # SAT tail threshold in batch RMS units

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
    return self.from_logprobs(logp, entropy, batch)

  def from_logprobs(self, logp, entropy, batch, *, detached_logp=None):
    """The loss from the learner's log-probs and entropies [B, T]. detached_logp (default
    sg(logp)) is what the stop-gradient parts (IS weights, masks, SAT bounds) read: passing the
    log-probs of fixed params lets a finite-difference test freeze them, as autodiff does."""
    mask = batch.loss_mask
    if detached_logp is None:
      detached_logp = jax.lax.stop_gradient(logp)
    # Corrections read detached_logp; the ratio's gradient comes from logp below.
    corr = offpolicy_lib.correct(
      detached_logp,
      batch.old_logprobs,
      mask,
      batch.advantages,
      offpolicy=self.offpolicy,
      is_correction=self.is_correction,
      prox=batch.prox_logprobs,
      lag=batch.lag(),
      eps_low=self.eps_low,
      eps_high=self.eps_high,
      is_cap=self.is_cap,
      mis_low=self.mis_low,
      mis_high=self.mis_high,
      m2po_tau=self.m2po_tau,
      sat_tail=self.sat_tail,
    )
    loss_fn = POLICY_LOSSES.get(self.policy_loss)
    pg, clipped = loss_fn(
      logp,
      corr.old_logp,
      batch.advantages,
      eps_low=corr.eps_low,
      eps_high=corr.eps_high,
      mask=mask,
      clip_c=self.clip_c,
      detached_logp=detached_logp,
    )
    # where, not a product: a masked-out token's loss may be inf (ratio overflow).
    pg = jnp.where(corr.weight > 0, corr.weight * pg, 0.0)
    per_token = pg
    n = jnp.sum(mask)
    metrics = {}
    if self.beta > 0:
      kl = kl_estimate(logp, batch.ref_logprobs, self.kl_estimator)
      per_token = per_token + self.beta * kl
      metrics["rl/kl"] = (jnp.sum(kl * mask), n)
    if self.entropy_coef > 0:
      per_token = per_token - self.entropy_coef * entropy
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
    metrics.update(offpolicy_lib.diagnostics(detached_logp, batch.old_logprobs, mask, corr))
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
