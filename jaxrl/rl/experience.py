"""The rollout stage of an RL step: sample -> score -> filter -> shape -> batch.

`Experience.collect(step, params, records)` samples G completions of each prompt with the
learner's own params (through the continuous-batching engine), scores them with the task
reward, drops uninformative groups (DAPO's dynamic sampling), shapes the rewards (overlong
penalty and masking, the KL penalty folded into the reward) and builds the `TrainBatch` once:
the host arrays go to the mesh in one `device_put`, and the reference log-probs, the critic's
values and the advantages are computed there. Its metrics cover every sampling round of the
step; those computed on the device stay there until the loop fetches a step's metrics at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.precision import ComputeCast
from jaxrl.models.transformer import token_logprobs
from jaxrl.quant import Quantizer
from jaxrl.rl.advantages import ESTIMATORS, group_advantages
from jaxrl.rl.allocation import fill_groups, informative_groups, pilot_commit, vigor_round
from jaxrl.rl.batch import TrainBatch, rollout_columns
from jaxrl.rl.components import env_factory
from jaxrl.rl.kl import kl_estimate, kl_in_reward
from jaxrl.rl.partial import PartialRollouts
from jaxrl.rl.prompt_stats import PromptFilter, PromptStats
from jaxrl.rl.replay import ReplayBuffer
from jaxrl.rl.run import Run
from jaxrl.rl.shaping import overlong_penalty, truncation_keep
from jaxrl.rl.value import terminal_rewards
from jaxrl.rollout.collect import GroupSampler
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import Rollout, rollout_from_json, rollout_to_json


def build_sampler(run: Run, mesh=None) -> GroupSampler:
  """The one rollout path, for RL rounds and evaluation alike: the engine (paged KV, a group
  prefilled once, every EOS id a stop) on `mesh` (default: the run's; with a split placement
  the rounds' sampler is on the sampler's sub-mesh). By default every sample of a step (with
  rl.partial: every sample in flight) and every held-out prompt gets a slot."""
  cfg, rl = run.cfg, run.cfg.rl
  ro = rl.rollout
  groups = rl.prompts_per_step
  if rl.partial.enabled:
    groups = math.ceil(rl.partial.over_provision * rl.prompts_per_step)
  return GroupSampler(
    run.model_cfg,
    run.graphdef,
    prompt_len=rl.max_prompt_len,
    max_new_tokens=rl.max_new_tokens,
    eos_ids=run.tokenizer.eos_ids,
    pad_id=run.tokenizer.pad_id,
    sampling=SamplingParams(rl.sampling.temperature, rl.sampling.top_k, rl.sampling.top_p),
    max_concurrent_decodes=ro.slots or max(groups * rl.group_size, cfg.eval.num_examples),
    # rl.rollout.kv_fraction: the pages the memory estimate sized from the device's budget.
    num_pages=(run.memory.kv_pages if ro.kv_fraction else ro.num_pages) or None,
    page_size=ro.page_size,
    steps_per_call=ro.steps_per_call,
    batching=ro.batching,
    tokenizer=run.tokenizer,
    mesh=run.mesh if mesh is None else mesh,
    rules=run.rules,
    resumable=rl.partial.enabled,
    capture_routes=ro.routes != "none",
    kv_dtype=ro.kv_dtype,
    prefill_batch_prompts=ro.prefill_batch_prompts or None,
    env_factory=env_factory(cfg),
    max_turns=ro.max_turns,
    turn_tokens=ro.turn_tokens or None,
    env_workers=cfg.reward.sandbox.workers if ro.env == "python" else 0,
  )


def concat_rows(parts: list, rows: np.ndarray) -> Rollout:
  """Rows `rows` of the row-wise concatenation of same-structured host pytrees."""
  return jax.tree.map(lambda *xs: np.concatenate(xs)[rows], *parts)


class StepRollouts(NamedTuple):
  """One step's rollouts on the host, ready for the learner's half (`Experience.batch`): the
  selected rows, their task rewards and row weights (0: a dynamic-sampling filler group), and
  the host-side stats of the rounds that made them (rewards errors, engine counters, filters)."""

  rollout: Rollout  # numpy arrays, prompt-major
  rewards: np.ndarray  # [B] float32 task rewards
  row_weight: np.ndarray  # [B] float32
  stats: dict[str, float]
  group_sizes: np.ndarray | None = None  # [num_groups] with rl.allocation; None: all group_size

  def to_json(self) -> dict:
    """JSON-ready Python values (a checkpoint's meta), given back bit for bit by `from_json`."""
    return {
      "rollout": rollout_to_json(self.rollout),
      "rewards": self.rewards.tolist(),
      "row_weight": self.row_weight.tolist(),
      "stats": dict(self.stats),
      "group_sizes": None if self.group_sizes is None else self.group_sizes.tolist(),
    }

  @classmethod
  def from_json(cls, d: dict) -> StepRollouts:
    try:
      return cls(
        rollout_from_json(d["rollout"]),
        np.asarray(d["rewards"], np.float32),
        np.asarray(d["row_weight"], np.float32),
        {k: float(v) for k, v in d["stats"].items()},
        None if d.get("group_sizes") is None else np.asarray(d["group_sizes"], np.int64),
      )
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"checkpoint's queued rollouts are malformed: {e!r}") from e


