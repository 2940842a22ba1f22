"""PPO's critic: a value model on the policy's mesh, its clipped value loss and its train step.

The value model is the policy's architecture with a scalar head on the final hidden states, its
trunk initialised from the warm-started policy (as verl and OpenRLHF initialise the critic from
the actor/SFT model) and its head at zero, so every first value is 0. It is a separate model:
its own params and Adam state, trained on the same mini-batches as the policy. Column j of its
output is V(s_j), the value of the prefix tokens[:, :j] before token j is emitted, aligned like
the policy's log-probs (jaxrl.rl.batch).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import CriticConfig
from jaxrl.mesh import shard_params
from jaxrl.models.config import ModelConfig
from jaxrl.models.lora import merge_lora
from jaxrl.models.transformer import Transformer, positions_from_mask
from jaxrl.rl.advantages import whiten
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.train_step import TrainState, init_state, make_optimizer, make_train_step
from jaxrl.rl.value import gae, value_loss


class ValueModel(nnx.Module):
  """The decoder trunk plus a linear value head on its final-normed hidden states."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.trunk = Transformer(cfg, rngs=rngs)
    self.value_head = nnx.Param(jnp.zeros((cfg.embed_dim,), jnp.float32), axes=("embed",))
    self.value_bias = nnx.Param(jnp.zeros((), jnp.float32), axes=())

  def __call__(self, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """tokens, valid: [B, T] -> values [B, T] float32; column 0 (nothing before it) is 0."""
    h, _ = self.trunk(tokens, positions_from_mask(valid), valid, return_hidden=True)  # [B, T, D]
    v = jnp.einsum("BTD,D->BT", h.astype(jnp.float32), self.value_head[...]) + self.value_bias[...]
    # The hidden state at j - 1 has read tokens[:, :j]: it values the state before token j.
    return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))


def value_config(policy_cfg: ModelConfig) -> ModelConfig:
  """The critic's ModelConfig: the policy's, without LoRA (the critic trains all its weights)
  and with tied embeddings, so no unused vocab-sized output head is allocated."""
  return dataclasses.replace(policy_cfg, lora_rank=0, tie_embeddings=True)


@dataclasses.dataclass(frozen=True)
class ValueLoss:
  """Token-mean clipped value loss (jaxrl.rl.value.value_loss) against the batch's GAE returns,
  with the rollout-time values as the clipping anchor. clip = 0 is the plain squared error."""

  graphdef: object
  clip: float = 0.2

  def denominator(self, batch) -> jax.Array:
    return jnp.sum(batch.loss_mask)

  def __call__(self, params, batch):
    values = nnx.merge(self.graphdef, params)(batch.tokens, batch.valid)
    mask = batch.loss_mask
    per_token, clipped = value_loss(
      values, batch.values, batch.returns, mask, clip=self.clip if self.clip > 0 else None
    )
    n = jnp.sum(mask)
    total = jnp.sum(per_token)
    return total, {
      "critic/loss": (total, n),
      "critic/clip_frac": (jnp.sum(clipped.astype(jnp.float32)), n),
      "critic/value_mean": (jnp.sum(values * mask), n),
      "critic/abs_error": (jnp.sum(jnp.abs(values - batch.returns) * mask), n),
    }


class Critic:
  """The value model's graphdef, optimizer, jitted value forward and train step.

  `init(policy_cfg, policy_params)` copies the (LoRA-merged) policy weights into a fresh critic
  state on the same mesh; `values(params, tokens, valid)` scores a batch; `step(state, batch)`
  is the usual pure train step (state donated, compiled once).
  """

  def __init__(
    self,
    policy_cfg: ModelConfig,
    cfg: CriticConfig,
    *,
    total_updates: int,
    mesh,
    rules,
    num_microbatches: int = 1,
    estimator=gae,
  ):
    self.model_cfg = value_config(policy_cfg)
    self.mesh, self.rules = mesh, rules
    self.graphdef, self._abstract = nnx.split(
      nnx.eval_shape(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(0)))
    )
    self.optimizer = make_optimizer(
      learning_rate=cfg.learning_rate,
      warmup_steps=0,
      total_steps=total_updates,
      grad_clip=cfg.grad_clip,
      schedule="constant",
    )
    # Micro-batched like the policy's step (rl.num_microbatches): same activation memory.
    self.step = make_train_step(
      self.optimizer,
      ValueLoss(self.graphdef, clip=cfg.value_clip),
      num_microbatches=num_microbatches,
    )
    self.cfg = cfg
    self.estimator = estimator  # a needs_critic advantage kind of jaxrl.registry.ADVANTAGES
    graphdef = self.graphdef
    self.values = jax.jit(lambda p, t, v: nnx.merge(graphdef, p)(t, v))
    self._advantages = jax.jit(self._advantages_fn)

  def init_params(self, policy_cfg: ModelConfig, policy_params: nnx.State) -> nnx.State:
    """Critic params: trunk = a copy of the policy's weights (LoRA merged), value head at 0."""
    _, merged = merge_lora(policy_cfg, policy_params)
    trunk = nnx.State({k: v for k, v in merged.items() if k != "head"})
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._abstract)
    # Fresh buffers: the policy's arrays are donated by its train step and must not be aliased.
    params["trunk"] = jax.tree.map(jnp.copy, trunk)
    return shard_params(params, self.mesh, self.rules)

  def init(self, policy_cfg: ModelConfig, policy_params: nnx.State) -> TrainState:
    return init_state(self.init_params(policy_cfg, policy_params), self.optimizer)

  def advantages(self, params, batch, token_rewards) -> tuple[TrainBatch, dict[str, jax.Array]]:
    """PPO advantages for a TrainBatch on the mesh: the per-token rewards [B, T] (the task reward
    on each completion's last loss token, minus beta * KL per token where it is folded in), the
    critic's values V(s_t) of the rollout, GAE(gamma, lambda), optionally whitened. Returns
    (batch with advantages, values and returns, stats as device scalars). One jitted program:
    on a mesh, op-by-op dispatch would run a cross-device collective per reduction."""
    return self._advantages(params, batch, token_rewards)

  def _advantages_fn(self, params, batch, token_rewards):
    c = self.cfg
    mask = batch.loss_mask
    graphdef = self.graphdef
    values = nnx.merge(graphdef, params)(batch.tokens, batch.valid) * mask
    adv, returns = self.estimator(token_rewards, values, mask, gamma=c.gamma, lam=c.lam)
    if c.whiten:
      adv = whiten(adv, mask)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    mean = lambda x: jnp.sum(x * mask) / n  # noqa: E731
    var = lambda x: mean(jnp.square(x - mean(x)))  # noqa: E731
    stats = {
      "rl/adv_mean": mean(adv),
      "rl/adv_std": jnp.sqrt(var(adv)),
      "critic/values_rollout": mean(values),
      "critic/returns": mean(returns),
      # How much of the return the critic explains before its update: 1 - Var(R - V) / Var(R)
      # (0 when the returns do not vary: nothing to explain).
      "critic/explained_var": jnp.where(
        var(returns) > 0, 1.0 - var(returns - values) / jnp.maximum(var(returns), 1e-12), 0.0
      ),
    }
    return batch._replace(advantages=adv, values=values, returns=returns), stats
