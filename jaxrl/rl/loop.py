"""The RL loop: SFT warm-start, then GRPO with the sampler reading the learner's own arrays.

One step: prompts (grain) -> sampler(params = the learner's param pytree) -> rewards -> group
advantages -> TrainBatch -> train_step (jitted once, state donated). The sampler is the
continuous-batching engine (jaxrl.rollout.collect.GroupSampler: paged KV, one prefill per group,
`rl.rollout.batching` its admission policy); the model, tokenizer and task come from
`jaxrl.rl.components`.
Checkpoints carry params, optimizer state, step, RNG and the data-iterator position, so a resumed
run repeats an uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import rewards
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import Config, ConfigError
from jaxrl.data.arithmetic import ArithmeticTask
from jaxrl.mesh import get_rules, make_mesh, named_sharding
from jaxrl.metrics import MetricsWriter, Progress, plot_curves
from jaxrl.models.lora import without_adapter
from jaxrl.models.transformer import token_logprobs
from jaxrl.quant import Quantizer
from jaxrl.rl import batch as batch_lib
from jaxrl.rl import components
from jaxrl.rl import offpolicy as offpolicy_lib
from jaxrl.rl.advantages import ESTIMATORS
from jaxrl.rl.allocation import fill_groups, informative_groups
from jaxrl.rl.critic import Critic
from jaxrl.rl.kl import kl_estimate
from jaxrl.rl.objectives import GRPOLoss, SFTLoss
from jaxrl.rl.shaping import overlong_penalty, truncation_keep
from jaxrl.rl.teacher import Teacher
from jaxrl.rl.train_step import init_state, make_optimizer, make_train_step
from jaxrl.rl.value import TOKEN_ESTIMATORS
from jaxrl.rollout.collect import GroupSampler, left_pad
from jaxrl.rollout.sampling import SamplingParams

# The run-seed part of the sampled evaluation's engine seed (RL rounds use (step, round)).
EVAL_SEED = 2**31 - 1


def skips_zero_advantage_rows(cfg: Config) -> bool:
  """Whether the policy update leaves out the rows whose advantages are all zero: with
  rl.skip_zero_advantage='auto', where every loss term is then zero (the policy losses are the
  advantage times a factor): no KL term in the loss, no entropy bonus, no off-policy
  correction (some read whole-batch statistics), no distillation (the teacher's term is on
  every token)."""
  rl = cfg.rl
  return (
    rl.skip_zero_advantage == "auto"
    and (rl.beta == 0 or rl.kl_in_reward)
    and rl.entropy_coef == 0
    and rl.offpolicy == "none"
    and rl.is_correction == "none"
    and not cfg.distill.enabled
  )


class Trainer:
  """Owns the mesh, model, sampler, train steps, data, checkpoints and metrics of one run."""

  def __init__(self, cfg: Config, *, log=print):
    self.cfg = cfg
    self.log = log
    self.workdir = Path(cfg.workdir)
    self.tokenizer = tok = components.build_tokenizer(cfg.model)
    self.encode_prompt = components.PromptEncoder(cfg.task, tok)
    self.mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    self.rules = get_rules(cfg.mesh.rules)
    self.model_cfg, self.graphdef, self.init_params = components.build_model(
      cfg.model, tok, self.mesh, self.rules, seed=cfg.seed
    )
    rl = cfg.rl
    if rl.max_prompt_len + rl.max_new_tokens > self.model_cfg.max_seq_len:
      raise ConfigError(
        f"config.rl.max_prompt_len + config.rl.max_new_tokens = {rl.max_prompt_len} + "
        f"{rl.max_new_tokens} exceeds the model's max_seq_len={self.model_cfg.max_seq_len}"
      )
    self.task = components.build_task(cfg.task, self.workdir, seed=cfg.seed)
    self.reward_fn = rewards.get(cfg.reward.name)
    self.held_out = self.task.held_out(cfg.eval.num_examples, seed=cfg.seed)
    self.base_key = jax.random.key(cfg.seed)
    self.batch_sharding = named_sharding(self.mesh, ("batch",), self.rules)

    self.sampling = SamplingParams(rl.temperature, rl.top_k, rl.top_p)
    self.greedy = SamplingParams(temperature=0.0)
    ro = rl.rollout
    # The one rollout path: the engine, for RL rounds and greedy evaluation alike (paged KV,
    # a group prefilled once, every EOS id a stop, prompts of one length bucket prefilled in
    # one call). By default every sample of a step (and every held-out prompt) gets a slot.
    slots = ro.slots or max(rl.prompts_per_step * rl.group_size, cfg.eval.num_examples)
    self.group_sampler = GroupSampler(
      self.model_cfg,
      self.graphdef,
      prompt_len=rl.max_prompt_len,
      max_new_tokens=rl.max_new_tokens,
      eos_ids=tok.eos_ids,
      pad_id=tok.pad_id,
      sampling=self.sampling,
      max_concurrent_decodes=slots,
      num_pages=ro.num_pages or None,
      page_size=ro.page_size,
      steps_per_call=ro.steps_per_call,
      batching=ro.batching,
      tokenizer=tok,
      mesh=self.mesh,
      rules=self.rules,
    )
    if ro.quantize != "none":
      # Quantize-on-sync: int8 copies of the projection weights per step (a quarter of their
      # float32 bytes); every other leaf is the learner's own array, as without quantization.
      self._quantize = Quantizer(ro.quantize)
    self._sampler_params = None  # (step, params the sampler reads at that step)
    self.ref_logprobs_fn = jax.jit(
      lambda p, t, v: token_logprobs(self.graphdef, p, t, v, temperature=rl.temperature)
    )
    self.sft_opt = make_optimizer(
      learning_rate=cfg.sft.learning_rate,
      warmup_steps=cfg.sft.warmup_steps,
      total_steps=cfg.sft.steps,
      weight_decay=cfg.sft.weight_decay,
      b2=cfg.sft.b2,
      grad_clip=cfg.sft.grad_clip,
      schedule="cosine",
    )
    self.rl_opt = make_optimizer(
      learning_rate=rl.learning_rate,
      warmup_steps=rl.warmup_steps,
      total_steps=rl.steps * rl.num_minibatches * rl.ppo_epochs,  # schedules count updates
      weight_decay=rl.weight_decay,
      b2=rl.b2,
      grad_clip=rl.grad_clip,
      schedule=rl.lr_schedule,
    )
    self.grpo_loss = GRPOLoss(
      self.graphdef,
      temperature=self.sampling.logprob_temperature,
      policy_loss=rl.policy_loss,
      eps_low=rl.eps_low,
      eps_high=rl.eps_high,
      beta=0.0 if rl.kl_in_reward else rl.beta,  # folded into the reward instead
      kl_estimator=rl.kl_estimator,
      aggregation=rl.loss_aggregation,
      clip_c=rl.dual_clip_c,
      max_tokens=rl.max_new_tokens,
      entropy_coef=rl.entropy_coef,
      offpolicy=rl.offpolicy,
      is_correction=rl.is_correction,
      is_cap=rl.is_cap,
      mis_low=rl.mis_low,
      mis_high=rl.mis_high,
      m2po_tau=rl.m2po_tau,
      sat_tail=rl.sat_tail,
    )
    # On-policy distillation (config.distill): the teacher's scores replace the reward signal.
    self.teacher = None
    if cfg.distill.enabled:
      self.teacher = Teacher(
        cfg.distill,
        self.model_cfg,
        self.graphdef,
        mesh=self.mesh,
        rules=self.rules,
        sampling=self.sampling,
        aggregation=rl.loss_aggregation,
        max_new_tokens=rl.max_new_tokens,
      )
    # With LoRA only the adapters train (optimizer state for them only); the base is frozen.
    self.trainable = "lora" if self.model_cfg.lora_rank else None
    self.sft_step = make_train_step(
      self.sft_opt,
      SFTLoss(self.graphdef),
      num_microbatches=cfg.sft.num_microbatches,
      trainable=self.trainable,
    )
    self.rl_step_loss = self.teacher.loss if self.teacher else self.grpo_loss
    self.skip_rows = skips_zero_advantage_rows(cfg)
    self.rl_step = make_train_step(
      self.rl_opt,
      self.rl_step_loss,
      num_microbatches=rl.num_microbatches,
      trainable=self.trainable,
    )
    # PPO (rl.advantage='gae'): a critic on the same mesh, trained on the same mini-batches.
    self.critic = None
    if rl.advantage in TOKEN_ESTIMATORS:
      self.critic = Critic(
        self.model_cfg,
        rl.critic,
        total_updates=rl.steps * rl.num_minibatches * rl.ppo_epochs,
        num_microbatches=rl.num_microbatches,
        mesh=self.mesh,
        rules=self.rules,
      )
      self.advantage_fn = None
    else:
      self.advantage_fn = ESTIMATORS.get(rl.advantage)
    self.critic_state = None
    ck = cfg.checkpoint
    self.sft_ckpt = Checkpointer(
      self.workdir / "checkpoints" / "sft", max_to_keep=ck.max_to_keep, save_every=ck.every
    )
    self.rl_ckpt = Checkpointer(
      self.workdir / "checkpoints" / "rl", max_to_keep=ck.max_to_keep, save_every=ck.every
    )
    self.metrics = MetricsWriter(self.workdir, use_tensorboard=cfg.log.tensorboard)
    self.state = None
    self.ref_params = None
    self.summary: dict = {}

  # ----------------------------------------------------------------------------------- helpers

  def _encode(self, records) -> list[list[int]]:
    seqs = []
    for r in records:
      ids = self.encode_prompt(r)
      if len(ids) > self.cfg.rl.max_prompt_len:
        raise ValueError(
          f"prompt {r['prompt']!r} has {len(ids)} tokens, more than "
          f"config.rl.max_prompt_len={self.cfg.rl.max_prompt_len}"
        )
      seqs.append(ids)
    return seqs

  def _prompts(self, records) -> tuple[np.ndarray, np.ndarray]:
    return left_pad(self._encode(records), self.cfg.rl.max_prompt_len, self.tokenizer.pad_id)

  def _seed(self, *parts: int) -> int:
    """An engine run seed (its request keys fold in request ids) derived from the run seed."""
    return int(np.random.SeedSequence([self.cfg.seed, *parts]).generate_state(1)[0] >> 1)

  def _shard_batch(self, batch):
    return jax.device_put(jax.tree.map(jnp.asarray, batch), self.batch_sharding)

  def _completions(self, tokens, lengths) -> list[str]:
    return [self.tokenizer.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]

  def _state_target(self, state):
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )

  def evaluate(self, params) -> dict:
    """Greedy held-out accuracy through the rollout engine (temperature 0)."""
    recs = self.held_out
    # Every held-out prompt at once: the driver queues what does not fit the slots.
    out, _ = self.group_sampler(
      params, self._encode(recs), group_size=1, seed=self._seed(), sampling=self.greedy
    )
    texts = self._completions(out.tokens, out.lengths)
    r, _ = rewards.compute_rewards(self.reward_fn, texts, recs, on_error=self.cfg.reward.on_error)
    ev = {
      "eval/accuracy": float(np.mean(r)),
      "eval/response_length": float(np.mean(out.lengths)),
    }
    # A task may split its accuracy by kind of problem (arithmetic: carries, careless answers).
    breakdown = getattr(self.task, "eval_breakdown", None)
    if breakdown is not None:
      ev.update({f"eval/{k}": v for k, v in breakdown(recs, texts).items()})
    k = self.cfg.eval.num_samples
    if k:
      # The same seed at every evaluation: the curve compares policies on the same draws.
      out, _ = self.group_sampler(
        params, self._encode(recs), group_size=k, seed=self._seed(EVAL_SEED), sampling=self.sampling
      )
      texts = self._completions(out.tokens, out.lengths)
      rows = [rec for rec in recs for _ in range(k)]
      r, _ = rewards.compute_rewards(self.reward_fn, texts, rows, on_error=self.cfg.reward.on_error)
      ev["eval/sampled_accuracy"] = float(np.mean(r))
    return ev

  # ------------------------------------------------------------------------------------ phases

  def run_sft(self, until: int | None = None) -> None:
    """Supervised warm-start on generated solutions; its final params seed RL (and the ref).

    Checkpointed every `checkpoint.every` steps with optimizer and data-iterator state, so an
    interrupted warm-start resumes where it stopped. `until` stops (and checkpoints) after that
    many steps without finishing the phase, as a preemption would.
    """
    cfg = self.cfg.sft
    params = self.init_params
    latest = self.sft_ckpt.latest_step() if self.cfg.resume else None
    if latest is None:
      self.summary["accuracy_init"] = self.evaluate(params)["eval/accuracy"]
    state = init_state(params, self.sft_opt, trainable=self.trainable)
    # The warm-start has its own data mix; RL prompts and the held-out set follow `task`.
    sft_task = self.task
    if isinstance(self.task, ArithmeticTask):
      sft_task = dataclasses.replace(
        self.task, operand_dist=cfg.operand_dist, careless_rate=cfg.careless_rate
      )
    it = iter(sft_task.train_dataset(seed=self.cfg.seed + 1, batch_size=cfg.batch_size))
    start = 0
    if latest is not None:
      restored, meta = self.sft_ckpt.restore(latest, {"train": self._state_target(state)})
      state, start = restored["train"], latest
      self.summary.update(meta.get("summary", {}))
      if latest >= cfg.steps:
        self.sft_params = state.params
        self.log(f"[jaxrl] SFT warm-start restored from {self.sft_ckpt.directory}/{latest}")
        return
      it.set_state(meta["data"])
      self.metrics.truncate_after("sft", start + 1)
      self.log(f"[jaxrl] resumed SFT from step {start} in {self.sft_ckpt.directory}")
    stop = cfg.steps if until is None else min(until, cfg.steps)
    progress = Progress(total=cfg.steps, desc="sft", enabled=self.cfg.log.progress, initial=start)
    for step in range(start + 1, stop + 1):
      records = next(it)
      toks, mask = self._prompts(records)
      comps = [
        self.tokenizer.encode(sft_task.sft_completion(r)) + [self.tokenizer.eos_id] for r in records
      ]
      batch = batch_lib.supervised(
        toks,
        mask,
        comps,
        max_new_tokens=self.cfg.rl.max_new_tokens,
        pad_id=self.tokenizer.pad_id,
      )
      state, m = self.sft_step(state, self._shard_batch(batch))
      if step % 10 == 0 or step == cfg.steps:
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        self.metrics.write(step, {**m, "global_step": step}, phase="sft")
        progress.update(1, loss=m["sft/loss"])
      else:
        progress.update(1)
      if step < cfg.steps:
        meta = {"data": it.get_state(), "phase": "sft", "summary": dict(self.summary)}
        self.sft_ckpt.save(step, {"train": state}, meta, force=step == stop)
    progress.close()
    if stop < cfg.steps:
      self.sft_ckpt.wait()
      return
    self.sft_params = state.params
    ev = self.evaluate(self.sft_params)
    self.summary["accuracy_after_sft"] = ev["eval/accuracy"]
    if "eval/sampled_accuracy" in ev:
      self.summary["sampled_accuracy_after_sft"] = ev["eval/sampled_accuracy"]
    self.metrics.write(cfg.steps, {**ev, "global_step": cfg.steps}, phase="sft")
    meta = {"data": it.get_state(), "phase": "sft", "summary": dict(self.summary)}
    self.sft_ckpt.save(cfg.steps, {"train": state}, meta, force=True)
    self.sft_ckpt.wait()
    self.log(
      f"[jaxrl] held-out accuracy: {self.summary['accuracy_init']:.3f} at init -> "
      f"{self.summary['accuracy_after_sft']:.3f} after {cfg.steps} SFT steps"
    )

  def rollout_params(self, step: int):
    """What the sampler reads at `step`: the learner's own param pytree, or with
    rl.rollout.quantize its quantized copy (made once per step, shared by every round)."""
    if self.cfg.rl.rollout.quantize == "none":
      return self.state.params
    if self._sampler_params is None or self._sampler_params[0] != step:
      self._sampler_params = (step, self._quantize(self.state.params))
    return self._sampler_params[1]

  def _rollout_round(self, step: int, rnd: int, records):
    """Sample group_size completions per prompt with the learner's params and score them."""
    g = self.cfg.rl.group_size
    group_records = [r for r in records for _ in range(g)]
    # The learner's own param pytree goes in (unless quantized): no copy, no sync.
    rollout, engine_stats = self.group_sampler(
      self.rollout_params(step),
      self._encode(records),
      group_size=g,
      seed=self._seed(step, rnd),
      version=step,
    )
    for k, v in engine_stats.items():  # summed over a step's rounds (dynamic sampling)
      self._engine_stats[k] = self._engine_stats.get(k, 0.0) + float(v)
    host = rollout
    texts = self._completions(host.tokens, host.lengths)
    r, n_err = rewards.compute_rewards(
      self.reward_fn, texts, group_records, on_error=self.cfg.reward.on_error
    )
    return rollout, host, r, n_err

  def rl_batch(self, step: int, records, next_records=None):
    """Roll out one GRPO batch with the learner's params and turn it into a TrainBatch.

    With rl.dynamic_sampling (DAPO) groups whose task rewards all tie are dropped and rounds of
    fresh prompts (next_records() gives the next prompt batch) are sampled until
    prompts_per_step informative groups exist, for at most max_rounds rounds in all. If the cap
    is hit the batch is filled with the earliest dropped groups at zero loss weight
    (allocation.fill_groups): shapes stay fixed and only informative groups carry loss.
    The filter reads the task reward, before overlong shaping (whose length term would make
    nearly every group look informative).
    """
    rl = self.cfg.rl
    g, ds = rl.group_size, rl.dynamic_sampling
    self._engine_stats = {}
    rollout, host, r, n_err = self._rollout_round(step, 0, records)
    row_weight = np.ones(r.shape, np.float32)
    stats = {}
    if ds.enabled:
      rounds = [(rollout, host, r)]
      informative = informative_groups(r.reshape(-1, g))
      while informative.sum() < rl.prompts_per_step and len(rounds) < ds.max_rounds:
        if next_records is None:
          raise ValueError("rl.dynamic_sampling needs next_records to draw more prompts")
        ro, h, rr, e = self._rollout_round(step, len(rounds), next_records())
        rounds.append((ro, h, rr))
        n_err += e
        informative = np.concatenate([informative, informative_groups(rr.reshape(-1, g))])
      idx, filler = fill_groups(informative, rl.prompts_per_step)
      rows = (idx[:, None] * g + np.arange(g)).reshape(-1)
      rollout = jax.tree.map(lambda *xs: jnp.concatenate(xs)[rows], *(x[0] for x in rounds))
      host = jax.tree.map(lambda *xs: np.concatenate(xs)[rows], *(x[1] for x in rounds))
      r = np.concatenate([x[2] for x in rounds])[rows]
      row_weight *= np.repeat(~filler, g).astype(np.float32)
      stats = {
        "rl/sampling_rounds": float(len(rounds)),
        "rl/dropped_groups": float(informative.size - informative.sum()),
        "rl/filler_groups": float(filler.sum()),
      }
    shaped = r
    if rl.overlong.buffer > 0:
      penalty = overlong_penalty(
        host.lengths,
        max_len=rl.max_new_tokens,
        buffer=rl.overlong.buffer,
        penalty=rl.overlong.penalty,
      )
      shaped = r + penalty
      stats["rl/overlong_penalty"] = float(penalty.mean())
    if rl.overlong.mask_truncated:
      row_weight *= truncation_keep(host.truncated)
    ref = None
    if rl.beta > 0:
      full = jnp.concatenate([rollout.prompt_tokens, rollout.tokens], axis=1)
      valid = jnp.concatenate([rollout.prompt_mask, rollout.mask], axis=1)
      ref_params = self.ref_params
      if self.trainable:
        ref_params = without_adapter(self.state.params)
      ref = self.ref_logprobs_fn(ref_params, full, valid)
    batch = batch_lib.from_rollout(rollout, np.zeros(r.shape), ref_logprobs=ref)
    if ds.enabled or rl.overlong.mask_truncated:
      batch = batch._replace(loss_mask=batch.loss_mask * jnp.asarray(row_weight)[:, None])
    kl_tok = None
    if rl.beta > 0 and rl.kl_in_reward:
      # The penalty reads the behaviour log-probs, so it is a reward: fixed for the whole update.
      kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, rl.kl_estimator)
      kl_tok = kl * batch.loss_mask
      stats["rl/kl_in_reward"] = float(jnp.sum(kl_tok) / jnp.maximum(jnp.sum(batch.loss_mask), 1))
    if self.teacher:
      # The teacher's scores replace rewards (still computed above, as a metric).
      batch, adv_stats = self.teacher.score(batch, self._shard_batch((batch.tokens, batch.valid)))
    elif self.critic is not None:
      # PPO: the task reward on each completion's last token (minus beta * KL per token with
      # rl.kl_in_reward), the critic's values of the rollout, GAE.
      sharded = self._shard_batch((batch.tokens, batch.valid))
      batch, adv_stats = self.critic.advantages(
        self.critic_state.params, batch, sharded, shaped, kl_tok, beta=rl.beta
      )
    else:
      if kl_tok is not None:
        shaped = shaped - rl.beta * np.asarray(jnp.sum(kl_tok, axis=1))
      grouped = shaped.reshape(-1, g)
      adv = np.asarray(self.advantage_fn(grouped, scale_by_std=rl.scale_by_std)).reshape(-1)
      batch = batch._replace(advantages=jnp.asarray(adv, jnp.float32)[:, None] * batch.loss_mask)
      adv_stats = {"rl/adv_mean": float(adv.mean()), "rl/adv_std": float(adv.std())}
      if g > 1:
        adv_stats["rl/zero_adv_groups"] = float(np.mean(np.all(grouped == grouped[:, :1], axis=1)))
    stats = {
      "rl/reward_mean": float(r.mean()),
      "rl/reward_std": float(r.std()),
      "rl/reward_errors": float(n_err),
      **adv_stats,
      "rl/response_length": float(host.lengths.mean()),
      "rl/truncated_frac": float(host.truncated.mean()),
      **stats,
    }
    stats.update({f"rollout/{k}": v for k, v in self._engine_stats.items()})
    return batch, stats

  def run_rl(self, until: int | None = None) -> None:
    rl = self.cfg.rl
    if self.critic is not None:
      # Before the policy state: its first step donates the buffers sft_params points to.
      self.critic_state = self.critic.init(self.model_cfg, self.sft_params)
    self.state = init_state(self.sft_params, self.rl_opt, trainable=self.trainable)
    if rl.beta > 0:
      # Frozen; the learner moves on. With LoRA the reference is the base without the adapter,
      # read from the learner's own (frozen) base arrays at each step: no second copy.
      self.ref_params = None if self.trainable else jax.tree.map(jnp.copy, self.sft_params)
    it = iter(self.task.train_dataset(seed=self.cfg.seed, batch_size=rl.prompts_per_step))
    start = 0
    latest = self.rl_ckpt.latest_step() if self.cfg.resume else None
    if latest is not None:
      target = {"train": self._state_target(self.state), "rng": jax.random.key_data(self.base_key)}
      if self.critic is not None:
        target["critic"] = self._state_target(self.critic_state)
      restored, meta = self.rl_ckpt.restore(latest, target)
      self.state = restored["train"]
      self.critic_state = restored.get("critic")
      if self.teacher:
        self.teacher.load_state_dict(meta.get("distill", {}))
      it.set_state(meta["data"])
      start = latest
      self.summary.update(meta.get("summary", {}))
      self.metrics.truncate_after("rl", start + 1)
      self.log(f"[jaxrl] resumed RL from step {start} in {self.rl_ckpt.directory}")
    if self.cfg.eval.num_samples and "sampled_accuracy_after_sft" not in self.summary:
      # A warm-start made without it (eval.num_samples was 0 then): measured here, once.
      ev = self.evaluate(self.sft_params)
      self.summary["sampled_accuracy_after_sft"] = ev["eval/sampled_accuracy"]
    stop = rl.steps if until is None else min(until, rl.steps)
    progress = Progress(total=rl.steps, desc="grpo", enabled=self.cfg.log.progress, initial=start)
    offset = self.cfg.sft.steps
    for step in range(start, stop):
      t0 = time.perf_counter()
      batch, stats = self.rl_batch(step, next(it), next_records=lambda: next(it))
      t1 = time.perf_counter()
      m = self._update(step, batch)
      done = step + 1
      m.update(stats, **{"time/rollout_s": t1 - t0, "time/train_s": time.perf_counter() - t1})
      if self.cfg.eval.every and done % self.cfg.eval.every == 0 or done == rl.steps:
        m.update(self.evaluate(self.state.params))
      if done == rl.steps:
        self.summary["accuracy_after_rl"] = m["eval/accuracy"]
        if "eval/sampled_accuracy" in m:
          self.summary["sampled_accuracy_after_rl"] = m["eval/sampled_accuracy"]
      self.metrics.write(done, {**m, "global_step": offset + done}, phase="rl")
      shown = {"reward": stats["rl/reward_mean"]}
      if "eval/accuracy" in m:
        shown["acc"] = m["eval/accuracy"]
      progress.update(1, **shown)
      self._save_rl(done, it, force=done == stop)
    progress.close()
    if stop == rl.steps and "accuracy_after_rl" not in self.summary:
      # Resumed from the final checkpoint: the loop above ran no step.
      ev = self.evaluate(self.state.params)
      self.summary["accuracy_after_rl"] = ev["eval/accuracy"]
      if "eval/sampled_accuracy" in ev:
        self.summary["sampled_accuracy_after_rl"] = ev["eval/sampled_accuracy"]

  def _update(self, step: int, batch) -> dict:
    """ppo_epochs passes over the rollout batch in num_minibatches shuffled optimizer updates.

    Every update reads the same behaviour log-probs, so later updates are off-policy by the
    earlier ones and the clip acts. Metrics are averaged over updates, except the
    sampler-vs-learner log-prob gap, taken from the first update (before the policy moved).
    With a critic it takes a step on every mini-batch too; during its warm-up (the first
    rl.critic.warmup_steps RL steps) only the critic trains.
    """
    rl = self.cfg.rl
    train_policy = self.critic is None or step >= rl.critic.warmup_steps
    window_stats = {}
    if self.teacher:
      batch, window_stats = self.teacher.window(step, self.state.params, batch, self._shard_batch)
    n = batch.size
    size = n // rl.num_minibatches
    batch, ratio_metrics = self._with_prox(step, batch)
    history = []
    for epoch in range(rl.ppo_epochs):
      if rl.num_minibatches == 1:
        order = np.arange(n)
      else:
        order = np.random.default_rng([self.cfg.seed, step, epoch]).permutation(n)
      for i in range(rl.num_minibatches):
        idx = order[i * size : (i + 1) * size]
        sub = jax.tree.map(lambda x, idx=idx: x[idx], batch)
        mb = self._shard_batch(sub)
        m = {}
        if self.critic is not None:
          self.critic_state, m = self.critic.step(self.critic_state, mb)
        if train_policy:
          policy_mb, denom = self._policy_rows(sub, mb)
          self.state, pm = self.rl_step(self.state, policy_mb, denom)
          m = {**m, **pm, "rl/trained_rows": policy_mb.size / size}
        history.append(m)
    history = jax.device_get(history)
    out = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
    if train_policy and "rl/logprob_gap" in history[0]:
      out["rl/logprob_gap"] = float(history[0]["rl/logprob_gap"])
    out.update(window_stats)
    out["rl/updates"] = float(len(history) if train_policy else 0)
    out.update({k: float(v) for k, v in jax.device_get(ratio_metrics).items()})
    return out

  def _policy_rows(self, sub, mb):
    """(the rows the policy step runs over, the denominator to divide by; None: the batch's).

    With rl.skip_zero_advantage='auto', where that is exact (`skips_zero_advantage_rows`),
    only the rows with a non-zero advantage go through the forward and backward pass, padded
    to a power of two (at least 1/8 of the rows) that splits over the batch's devices and
    micro-batches, and the step divides by the whole mini-batch's denominator: the rows left
    out contribute exactly zero, so the update is the same up to float summation order.
    """
    if not self.skip_rows:
      return mb, None
    dp = mb.size // self.batch_sharding.shard_shape((mb.size,))[0]
    multiple = math.lcm(dp, self.cfg.rl.num_microbatches)
    # At least 1/8 of the rows: at most 3 more programs (1/8, 1/4, 1/2) to compile.
    keep = batch_lib.gradient_rows(sub)
    small = batch_lib.compact_rows(sub, keep, multiple=multiple, min_rows=mb.size // 8)
    if small is None:
      return mb, None
    return self._shard_batch(small), self.rl_step_loss.denominator(mb)

  def _with_prox(self, step: int, batch):
    """Fill what the off-policy corrections read, and measure the IS ratio's max and p99.

    With any correction configured, one learner forward before any minibatch moves the policy
    gives pi_prox: stored as prox_logprobs for decoupled with prox='recompute' and for every IS
    correction (whose weight then measures only the sampler-learner gap), and used for the
    full-batch ratio_stats. Decoupled with prox='interpolate' gets the learner's version, for
    the lag. Without corrections nothing is added: no extra forward.
    """
    rl = self.cfg.rl
    decoupled = rl.offpolicy == "decoupled"
    if rl.offpolicy == "none" and rl.is_correction == "none":
      return batch, {}
    toks, valid = self._shard_batch((batch.tokens, batch.valid))
    prox = self.ref_logprobs_fn(self.state.params, toks, valid)
    prox = jnp.where(batch.loss_mask > 0, prox, 0.0)
    stats = offpolicy_lib.ratio_stats(prox, batch.old_logprobs, batch.loss_mask)
    if (decoupled and rl.prox == "recompute") or rl.is_correction != "none":
      return batch._replace(prox_logprobs=prox), stats
    if decoupled:
      batch = batch._replace(learner_version=jnp.full((batch.size,), step, jnp.int32))
    return batch, stats

  def _save_rl(self, step: int, it, *, force: bool) -> None:
    state = {"train": self.state, "rng": jax.random.key_data(self.base_key)}
    if self.critic is not None:
      state["critic"] = self.critic_state
    meta = {"data": it.get_state(), "phase": "rl", "summary": dict(self.summary)}
    if self.teacher:
      meta["distill"] = self.teacher.state_dict()
    self.rl_ckpt.save(step, state, meta, force=force)

  def restore_params(self, phase: str = "latest") -> tuple[str, int, object]:
    """(phase, step, params) of the newest checkpoint of `phase`: 'rl', 'sft' or 'latest' (RL
    if the run has any, else SFT), restored into this run's shardings (for export, eval)."""
    ckpts = {"rl": self.rl_ckpt, "sft": self.sft_ckpt}
    if phase not in (*ckpts, "latest"):
      raise ValueError(f"phase={phase!r} is invalid; allowed: 'rl', 'sft', 'latest'")
    steps = {name: ck.latest_step() for name, ck in ckpts.items()}
    if phase == "latest":
      phase = "rl" if steps["rl"] is not None else "sft"
    if steps[phase] is None:
      found = ", ".join(f"{name} (step {s})" for name, s in steps.items() if s is not None)
      raise FileNotFoundError(
        f"no {phase} checkpoint in {self.workdir / 'checkpoints'}; "
        f"checkpointed phases: {found or 'none'}"
      )
    # The optimizer state is part of the saved item, so the target needs it even to read params.
    opt = self.rl_opt if phase == "rl" else self.sft_opt
    state = init_state(self.init_params, opt, trainable=self.trainable)
    target = {"train": self._state_target(state)}
    if phase == "rl":
      target["rng"] = jax.random.key_data(self.base_key)
      if self.critic is not None:
        critic = self.critic.init(self.model_cfg, self.init_params)
        target["critic"] = self._state_target(critic)
    restored, _ = ckpts[phase].restore(steps[phase], target)
    return phase, steps[phase], restored["train"].params

  # --------------------------------------------------------------------------------------- run

  def run(self, until: int | None = None) -> dict:
    """Run (or resume) SFT then RL; `until` stops RL after that many steps (preemption, tests)."""
    t0 = time.perf_counter()
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.run_sft()
    self.run_rl(until)
    self.rl_ckpt.wait()
    self.metrics.flush()
    if "accuracy_after_rl" in self.summary:
      self.summary["wall_s"] = time.perf_counter() - t0
      (self.workdir / "summary.json").write_text(json.dumps(self.summary, indent=2))
      png = plot_curves(
        self.workdir / "metrics.jsonl",
        self.workdir / "curves.png",
        panels=[
          ("SFT warm-start loss", ["sft/loss"]),
          ("GRPO reward (sampled, T = rl.temperature)", ["rl/reward_mean"]),
          ("held-out accuracy (greedy)", ["eval/accuracy"]),
        ],
      )
      s = self.summary
      self.log(
        f"[jaxrl] held-out accuracy: init {s.get('accuracy_init', float('nan')):.3f} | "
        f"after SFT {s['accuracy_after_sft']:.3f} | after RL {s['accuracy_after_rl']:.3f}"
      )
      self.log(f"[jaxrl] metrics: {self.workdir / 'metrics.jsonl'}  plot: {png}")
    return dict(self.summary)

  def close(self) -> None:
    self.sft_ckpt.close()
    self.rl_ckpt.close()
    self.metrics.close()
