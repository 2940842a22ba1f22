"""Training objectives as train-step losses: the policy loss (+ KL to a reference) and SFT."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.config import KLConfig, OffPolicyConfig, PolicyLossConfig
from jaxrl.fake_quant import fake_quant_params
from jaxrl.models.moe import load_balancing_loss, router_z_loss
from jaxrl.models.transformer import token_logprobs, token_logprobs_and_routing
from jaxrl.rl import offpolicy as offpolicy_lib
from jaxrl.rl.kl import kl_estimate
from jaxrl.rl.losses import POLICY_LOSSES, aggregate


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """The policy-gradient loss of every RL algorithm here: one of jaxrl.rl.losses.POLICY_LOSSES
  (PPO's clipped ratio for GRPO, DAPO, Dr.GRPO and PPO; GSPO's sequence ratio; CISPO's clipped
  IS weight; ...) on the batch's advantages, plus beta * KL(pi_theta || pi_ref), minus
  entropy_coef * entropy, with optional off-policy corrections (jaxrl.rl.offpolicy).

  With beta = 0 the reference log-probs are never read (and the loop never computes them).
  The metrics include the sampler-vs-learner log-prob gap: on the first (only) epoch the learner's
  params are the sampler's, so any gap is numerical mismatch, not staleness; and every step the
  off-policy diagnostics of offpolicy.diagnostics.
  """

  graphdef: object
  temperature: float = 1.0  # the sampler's: log-probs of softmax(logits / temperature)
  loss: PolicyLossConfig = PolicyLossConfig()  # config.rl.loss
  kl: KLConfig = KLConfig()  # config.rl.kl (its beta is a loss term unless kl.in_reward)
  offpolicy: OffPolicyConfig = OffPolicyConfig()  # config.rl.offpolicy
  max_tokens: int | None = None  # the constant normaliser of "seq-mean-token-sum-norm"
  fake_quant: str = "none"  # rl.rollout.quantize's mode with rl.rollout.learner_fake_quant
  fake_quant_part: str = "both"  # rl.rollout.learner_fake_quant_part
  routes: str = "none"  # rl.rollout.routes: "record" measures agreement, "replay" forces them

  @property
  def beta(self) -> float:
    """The KL coefficient of the loss: rl.kl.beta, or 0 when the KL is folded into the reward."""
    return 0.0 if self.kl.in_reward else self.kl.beta

  def _aggregate(self, per_token, mask):
    return aggregate(per_token, mask, self.loss.aggregation, max_tokens=self.max_tokens)

  def denominator(self, batch) -> jax.Array:
    return self._aggregate(jnp.zeros_like(batch.loss_mask), batch.loss_mask)[1]

  def __call__(self, params, batch):
    if self.fake_quant != "none":
      params = fake_quant_params(params, self.fake_quant, self.fake_quant_part)
    lb, z = self.loss.load_balance_coef, self.loss.router_z_coef
    recorded = batch.routes if self.routes != "none" else None
    replay = recorded if self.routes == "replay" else None
    if not (lb or z or recorded is not None):
      logp, entropy = token_logprobs(
        self.graphdef,
        params,
        batch.tokens,
        batch.valid,
        temperature=self.temperature,
        with_entropy=True,
      )
      return self.from_logprobs(logp, entropy, batch)
    (logp, entropy), routing = token_logprobs_and_routing(
      self.graphdef, params, batch.tokens, batch.valid, temperature=self.temperature,
      with_entropy=True, routes=replay,
    )  # fmt: skip
    total, metrics = self.from_logprobs(logp, entropy, batch)
    if recorded is not None:
      metrics.update(route_agreement(routing["experts"], recorded, batch.valid))
    if not (lb or z):
      return total, metrics
    aux, aux_metrics = moe_aux_loss(routing, batch.valid, lb, z)
    # The step divides the summed totals by the whole batch's denominator: weighting each
    # micro-batch's aux loss by its own share keeps it a mean, however the batch is split.
    return total + aux * self.denominator(batch), {**metrics, **aux_metrics}

  def from_logprobs(self, logp, entropy, batch, *, detached_logp=None) -> tuple[jax.Array, dict]:
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
      self.offpolicy,
      prox=batch.prox_logprobs,
      lag=batch.lag(),
      eps_low=self.loss.eps_low,
      eps_high=self.loss.eps_high,
    )
    loss_fn = POLICY_LOSSES.get(self.loss.name)
    pg, clipped = loss_fn(
      logp,
      corr.old_logp,
      batch.advantages,
      eps_low=corr.eps_low,
      eps_high=corr.eps_high,
      mask=mask,
      clip_c=self.loss.dual_clip_c,
      detached_logp=detached_logp,
    )
    # where, not a product: a masked-out token's loss may be inf (ratio overflow).
    pg = jnp.where(corr.weight > 0, corr.weight * pg, 0.0)
    per_token = pg
    n = jnp.sum(mask)
    metrics = {}
    if self.beta > 0:
      kl = kl_estimate(logp, batch.ref_logprobs, self.kl.estimator)
      per_token = per_token + self.beta * kl
      metrics["rl/kl"] = (jnp.sum(kl * mask), n)
    if self.loss.entropy_coef > 0:
      per_token = per_token - self.loss.entropy_coef * entropy
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
  load_balance_coef: float = 0.0  # config.sft's, MoE models only
  router_z_coef: float = 0.0

  def denominator(self, batch):
    return jnp.sum(batch.loss_mask)

  def __call__(self, params, batch):
    lb, z = self.load_balance_coef, self.router_z_coef
    routing = None
    if lb or z:
      logp, routing = token_logprobs_and_routing(self.graphdef, params, batch.tokens, batch.valid)
    else:
      logp = token_logprobs(self.graphdef, params, batch.tokens, batch.valid)
    mask = batch.loss_mask
    nll = -jnp.sum(logp * mask)
    n = jnp.sum(mask)
    metrics = {"sft/loss": (nll, n)}
    if routing is None:
      return nll, metrics
    aux, aux_metrics = moe_aux_loss(routing, batch.valid, lb, z)
    return nll + aux * n, {**metrics, **aux_metrics}


def route_agreement(own, recorded, valid) -> dict:
  """How far the learner's router agrees with the sampler's: per MoE layer, the mean over the
  real positions the sampler fed (recorded >= 0) of |own top k & sampler's top k| / k.

  own: [L, B, T, k] the learner's own experts (`apply_with_routing`); recorded: [B, T, L, k]
  (`TrainBatch.routes`); valid [B, T]. Metrics as (sum, count) pairs, so micro-batches and
  mini-batches pool: moe/route_agree (all layers) and moe/route_agree_l{i}. 1 where the two
  routers pick the same experts. Under routing replay it is still the router's own choice that
  is compared (the forward just does not follow it), though from layer 1 on the routers see the
  activations of the replayed forward.
  """
  rec = jnp.moveaxis(recorded.astype(jnp.int32), 2, 0)  # [L, B, T, k]
  hit = jnp.any(own[..., :, None] == rec[..., None, :], axis=-1)  # [L, B, T, k]
  overlap = jnp.mean(hit.astype(jnp.float32), axis=-1)  # [L, B, T]
  fed = (jnp.all(rec >= 0, axis=-1) & valid[None]).astype(jnp.float32)
  per_layer_sum = jnp.sum(overlap * fed, axis=(1, 2))
  per_layer_n = jnp.sum(fed, axis=(1, 2))
  metrics = {"moe/route_agree": (jnp.sum(per_layer_sum), jnp.sum(per_layer_n))}
  for i in range(own.shape[0]):
    metrics[f"moe/route_agree_l{i}"] = (per_layer_sum[i], per_layer_n[i])
  return metrics


def moe_aux_loss(routing, valid, load_balance_coef: float, router_z_coef: float):
  """(load_balance_coef * the load-balancing loss + router_z_coef * the router z-loss, metrics)
  over the real tokens of one (micro-)batch, from `apply_with_routing`'s routing; metrics are
  (value, 1) pairs, so the step reports their mean over micro-batches. A dense model has no
  routing: an error, which config validation reports first."""
  if routing is None:
    raise ValueError("MoE auxiliary losses need a model with MoE layers")
  logits, top_k = routing["router_logits"], routing["experts"].shape[-1]
  lb = load_balancing_loss(logits, top_k, valid[None])
  z = router_z_loss(logits, valid[None])
  one = jnp.ones((), jnp.float32)
  metrics = {"moe/load_balance": (lb, one), "moe/router_z": (z, one)}
  return load_balance_coef * lb + router_z_coef * z, metrics