def select_groups(
  rewards: list[np.ndarray], group_size: int, num_prompts: int
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
  """Dynamic sampling's filter over the rounds' task rewards: (rows into the concatenated rounds,
  row weights [rows], stats). The first `num_prompts` informative groups (rewards not all tied)
  are kept; if there are fewer, the earliest dropped groups fill the batch at zero weight."""
  informative = np.concatenate([informative_groups(r.reshape(-1, group_size)) for r in rewards])
  idx, filler = fill_groups(informative, num_prompts)
  rows = (idx[:, None] * group_size + np.arange(group_size)).reshape(-1)
  weight = np.repeat(~filler, group_size).astype(np.float32)
  stats = {
    "rl/sampling_rounds": float(len(rewards)),
    "rl/dropped_groups": float(informative.size - informative.sum()),
    "rl/filler_groups": float(filler.sum()),
  }
  return rows, weight, stats


def shape_rewards(rewards: np.ndarray, rollout: Rollout, rl) -> tuple[np.ndarray, np.ndarray, dict]:
  """(shaped rewards [B], row weights [B], stats): DAPO's overlong penalty on the reward, and
  with rl.overlong.mask_truncated zero weight for completions cut by the length budget."""
  shaped, weight, stats = rewards, np.ones(rewards.shape, np.float32), {}
  if rl.overlong.buffer > 0:
    penalty = overlong_penalty(
      rollout.lengths,
      max_len=rl.max_new_tokens,
      buffer=rl.overlong.buffer,
      penalty=rl.overlong.penalty,
    )
    shaped = rewards + penalty
    stats["rl/overlong_penalty"] = float(penalty.mean())
  if rl.overlong.mask_truncated:
    weight = weight * truncation_keep(rollout.truncated)
  return shaped, weight, stats


class Experience:
  """The rollout stage: the sampler reading the learner's params, the scorer, the filters and
  shaping, and where the advantages come from (the group estimator, the critic, or the
  distillation teacher's scores)."""

  def __init__(
    self, run: Run, sampler: GroupSampler, *, critic=None, teacher=None, cast=None
  ):  # fmt: skip
    self.run, self.sampler = run, sampler
    self.critic, self.teacher = critic, teacher
    # Master weights stored above the compute dtype: the sampler reads a copy cast once per
    # policy version (the same forward, half the bytes); else the learner's own arrays.
    self.cast = ComputeCast(run.model_cfg) if cast is None else cast
    rl = run.cfg.rl
    self.advantage_fn = None if critic is not None else ESTIMATORS.get(rl.advantage)
    # Quantize-on-sync: int8 copies of the projection weights, made once per step and shared by
    # every round; every other leaf is the learner's own array, as without quantization.
    self.quantize = Quantizer(rl.rollout.quantize) if rl.rollout.quantize != "none" else None
    # rl.partial: the groups in flight across steps (checkpointed with the step).
    self.partial = PartialRollouts(sampler, run.encode, rl=rl) if rl.partial.enabled else None
    # rl.replay: recent informative groups mixed into later batches (checkpointed too).
    self.replay = None
    if rl.replay.ratio > 0:
      self.replay = ReplayBuffer(
        rl.replay, group_size=rl.group_size, num_prompts=rl.prompts_per_step
      )
    # rl.prompt_filter: per-prompt statistics and the pre-rollout filter (checkpointed too).
    self.prompt_filter = None
    pf = rl.prompt_filter
    if pf.method != "none":
      stats = PromptStats(decay=pf.decay, history=pf.history)
      self.prompt_filter = PromptFilter(
        pf, stats, seed=run.cfg.seed, num_prompts=rl.prompts_per_step
      )
    graphdef, temperature = run.graphdef, sampler.sampling.logprob_temperature
    self.logprobs_fn = jax.jit(
      lambda p, t, v: token_logprobs(graphdef, p, t, v, temperature=temperature)
    )

  def stateful(self) -> dict:
    """The parts whose state lives across steps, by config section (rl.partial: the groups in
    flight; rl.prompt_filter: the per-prompt statistics; rl.replay: the stored groups): each
    goes into the RL checkpoint."""
    parts = {"partial": self.partial, "prompt_filter": self.prompt_filter, "replay": self.replay}
    return {name: part for name, part in parts.items() if part is not None}

  def sampler_params(self, params) -> nnx.State:
    """What the sampler reads for the learner's `params`: the very same pytree (no copy, no
    sync), or with rl.rollout.quantize its quantized copy, and with master weights stored
    above the compute dtype (model.param_dtype) the rest of the matrices cast to it (made once
    per policy version, by the caller: `collect` or the rollout pipeline's publish)."""
    view = params if self.quantize is None else self.quantize(params)
    return self.cast.view(view)

  def sample(
    self, step: int, rnd: int, params, records, *, version: int | None = None, kinds=None
  ) -> tuple[Rollout, np.ndarray, int, dict]:
    """One round: G completions of each record's prompt with the sampler's `params`
    (`sampler_params`), scored; every token is stamped with
    `version` (default: `step`, the learner's own). Returns (host Rollout, task rewards [B],
    reward-function errors, engine counters)."""
    run, g = self.run, self.run.cfg.rl.group_size
    rows = [rec for rec in records for _ in range(g)]
    scored: dict[int, float] = {}
    errors = [0]

    def score(done) -> None:  # completions as they finish; a request id is its row
      ids = [c.request_id for c in done]
      texts = run.completions([c.tokens for c in done], [len(c.tokens) for c in done])
      r, n_err = run.score(texts, [rows[i] for i in ids], sample_ids=ids, kinds=kinds)
      scored.update(zip(ids, r.tolist(), strict=True))
      errors[0] += n_err

    overlap = run.cfg.rl.rollout.overlap_rewards
    rollout, engine = self.sampler(
      params,
      run.encode(records),
      group_size=g,
      seed=run.seed(step, rnd),
      version=step if version is None else version,
      on_finished=score if overlap else None,
    )
    if overlap:
      return rollout, np.array([scored[i] for i in range(len(rows))], np.float32), errors[0], engine
    texts = run.completions(rollout.tokens, rollout.lengths)
    r, n_err = run.score(texts, rows, kinds=kinds)
    return rollout, r, n_err, engine

  def sample_partial(
    self, step: int, params, records, next_records, *, version: int, kinds=None
  ) -> tuple:
    """rl.partial's round: the groups in flight advanced by policy `version` until
    prompts_per_step are complete (jaxrl.rl.partial), scored. Returns (Rollout, rewards,
    reward errors, engine counters, partial-rollout stats)."""
    if next_records is None:
      raise ValueError("rl.partial needs next_records to draw prompts for the groups in flight")
    run, g = self.run, self.run.cfg.rl.group_size
    rollout, recs, engine, stats = self.partial.collect(
      params, records, next_records, version=version, seed=run.seed(step, 0)
    )
    texts = run.completions(rollout.tokens, rollout.lengths)
    r, n_err = run.score(texts, [rec for rec in recs for _ in range(g)], kinds=kinds)
    return rollout, r, n_err, engine, stats

  def sample_allocated(self, step: int, params, records, *, version: int, kinds=None) -> tuple:
    """rl.allocation's rounds: `initial` samples of every prompt, then the rest of the budget
    (prompts_per_step * group_size samples) by the allocator, from the rewards so far
    (jaxrl.rl.allocation). Sample j of prompt i is the same draw whichever round asks for it.
    Returns (Rollout, prompt-major, groups of variable size; rewards; reward errors; engine
    counters summed over the rounds; stats; group sizes [P])."""
    run, rl = self.run, self.run.cfg.rl
    al = rl.allocation
    p = len(records)
    budget, cap = p * rl.group_size, al.max_group or 2 * rl.group_size
    prompts = run.encode(records)
    counts = np.zeros(p, np.int64)
    rewards = [np.zeros(0, np.float32) for _ in range(p)]
    done, engine, n_err, passes = {}, {}, 0, 0
    extra = np.full(p, al.initial, np.int64)
    rounds = al.rounds if al.method == "vigor" else 1
    pilot_varying = None
    keep = {}  # each prompt's prefill, kept for the step's later rounds
    for rnd in range(rounds + 1):
      if extra.sum():
        samples = [range(counts[i], counts[i] + extra[i]) for i in range(p)]
        got, st = self.sampler.sample_indices(
          params, prompts, samples, stride=cap, seed=run.seed(step, 0), version=version, keep=keep
        )
        order = [(i, j) for i in range(p) for j in samples[i]]
        new = [got[k] for k in order]
        texts = run.completions([c.tokens for c in new], [len(c.tokens) for c in new])
        r, e = run.score(texts, [records[i] for i, _ in order], kinds=kinds)
        n_err, passes = n_err + e, passes + 1
        for i, part in enumerate(np.split(r, np.cumsum(extra)[:-1])):  # order is prompt-major
          rewards[i] = np.concatenate([rewards[i], part])
        counts += extra
        done.update(got)
        for k, v in st.items():
          engine[k] = engine.get(k, 0.0) + float(v)
      if pilot_varying is None:
        pilot_varying = sum(np.ptp(x) > 0 for x in rewards)
      left = budget - int(counts.sum())
      if left == 0:
        break
      if al.method == "vigor":
        extra = vigor_round(
          rewards,
          counts,
          budget=-(-left // (rounds - rnd)),
          increment=al.increment,
          cap=cap,
          last=rnd + 1 == rounds,
        )
      else:
        extra = pilot_commit(rewards, counts, budget=left, cap=cap)
    if counts.sum() != budget:  # cannot happen: the last round spends what is left
      raise RuntimeError(f"allocation spent {counts.sum()} samples of a budget of {budget}")
    rollout = self.sampler.pack([done[i, j] for i in range(p) for j in range(counts[i])])
    stats = {
      "alloc/rounds": float(passes),
      "alloc/group_size_min": float(counts.min()),
      "alloc/group_size_max": float(counts.max()),
      "alloc/pilot_varying_groups": float(pilot_varying),
      "alloc/varying_groups": float(sum(np.ptp(x) > 0 for x in rewards)),
    }
    return rollout, np.concatenate(rewards), n_err, engine, stats, counts

  def collect(
    self,
    step: int,
    params,
    records,
    next_records: Callable | None = None,
    *,
    ref_params=None,
    critic_params=None,
  ) -> tuple[TrainBatch, dict]:
    """Roll out one step's batch with `params` and turn it into a TrainBatch on the mesh:
    `rollouts` then `batch`. Returns (batch, metrics): floats for what was computed on the
    host, device scalars else."""
    rolled = self.rollouts(step, self.sampler_params(params), records, next_records)
    return self.batch(step, rolled, ref_params=ref_params, critic_params=critic_params)

  def rollouts(
    self, step: int, params, records, next_records: Callable | None = None, *, version=None
  ) -> StepRollouts:
    """The host half of a step: batch `step`'s completions sampled with `params` (what the
    sampler reads, `sampler_params`: policy `version`, default `step`), scored and filtered;
    nothing on the learner's side is read, so it may run on another sub-mesh and thread.

    With rl.dynamic_sampling (DAPO) groups whose task rewards all tie are dropped and rounds of
    fresh prompts (next_records() gives the next prompt batch) are sampled until
    prompts_per_step informative groups exist, for at most max_rounds rounds in all; short of
    that the batch is filled with the earliest dropped groups at zero loss weight
    (allocation.fill_groups), so shapes stay fixed. The filter reads the task reward, before
    overlong shaping (whose length term would make nearly every group look informative).
    """
    rl = self.run.cfg.rl
    g, ds = rl.group_size, rl.dynamic_sampling
    version = step if version is None else version
    selected, num_replay = {}, 0
    if self.replay is not None:
      records, num_replay = self.replay.fresh_records(step, records or [], next_records)
    elif records is None:  # the caller leaves the draw to us
      records = next_records()
    if self.prompt_filter is not None:
      records, selected = self.prompt_filter.select(step, records, next_records)
    round_records = [records]
    group_sizes = None
    kinds: dict[str, int] = {}  # this step's reward errors by kind
    if self.partial is not None:
      rounds = [
        self.sample_partial(step, params, records, next_records, version=version, kinds=kinds)
      ]
    elif rl.allocation.method != "none":
      *first, group_sizes = self.sample_allocated(
        step, params, records, version=version, kinds=kinds
      )
      rounds = [tuple(first)]
    else:
      rounds = [self.sample(step, 0, params, records, version=version, kinds=kinds)]
    row_weight = np.ones(rounds[0][1].shape, np.float32)
    stats = dict(rounds[0][4]) if len(rounds[0]) > 4 else {}
    rounds = [x[:4] for x in rounds]
    if ds.enabled:
      while True:
        rows, row_weight, stats = select_groups([x[1] for x in rounds], g, rl.prompts_per_step)
        if row_weight.sum() == rows.size or len(rounds) >= ds.max_rounds:
          break
        if next_records is None:
          raise ValueError("rl.dynamic_sampling needs next_records to draw more prompts")
        round_records.append(next_records())
        rounds.append(
          self.sample(step, len(rounds), params, round_records[-1], version=version, kinds=kinds)
        )
      rollout = concat_rows([x[0] for x in rounds], rows)
      r = np.concatenate([x[1] for x in rounds])[rows]
    else:
      rollout, r = rounds[0][0], rounds[0][1]
    if self.replay is not None:
      stats["replay/fresh_groups"] = float(len(records))
      stats["replay/fresh_reward_mean"] = float(np.mean(r))
      stats["replay/replayed_groups"] = float(num_replay)
      if num_replay:
        old, old_r, replay_stats = self.replay.take(step, num_replay)
        stats.update(replay_stats)
      self.replay.add(step, rollout, r)  # after taking: this step's groups wait for later
      if num_replay:
        rollout = jax.tree.map(lambda a, b: np.concatenate([a, b]), rollout, old)
        r = np.concatenate([r, old_r])
        row_weight = np.ones(rollout.lengths.shape, np.float32)
      stats["replay/buffer_groups"] = float(len(self.replay.groups))
    if self.prompt_filter is not None:
      # Every group sampled this step informs its prompt's statistics, the dropped ones too.
      sampled = np.concatenate([x[1] for x in rounds])
      if group_sizes is None:
        sampled = sampled.reshape(-1, g)
      else:  # rl.allocation: prompt-major groups of group_sizes
        sampled = np.split(sampled, np.cumsum(group_sizes)[:-1])
      self.prompt_filter.stats.update(step, [x for rr in round_records for x in rr], sampled)
      self.prompt_filter.after_step(sampled)
    stats.update(selected)
    engine = {}
    for _, _, _, e in rounds:  # counters summed over the step's rounds
      for k, v in e.items():
        engine[k] = engine.get(k, 0.0) + float(v)
    stats["rl/reward_errors"] = float(sum(x[2] for x in rounds))
    for kind in ("timeout", "invalid", "exception"):  # what they were (reward.on_error='zero')
      stats[f"rl/reward_errors_{kind}"] = float(kinds.get(kind, 0))
    # Programs the engine compiled this step depend on what the process saw before (a resumed
    # run compiles again), like the timings: logged with them, out of the reproducible metrics.
    stats["time/rollout_compiles"] = engine.pop("compiles", 0.0)
    stats.update({f"rollout/{k}": v for k, v in engine.items()})
    rollout = jax.tree.map(np.asarray, rollout)
    return StepRollouts(rollout, np.asarray(r), row_weight, stats, group_sizes)

  def batch(
    self, step: int, rolled: StepRollouts, *, ref_params=None, critic_params=None
  ) -> tuple[TrainBatch, dict]:
    """The learner's half of a step: shaping, one transfer to the mesh, then the reference
    log-probs, the KL and the advantages there. `ref_params` (for rl.kl.beta > 0) and
    `critic_params` (for a critic) are read on the device."""
    rl = self.run.cfg.rl
    rollout, r = rolled.rollout, rolled.rewards
    shaped, weight, shape_stats = shape_rewards(r, rollout, rl)
    host = rollout_columns(rollout, rolled.row_weight * weight)
    batch, adv_stats = self.advantages(
      step, host, shaped, ref_params, critic_params, group_sizes=rolled.group_sizes
    )
    stats = {
      "rl/reward_mean": float(r.mean()),
      "rl/reward_std": float(r.std()),
      **adv_stats,
      "rl/response_length": float(rollout.lengths.mean()),
      "rl/truncated_frac": float(rollout.truncated.mean()),
      **rolled.stats,
      **shape_stats,
    }
    return batch, stats

  def advantages(
    self, step: int, host: dict, shaped: np.ndarray, ref_params, critic_params, *, group_sizes=None
  ) -> tuple[TrainBatch, dict]:
    """(TrainBatch on the mesh, stats): one transfer of the host columns, then the reference
    log-probs, the KL folded into the reward, and the advantages of the configured source.
    `group_sizes` [num_groups] gives prompt-major groups of variable size (rl.allocation):
    a group estimator then sees them padded to the largest, with a mask."""
    rl, run = self.run.cfg.rl, self.run
    dev = run.shard(host)
    batch = TrainBatch(
      dev["tokens"],
      dev["valid"],
      dev["loss_mask"],
      jnp.zeros_like(dev["loss_mask"]),
      dev["old_logprobs"],
      jnp.zeros_like(dev["old_logprobs"]),
      dev["versions"],
      routes=dev.get("routes"),
    )
    stats = {}
    if rl.kl.beta > 0:
      ref = self.logprobs_fn(ref_params, batch.tokens, batch.valid) * dev["mask"]
      batch = batch._replace(ref_logprobs=ref)
    token_rewards = None
    if rl.kl.beta > 0 and rl.kl.in_reward:
      # The penalty reads the behaviour log-probs, so it is a reward: fixed for the whole update.
      token_rewards, stats["rl/kl_in_reward"] = _kl_in_reward(
        shaped, batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, rl.kl.beta, rl.kl.estimator
      )
    if self.teacher is not None:
      # The teacher's scores replace rewards (still computed, as a metric).
      out, teacher_stats = self.teacher.score(batch, (batch.tokens, batch.valid))
      return out, {**stats, **teacher_stats}
    if self.critic is not None:
      # PPO: the task reward on each completion's last token (minus beta * KL per token with
      # rl.kl.in_reward), the critic's values of the rollout, GAE.
      if token_rewards is None:
        token_rewards = _terminal_rewards(shaped, batch.loss_mask)
      out, critic_stats = self.critic.advantages(critic_params, batch, token_rewards)
      return out, {**stats, **critic_stats}
    # A group estimator: the sequence rewards (with the KL folded in, their per-token sums) on
    # one device, where op-by-op dispatch runs no cross-device collective.
    seq = shaped if token_rewards is None else jax.device_get(jnp.sum(token_rewards, axis=1))
    seq = np.asarray(seq, np.float32)
    if group_sizes is None:
      group_sizes = np.full(seq.size // rl.group_size, rl.group_size)
    adv, tied = group_advantages(self.advantage_fn, seq, group_sizes, scale_by_std=rl.scale_by_std)
    batch = batch._replace(advantages=adv[:, None] * batch.loss_mask)
    stats.update({"rl/adv_mean": jnp.mean(adv), "rl/adv_std": jnp.std(adv)})
    if rl.group_size > 1:
      stats["rl/zero_adv_groups"] = float(np.mean(tied))
    return batch, stats


@jax.jit
def _terminal_rewards(shaped, mask):
  return terminal_rewards(jnp.asarray(shaped, jnp.float32), mask)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _kl_in_reward(shaped, old_logprobs, ref_logprobs, mask, beta: float, estimator: str):
  """(per-token rewards: the task reward on the last loss token minus beta * KL per token, the
  mean KL over loss tokens) in one program (kl.kl_in_reward)."""
  kl = kl_estimate(old_logprobs, ref_logprobs, estimator) * mask
  rewards = kl_in_reward(
    _terminal_rewards(shaped, mask), old_logprobs, ref_logprobs, beta, estimator, mask
  )
  return rewards, jnp.sum(kl) / jnp.maximum(jnp.sum(mask), 1)
