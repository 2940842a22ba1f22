"""The learner of an RL step: `update(state, batch, step) -> (state, metrics)`.

It owns the policy optimizer and loss (or the distillation loss), the critic (PPO) and the
update's structure: ppo_epochs passes over the rollout batch in num_minibatches shuffled
optimizer updates, the one learner forward for pi_prox when an off-policy correction reads it,
and the zero-advantage rows left out of the forward and backward pass where that is exact.
Every array operation of `update` runs in a jitted function on device inputs: nothing moves
between host and device implicitly (tests run it under `jax.transfer_guard("disallow")`), and
its metrics stay on the device for the loop to fetch once per step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config
from jaxrl.fake_quant import fake_quant_params
from jaxrl.guard import NonFiniteGuard
from jaxrl.models.transformer import token_logprobs
from jaxrl.quant import UnderflowCounter, quantize_params
from jaxrl.registry import ADVANTAGES
from jaxrl.rl import batch as batch_lib
from jaxrl.rl import offpolicy as offpolicy_lib
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.critic import Critic
from jaxrl.rl.objectives import PolicyLoss
from jaxrl.rl.run import Run
from jaxrl.rl.train_step import TrainState, init_state, make_optimizer, make_train_step


class LearnerState(NamedTuple):
  policy: TrainState
  critic: TrainState | None = None


def skips_zero_advantage_rows(cfg: Config) -> bool:
  """Whether the policy update leaves out the rows whose advantages are all zero: with
  rl.skip_zero_advantage='auto', where every loss term is then zero (the policy losses are the
  advantage times a factor): no KL term in the loss, no entropy bonus, no MoE auxiliary loss
  (the router sees every token), no off-policy
  correction (some read whole-batch statistics), no distillation (the teacher's term is on
  every token)."""
  rl = cfg.rl
  return (
    rl.skip_zero_advantage == "auto"
    and (rl.kl.beta == 0 or rl.kl.in_reward)
    and rl.loss.entropy_coef == 0
    and rl.loss.load_balance_coef == 0
    and rl.loss.router_z_coef == 0
    and rl.offpolicy.method == "none"
    and rl.offpolicy.is_correction == "none"
    and not cfg.distill.enabled
  )


def policy_loss(run: Run, temperature: float) -> PolicyLoss:
  """The clipped policy-gradient loss of config.rl (PPO / DAPO / GSPO / CISPO and the rest)."""
  rl = run.cfg.rl
  return PolicyLoss(
    run.graphdef,
    temperature=temperature,
    loss=rl.loss,
    kl=rl.kl,
    offpolicy=rl.offpolicy,
    max_tokens=rl.max_new_tokens,
    fake_quant=rl.rollout.quantize if rl.rollout.learner_fake_quant else "none",
    fake_quant_part=rl.rollout.learner_fake_quant_part,
    routes=rl.rollout.routes,
  )


@jax.jit
def _mean(values):
  return jnp.mean(jnp.stack(values))


class Learner:
  """Optimizer, loss, train steps and critic of the RL phase, built once from the run."""

  def __init__(self, run: Run, *, temperature: float, teacher=None):
    cfg, rl = run.cfg, run.cfg.rl
    self.run, self.teacher = run, teacher
    self.updates_per_step = rl.num_minibatches * rl.ppo_epochs
    self.optimizer = make_optimizer(
      learning_rate=rl.optim.learning_rate,
      warmup_steps=rl.optim.warmup_steps,
      total_steps=rl.steps * self.updates_per_step,  # schedules count updates
      weight_decay=rl.optim.weight_decay,
      b2=rl.optim.b2,
      grad_clip=rl.optim.grad_clip,
      schedule=rl.optim.schedule,
    )
    # On-policy distillation (config.distill): the teacher's loss replaces the policy loss.
    self.loss = teacher.loss if teacher is not None else policy_loss(run, temperature)
    # With LoRA only the adapters train (optimizer state for them only); the base is frozen.
    self.trainable = "lora" if run.model_cfg.lora_rank else None
    self.step_fn = make_train_step(
      self.optimizer, self.loss, num_microbatches=rl.num_microbatches, trainable=self.trainable
    )
    self.skip_rows = skips_zero_advantage_rows(cfg)
    # Every update (policy and critic) skipped for a NaN or inf counts; the loop checks it.
    self.guard = NonFiniteGuard(
      cfg.guard.max_nonfinite_updates,
      "RL",
      hint="Check the rewards and the advantages (rl/adv_*), or lower rl.optim.learning_rate.",
    )
    self._denominator = jax.jit(self.loss.denominator)
    # PPO (rl.advantage='gae'): a critic on the same mesh, trained on the same mini-batches.
    self.critic = None
    if ADVANTAGES.traits(rl.advantage).get("needs_critic"):
      self.critic = Critic(
        run.model_cfg,
        rl.critic,
        total_updates=rl.steps * self.updates_per_step,
        num_microbatches=rl.num_microbatches,
        mesh=run.mesh,
        rules=run.rules,
        estimator=ADVANTAGES.get(rl.advantage),
      )
    graphdef = run.graphdef
    # pi_prox: with rl.rollout.learner_fake_quant, through the same quantized path as the loss.
    fake = rl.rollout.quantize if rl.rollout.learner_fake_quant else None
    part = rl.rollout.learner_fake_quant_part
    # ... and with rl.rollout.routes='replay', on the sampler's experts.
    self._replay = rl.rollout.routes == "replay"
    self._logprobs = jax.jit(
      lambda p, t, v, m, r: jnp.where(
        m > 0,
        token_logprobs(
          graphdef, p if fake is None else fake_quant_params(p, fake, part), t, v,
          temperature=temperature, routes=r,
        ),
        0.0,
      )
    )  # fmt: skip
    self._ratio_stats = jax.jit(offpolicy_lib.ratio_stats)
    # Quantized rollouts: the sampler's quantized forward over the batch, counting the
    # activations it rounds to zero (mismatch/act_underflow*), once per step.
    self._underflow = None
    if rl.rollout.quantize != "none":
      self._underflow = UnderflowCounter()
      mode, counter = rl.rollout.quantize, self._underflow

      def quantized_forward(p, t, v):
        with counter.tracing(mask=v):  # at trace time: the callbacks go into the program
          logp = token_logprobs(graphdef, quantize_params(p, mode), t, v, temperature=temperature)
        return jnp.sum(logp)

      self._quantized_forward = jax.jit(quantized_forward)

  def init(self, params) -> LearnerState:
    """The RL state from the warm-started params. The critic comes first: the policy's first
    step donates the buffers `params` points to."""
    critic = None if self.critic is None else self.critic.init(self.run.model_cfg, params)
    return LearnerState(init_state(params, self.optimizer, trainable=self.trainable), critic)

  def update(self, state: LearnerState, batch: TrainBatch, step: int) -> tuple[LearnerState, dict]:
    """ppo_epochs passes over the batch in num_minibatches shuffled optimizer updates.

    Every update reads the same behaviour log-probs, so later updates are off-policy by the
    earlier ones and the clip acts. Metrics (device scalars) are averaged over updates, except
    the sampler-vs-learner log-prob gap, taken from the first update (before the policy moved).
    With a critic it takes a step on every mini-batch too; during its warm-up (the first
    rl.critic.warmup_steps RL steps) only the critic trains.
    """
    rl, run = self.run.cfg.rl, self.run
    policy, critic = state
    train_policy = self.critic is None or step >= rl.critic.warmup_steps
    window_stats = {}
    if self.teacher is not None:
      batch, window_stats = self.teacher.window(step, policy.params, batch, run.shard)
    n = batch.size
    size = n // rl.num_minibatches
    batch, ratio_stats = self._with_prox(step, policy.params, batch)
    history = []
    for epoch in range(rl.ppo_epochs):
      if rl.num_minibatches > 1:
        order = np.random.default_rng([run.cfg.seed, step, epoch]).permutation(n)
      for i in range(rl.num_minibatches):
        if rl.num_minibatches == 1:
          mb = run.shard(batch)  # in order, no gather; a no-op where already placed so
        else:
          rows = batch_lib.put_like(order[i * size : (i + 1) * size], batch.tokens)
          mb = run.shard(batch_lib.take_rows(batch, rows))
        m = {}
        if self.critic is not None:
          critic, m = self.critic.step(critic, mb)
          self.guard.update(m["opt/nonfinite"])
        if train_policy:
          policy_mb, denom = self._policy_rows(mb)
          policy, pm = self.step_fn(policy, policy_mb, denom)
          self.guard.update(pm["opt/nonfinite"])
          m = {**m, **pm, "rl/trained_rows": policy_mb.size / size}
        history.append(m)
    out = {}
    for k in history[0]:
      values = [h[k] for h in history]
      if isinstance(values[0], float):
        out[k] = float(np.mean(values))
      else:
        out[k] = values[0] if len(values) == 1 else _mean(values)
    if train_policy and "rl/logprob_gap" in history[0]:
      out["rl/logprob_gap"] = history[0]["rl/logprob_gap"]
    out.update(window_stats)
    out["rl/updates"] = float(len(history) if train_policy else 0)
    out.update(ratio_stats)
    return LearnerState(policy, critic), out

  def _policy_rows(self, mb: TrainBatch) -> tuple[TrainBatch, Any]:
    """(the rows the policy step runs over, the denominator to divide by; None: the batch's).

    With rl.skip_zero_advantage='auto', where that is exact (`skips_zero_advantage_rows`),
    only the rows with a non-zero advantage go through the forward and backward pass, padded
    to a power of two (at least 1/8 of the rows) that splits over the batch's devices and
    micro-batches, and the step divides by the whole mini-batch's denominator: the rows left
    out contribute exactly zero, so the update is the same up to float summation order.
    """
    if not self.skip_rows:
      return mb, None
    dp = mb.size // self.run.batch_sharding.shard_shape((mb.size,))[0]
    multiple = math.lcm(dp, self.run.cfg.rl.num_microbatches)
    # At least 1/8 of the rows: at most 3 more programs (1/8, 1/4, 1/2) to compile.
    keep = batch_lib.gradient_rows(mb)  # decides the shapes: one explicit [B] bool fetch
    small = batch_lib.compact_rows(mb, keep, multiple=multiple, min_rows=mb.size // 8)
    if small is None:
      return mb, None
    return self.run.shard(small), self._denominator(mb)

  def _with_prox(self, step: int, params, batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """Fill what the off-policy corrections read, and measure the IS ratio's max and p99.

    With any correction configured, or quantized rollouts (whose mismatch is monitored every
    step), one learner forward before any minibatch moves the policy gives pi_prox: stored as
    prox_logprobs for decoupled with prox='recompute' and for every IS correction (whose weight
    then measures only the sampler-learner gap), and used for the full-batch ratio_stats.
    Decoupled with prox='interpolate' gets the learner's version, for the lag. Otherwise nothing
    is added: no extra forward.
    """
    rl = self.run.cfg.rl
    decoupled = rl.offpolicy.method == "decoupled"
    corrected = rl.offpolicy.method != "none" or rl.offpolicy.is_correction != "none"
    if not corrected and rl.rollout.quantize == "none":
      return batch, {}
    routes = batch.routes if self._replay else None
    prox = self._logprobs(params, batch.tokens, batch.valid, batch.loss_mask, routes)
    stats = self._ratio_stats(prox, batch.old_logprobs, batch.loss_mask)
    if self._underflow is not None:
      self._quantized_forward(params, batch.tokens, batch.valid)
      zeroed, nonzero = self._underflow.read()
      stats["mismatch/act_underflow"] = float(zeroed)
      stats["mismatch/act_underflow_frac"] = zeroed / max(nonzero, 1)
    if (decoupled and rl.offpolicy.prox == "recompute") or rl.offpolicy.is_correction != "none":
      return batch._replace(prox_logprobs=prox), stats
    if not corrected:
      return batch, stats
    if decoupled:
      version = batch_lib.put_like(np.full((batch.size,), step, np.int32), batch.tokens)
      batch = batch._replace(learner_version=version)
    return batch, stats
