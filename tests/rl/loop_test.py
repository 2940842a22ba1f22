"""RL loop tests: the sampler reads the learner's arrays, compile once, exact resume."""

import dataclasses
import functools
import json
import re

import jax
import numpy as np
import pytest
from fixtures import smoke_config
from flax import nnx
from helpers import rl_metric_lines

from jaxrl.config import RewardConfig
from jaxrl.data.arithmetic import careless
from jaxrl.quant import BlockQArray, QArray, quantize_weight
from jaxrl.rl.loop import Trainer
from jaxrl.rollout.sampling import SamplingParams


def _config(workdir, devices=1, **rl):
  """The loop tests' run; `devices=0`: on all 8 test devices (sharded state, split placement)."""
  return smoke_config(
    workdir,
    mesh={"devices": devices},
    sft={"steps": 10},
    rl={"steps": 4, **rl},
    eval={"every": 2, "num_examples": 16},
    checkpoint={"every": 2},
  )


def _pointers(tree):
  """Device-buffer addresses of every shard of every leaf (the Trainer uses all 8 test devices)."""
  return [
    s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards
  ]


# (the engine's batching, the KL coefficient): the default job (continuous batching, beta = 0, so
# rl.skip_zero_advantage='auto' trains only the rows with an advantage) and a run with a KL term
# to the reference (which turns the skipping off: every update takes the whole batch).
RUNS = {"default": ("continuous", 0.0), "static-kl": ("static", 0.05)}


@pytest.fixture(scope="module", params=list(RUNS))
def run_with_spy(request, tmp_path_factory):
  batching, beta = RUNS[request.param]
  cfg = _config(tmp_path_factory.mktemp("spy"), devices=0, kl={"beta": beta})
  cfg = dataclasses.replace(
    cfg,
    rl=dataclasses.replace(cfg.rl, rollout=dataclasses.replace(cfg.rl.rollout, batching=batching)),
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  seen = []
  # Every policy update: the rows it took and the learner's compiled programs after it.
  step_fn = trainer.learner.step_fn

  def spy_step(state, mb, denom):
    out = step_fn(state, mb, denom)
    trainer.updates.append((mb.size, step_fn._cache_size()))
    return out

  trainer.learner.step_fn, trainer.learner_step_fn, trainer.updates = spy_step, step_fn, []
  # Every decode step of the engine reads the params it is handed: spy on them there, and on
  # the engine's compiled programs as the run goes.
  engine = trainer.sampler.engine
  generate = engine.generate_steps

  def spy(params, *args):
    if trainer.state is not None:  # the RL phase (SFT keeps its state to itself)
      learner = trainer.state.policy.params
      seen.append((params is learner, _pointers(params), _pointers(learner)))
      programs = (engine._prefill_jit, engine._insert_jit)
      trainer.compiles.append((*(p._cache_size() for p in programs), engine.generate_compiles))
    return generate(params, *args)

  engine.generate_steps = spy
  trainer.compiles = []
  trainer.run()
  yield trainer, seen
  trainer.close()


@pytest.mark.e2e
def test_sampler_receives_the_learners_own_arrays(run_with_spy):
  trainer, seen = run_with_spy
  assert len(seen) >= trainer.cfg.rl.steps
  for same_object, sampler_ptrs, learner_ptrs in seen:
    assert same_object
    assert sampler_ptrs == learner_ptrs  # same device buffers: zero bytes copied


@pytest.mark.e2e
def test_steps_compile_once_per_row_bucket(run_with_spy):
  trainer, _ = run_with_spy
  rows = trainer.cfg.rl.prompts_per_step * trainer.cfg.rl.group_size
  sizes = [size for size, _ in trainer.updates]
  assert len(sizes) == trainer.cfg.rl.steps
  if trainer.cfg.rl.kl.beta > 0:  # no skipping: one program, the whole batch's
    assert trainer.learner.skip_rows is False and set(sizes) == {rows}
  else:
    # The default: each update takes the rows with an advantage, padded to a bucket (all of
    # them, 1/2, 1/4 or 1/8): one program per bucket, compiled when it is first met, never again.
    assert trainer.learner.skip_rows
    assert set(sizes) <= {rows, rows // 2, rows // 4, rows // 8}, sizes
  assert [compiles for _, compiles in trainer.updates] == [
    len(set(sizes[: i + 1])) for i in range(len(sizes))
  ], trainer.updates
  assert trainer.learner_step_fn._cache_size() == len(set(sizes)) <= 4
  assert trainer.sft.step_fn._cache_size() == 1
  assert trainer.sampler.engine.generate_compiles == 1
  # The engine's programs on the 8-device mesh, seen at every decode call of the RL phase: one
  # prefill and one insert per bucket (the RL rounds', the greedy and the sampled evaluation's,
  # all met before RL's first decode call), one decode step; none added by any later step.
  compiles = trainer.compiles
  assert len(compiles) > trainer.cfg.rl.steps
  assert compiles == [compiles[0]] * len(compiles), compiles
  prefill, insert, generate = compiles[0]
  assert prefill <= 3 and insert <= 3 and generate == 1, compiles


@pytest.mark.e2e
def test_run_writes_metrics_checkpoints_and_plot(run_with_spy):
  trainer, _ = run_with_spy
  wd = trainer.workdir
  lines = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3, 4]
  assert all(("rl/kl" in r) == (trainer.cfg.rl.kl.beta > 0) for r in rl)  # logged with a KL term
  for key in (
    "rl/loss",
    *(["rl/kl"] if trainer.cfg.rl.kl.beta > 0 else []),
    "rl/entropy",
    "rl/clip_frac",
    "rl/adv_mean",
    "rl/adv_std",
    "rl/reward_mean",
    "rl/response_length",
    "rl/logprob_gap",
    "opt/grad_norm",
    "opt/param_norm",
    "opt/update_norm",
  ):
    assert all(np.isfinite(r[key]) for r in rl), key
  # The learner's params equal the sampler's at rollout time: the gap is numerical only.
  assert max(r["rl/logprob_gap"] for r in rl) < 1e-5
  assert "eval/accuracy" in rl[1] and "eval/accuracy" in rl[3]
  # The arithmetic task's breakdown is logged beside it and adds up to it.
  carry = [
    careless(r["a"], r["op"], r["b"]) not in (None, r["answer"]) for r in trainer.ctx.held_out
  ]
  for r in (rl[1], rl[3]):
    assert 0 <= r["eval/careless_answers"] <= 1
    whole = (
      np.mean(carry) * r["eval/carry_accuracy"] + (1 - np.mean(carry)) * r["eval/no_carry_accuracy"]
    )
    assert whole == pytest.approx(r["eval/accuracy"], abs=1e-9)
  assert (wd / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  summary = json.loads((wd / "summary.json").read_text())
  assert summary["accuracy_after_rl"] == rl[-1]["eval/accuracy"]
  # eval.num_samples = 2 (the default config's): the sampled accuracy beside the greedy one.
  assert trainer.cfg.eval.num_samples == 2
  assert summary["sampled_accuracy_after_rl"] == rl[-1]["eval/sampled_accuracy"]
  assert 0 <= summary["sampled_accuracy_after_sft"] <= 1
  # ... and pass@1 (= the sampled accuracy of a pass/fail reward) <= pass@2.
  assert rl[-1]["eval/pass@1"] == pytest.approx(rl[-1]["eval/sampled_accuracy"])
  assert rl[-1]["eval/pass@1"] <= rl[-1]["eval/pass@2"] <= 1
  assert trainer.rl_ckpt.latest_step() == 4
  assert trainer.sft.ckpt.latest_step() == 10


@pytest.mark.e2e
def test_profile_traces_the_chosen_rl_steps(tmp_path):
  cfg = _config(tmp_path, steps=3)
  cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, profile_steps=1, profile_from=1))
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  trainer.close()
  traces = list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0


@pytest.mark.e2e
def test_sampled_accuracy_at_a_vanishing_temperature_is_the_greedy_one(run_with_spy):
  """eval/sampled_accuracy scores eval.num_samples draws per held-out prompt at the RL
  temperature: as the temperature goes to 0 every draw is the argmax, so it equals the greedy
  accuracy; at the run's temperature 1 the draws differ."""
  trainer, _ = run_with_spy
  params = trainer.state.policy.params
  sampling, reward_fn = trainer.sampler.sampling, trainer.ctx.reward_fn
  # A graded score of the text itself (the tiny model's exact-match accuracy may well be 0).
  trainer.ctx.reward_fn = lambda completion, record: sum(map(ord, completion)) % 97 / 97
  try:
    at_one = trainer.evaluate(params)
    trainer.sampler.sampling = SamplingParams(temperature=1e-6)
    cold = trainer.evaluate(params)
  finally:
    trainer.sampler.sampling, trainer.ctx.reward_fn = sampling, reward_fn
  assert cold["eval/accuracy"] == at_one["eval/accuracy"]
  assert cold["eval/sampled_accuracy"] == pytest.approx(cold["eval/accuracy"], rel=1e-6)
  assert at_one["eval/sampled_accuracy"] != pytest.approx(at_one["eval/accuracy"], rel=1e-3)


# rl.partial: groups in flight carried across the checkpoint (short decode calls, so sequences
# are cut mid-way), then resumed from it.
PARTIAL = {
  "partial": {"enabled": True, "over_provision": 2.0, "max_age": 2},
  "rollout": {"steps_per_call": 2},
}


# rl.prompt_filter: the per-prompt statistics go into the checkpoint and come back; a pool of
# 12 prompts (8 a step) brings them back across it, where the restored statistics skip some.
GRESO = {"prompt_filter": {"method": "greso", "greso_p_explore": 0.3}, "prompt_pool": 12}


# rl.placement: batches sampled ahead with old versions go into the checkpoint and come back
# (colocated with an injected lag of 2; split sub-meshes one step off, the sampler in a thread).
STALE = {"placement": {"max_staleness": 2}}
SPLIT = {"placement": {"kind": "split", "max_staleness": 1}}
# Both: the sampler thread one version behind, carrying unfinished sequences over.
SPLIT_PARTIAL = {**PARTIAL, **SPLIT}


@pytest.mark.e2e
@pytest.mark.parametrize(
  "rl",
  [{}, PARTIAL, GRESO, STALE, SPLIT, SPLIT_PARTIAL],
  ids=["sync", "partial", "greso", "stale", "split", "split_partial"],
)
def test_resume_repeats_an_uninterrupted_run(tmp_path, rl):
  # Sharded over all 8 test devices where the sharding is part of what is restored (the plain
  # run) or placement needs them (split sub-meshes); the other variants on one device.
  config = functools.partial(_config, devices=0 if rl in ({}, SPLIT, SPLIT_PARTIAL) else 1, **rl)
  full = Trainer(config(tmp_path / "full"), log=lambda *_: None)
  full.run()
  full_params = jax.device_get(full.state.policy.params)
  full.close()

  part = Trainer(config(tmp_path / "part"), log=lambda *_: None)
  part.run(until=2)
  assert part.rl_ckpt.latest_step() == 2
  part.close()
  resumed = Trainer(config(tmp_path / "part"), log=lambda *_: None)
  resumed.run()
  resumed_params = jax.device_get(resumed.state.policy.params)
  resumed.close()

  assert rl_metric_lines(tmp_path / "part") == rl_metric_lines(tmp_path / "full")
  for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(resumed_params), strict=True):
    np.testing.assert_array_equal(a, b)
  if rl is GRESO:  # the filter ran at every step, from the restored statistics after step 2
    lines = rl_metric_lines(tmp_path / "part")
    assert all(line["prompts/drawn"] >= 8 for line in lines)
    assert lines[0]["prompts/skipped"] == 0 and any(x["prompts/skipped"] > 0 for x in lines[2:])
  if rl in (STALE, SPLIT):  # batches 2 (and 3) were sampled before the checkpoint, by 0 and 1
    k = rl["placement"]["max_staleness"]
    assert [line["async/staleness_max"] for line in rl_metric_lines(tmp_path / "part")] == [
      min(s, k) for s in range(4)
    ]
  if rl in (PARTIAL, SPLIT_PARTIAL):  # the checkpoint at 2 held sequences in flight, resumed
    lines = rl_metric_lines(tmp_path / "full")
    assert lines[1]["partial/carried_sequences"] > 0
    assert lines[2]["partial/resumed_sequences"] > 0


def test_mesh_devices_takes_the_first_devices_and_the_split_shares_them(tmp_path):
  def devices(tree):
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}

  trainer = Trainer(_config(tmp_path / "two", devices=2), log=lambda *_: None)
  try:
    assert trainer.ctx.mesh.devices.size == 2
    assert devices(trainer.ctx.init_params) == set(jax.devices()[:2])
  finally:
    trainer.close()
  split = {"kind": "split", "sampler_fraction": 0.5}
  trainer = Trainer(_config(tmp_path / "split", devices=4, placement=split), log=lambda *_: None)
  try:  # the learner takes 2 of the first 4 devices, the sampler the other 2
    assert devices(trainer.ctx.init_params) == set(jax.devices()[:2])
    assert set(trainer.ctx.sampler_mesh.devices.flat) == set(jax.devices()[2:4])
  finally:
    trainer.close()


@pytest.mark.e2e
def test_interrupted_warm_start_resumes_to_the_same_params(tmp_path):
  full = Trainer(_config(tmp_path / "full"), log=lambda *_: None)
  full.run_sft()
  expect = [np.array(x) for x in jax.tree.leaves(full.sft_params)]
  full.close()
  part = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  part.run_sft(until=7)  # checkpoint.every=2: the forced save at 7 is what resumes
  assert part.sft.ckpt.latest_step() == 7
  part.close()
  resumed = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  resumed.run_sft()
  got = [np.array(x) for x in jax.tree.leaves(resumed.sft_params)]
  resumed.close()
  for a, b in zip(expect, got, strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.e2e
def test_warm_start_demonstrations_follow_sft_careless_rate(tmp_path, monkeypatch):
  """sft.careless_rate = 1: every warm-start demonstration of a carry problem is the careless
  teacher's answer, every other one the true answer; the held-out set keeps the true answers."""
  from jaxrl.rl import batch as batch_lib

  cfg = _config(tmp_path)
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, careless_rate=1.0, steps=3))
  trainer = Trainer(cfg, log=lambda *_: None)
  seen = []
  supervised = batch_lib.supervised

  def spy(prompts, mask, completions, **kw):
    seen.append((prompts, mask, completions))
    return supervised(prompts, mask, completions, **kw)

  monkeypatch.setattr(batch_lib, "supervised", spy)
  trainer.run_sft()
  trainer.close()
  tok, eos = trainer.ctx.tokenizer, trainer.ctx.tokenizer.eos_id
  carries = 0
  for prompts, mask, completions in seen:
    for row, valid, comp in zip(prompts, mask, completions, strict=True):
      a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", tok.decode(row[valid][1:])).groups()
      a, b = int(a), int(b)
      assert comp[-1] == eos
      truth = str(a + b if op == "+" else a - b)
      slip = careless(a, op, b)
      carries += slip != truth
      assert tok.decode(comp[:-1]) == slip, (a, op, b)
  assert len(seen) == 3 and carries > 0
  assert all(r["answer"] == str(eval(r["prompt"][:-1])) for r in trainer.ctx.held_out)


@pytest.mark.e2e
def test_reward_failure_is_reported_or_raised(tmp_path):
  from jaxrl import rewards

  calls = {"n": 0}

  @rewards.register("flaky_for_test")
  def flaky(completion, record):
    calls["n"] += 1
    if calls["n"] % 3 == 0:
      raise RuntimeError("verifier crashed")
    return 1.0

  cfg = _config(tmp_path / "raise")
  cfg = dataclasses.replace(cfg, reward=RewardConfig("flaky_for_test", "raise"))
  trainer = Trainer(cfg, log=lambda *_: None)
  with pytest.raises(rewards.RewardError, match="verifier crashed"):
    trainer.run()
  trainer.close()
  # Nothing half-written: no RL checkpoint exists for the failed step.
  assert not list((tmp_path / "raise" / "checkpoints" / "rl").glob("[0-9]*"))

  cfg = dataclasses.replace(
    cfg, workdir=str(tmp_path / "zero"), reward=RewardConfig("flaky_for_test", "zero")
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run(until=1)
  trainer.close()
  line = [json.loads(x) for x in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
  rows = [r for r in line if r["phase"] == "rl"]
  assert rows and rows[0]["rl/reward_errors"] > 0
  # All of them exceptions (the reward raised): none timed out or returned a bad value.
  assert rows[0]["rl/reward_errors_exception"] == rows[0]["rl/reward_errors"]
  assert rows[0]["rl/reward_errors_timeout"] == rows[0]["rl/reward_errors_invalid"] == 0


@pytest.mark.e2e
def test_grpo_raises_a_learnable_reward(tmp_path):
  """End to end, RL moves reward the right way: a reward the policy can reach by itself
  (answers that start with "1") climbs well above where it started."""
  from jaxrl import rewards

  @rewards.register("starts_with_one_for_test")
  def starts_with_one(completion, record):
    return float(completion.startswith("1"))

  cfg = _config(tmp_path, steps=8, optim={"learning_rate": 3e-3}, prompts_per_step=8, group_size=8)
  cfg = dataclasses.replace(cfg, reward=RewardConfig("starts_with_one_for_test", "raise"))
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  trainer.close()
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  reward = [r["rl/reward_mean"] for r in lines if r["phase"] == "rl"]
  assert np.mean(reward[-2:]) > np.mean(reward[:2]) + 0.2, reward


def _rl_trainer(tmp_path, reward_name, devices=1, **rl):
  cfg = _config(tmp_path, devices, prompts_per_step=4, group_size=4, **rl)
  cfg = dataclasses.replace(cfg, reward=RewardConfig(reward_name, "raise"))
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.state = trainer.learner.init(trainer.ctx.init_params)
  it = iter(trainer.ctx.task.train_dataset(seed=0, batch_size=4))
  rounds = []
  inner = trainer.experience.sample

  def spy(step, rnd, params, records, **kw):
    out = inner(step, rnd, params, records, **kw)
    rounds.append(np.asarray(out[1]).reshape(-1, 4))
    return out

  trainer.experience.sample = spy
  return trainer, it, rounds


def _collect(trainer, step, records, next_records=None):
  """The rollout stage of one step with the learner's current params (metrics fetched)."""
  batch, stats = trainer.experience.collect(
    step, trainer.state.policy.params, records, next_records
  )
  return batch, {k: float(v) for k, v in jax.device_get(stats).items()}


@pytest.mark.e2e
def test_dynamic_sampling_never_trains_on_an_all_equal_group(tmp_path):
  from jaxrl import rewards

  @rewards.register("half_the_prompts_tie_for_test")
  def half_tie(completion, record):
    a = int(record["prompt"].split("+")[0].split("-")[0])
    return 0.5 if a % 2 else float(completion.startswith("1"))

  ds = {"enabled": True, "max_rounds": 5}
  trainer, it, rounds = _rl_trainer(tmp_path, "half_the_prompts_tie_for_test", dynamic_sampling=ds)
  for step in range(3):
    rounds.clear()
    batch, stats = _collect(trainer, step, next(it), lambda: next(it))
    sampled = np.concatenate(rounds)
    tied = np.all(sampled == sampled[:, :1], axis=1)
    assert stats["rl/sampling_rounds"] == len(rounds) <= 5
    assert stats["rl/dropped_groups"] == tied.sum()
    assert stats["rl/filler_groups"] == max(0, 4 - int((~tied).sum()))
    weight = np.asarray(batch.loss_mask).reshape(4, 4, -1).max(axis=(1, 2))  # per group
    adv = np.abs(np.asarray(batch.advantages)).reshape(4, 4, -1).max(axis=(1, 2))
    # Every group that carries loss has unequal rewards (non-zero group-relative advantages).
    assert np.all((weight == 0) | (adv > 0)), (weight, adv)
    assert (weight > 0).sum() == min(4, int((~tied).sum()))
    if (~tied).sum() < 4:
      assert len(rounds) == 5  # more rounds were drawn until the cap
  trainer.close()


@pytest.mark.e2e
def test_dynamic_sampling_at_the_cap_fills_with_zero_weight_groups(tmp_path):
  from jaxrl import rewards

  @rewards.register("constant_for_test")
  def constant(completion, record):
    return 1.0

  ds = {"enabled": True, "max_rounds": 3}
  trainer, it, rounds = _rl_trainer(tmp_path, "constant_for_test", dynamic_sampling=ds)
  batch, stats = _collect(trainer, 0, next(it), lambda: next(it))
  assert len(rounds) == 3 and stats["rl/sampling_rounds"] == 3
  assert stats["rl/dropped_groups"] == 12 and stats["rl/filler_groups"] == 4
  assert float(np.sum(batch.loss_mask)) == 0.0 and batch.size == 16  # shape kept
  trainer.close()


@pytest.mark.e2e
def test_overlong_shaping_and_truncation_masking(tmp_path):
  from jaxrl import rewards

  @rewards.register("zero_for_test")
  def zero(completion, record):
    return 0.0

  overlong = {"buffer": 3, "penalty": 1.0, "mask_truncated": True}
  trainer, it, _ = _rl_trainer(tmp_path, "zero_for_test", overlong=overlong, scale_by_std=False)
  batch, stats = _collect(trainer, 0, next(it))
  n_new = trainer.cfg.rl.max_new_tokens
  comp = np.asarray(batch.loss_mask)[:, -n_new:]
  lengths = (np.asarray(batch.valid)[:, -n_new:]).sum(1)
  shaped = np.clip((n_new - 3 - lengths) / 3, -1, 0)  # DAPO eq. 13 with L_cache = 3
  np.testing.assert_allclose(stats["rl/overlong_penalty"], shaped.mean(), rtol=1e-6)
  truncated = lengths == n_new  # a tiny random model rarely emits EOS: most rows are cut
  assert truncated.any()
  assert np.all(comp[truncated] == 0) and np.all(comp[~truncated].sum(1) == lengths[~truncated])
  trainer.close()


@pytest.mark.e2e
def test_run_with_offpolicy_corrections_and_dapo_options(tmp_path):
  """decoupled (recomputed pi_prox) + TIS + entropy bonus + dynamic sampling run end to end and
  report the off-policy and sampling metrics every step."""
  cfg = _config(
    tmp_path,
    steps=2,
    offpolicy={"method": "decoupled", "is_correction": "tis"},
    loss={"entropy_coef": 0.01},
    num_minibatches=2,
    dynamic_sampling={"enabled": True, "max_rounds": 2},
    overlong={"buffer": 2},
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  trainer.close()
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if r["phase"] == "rl"]
  assert len(rl) == 2
  for key in ("offpolicy/kl_k3", "offpolicy/ratio_max", "offpolicy/ratio_p99",
              "offpolicy/clipped_frac", "offpolicy/masked_frac", "rl/sampling_rounds",
              "rl/dropped_groups", "rl/entropy"):  # fmt: skip
    assert all(np.isfinite(r[key]) for r in rl), key
  # pi_prox is recomputed before the first minibatch: learner = sampler params, so the weight's
  # mismatch ratio is numerical only.
  assert max(r["offpolicy/ratio_max"] for r in rl) < 1.5


@pytest.mark.e2e
@pytest.mark.parametrize("mode, fake", [("int8", False), ("fp8_block", False), ("int8", True)])
def test_quantized_rollouts_sample_from_the_quantized_policy_and_report_the_gap(
  tmp_path, mode, fake
):
  """rollout.quantize (int8; fp8 in weight blocks, with fp8 KV pages): the engine reads a W8A8
  copy of the learner's params made at each step on the learner's mesh (every projection equals
  quantize_weight of the learner's weight), the sampler-learner gap shows in rl/logprob_gap and
  the mismatch monitor, and TIS corrects against a recomputed pi_prox."""
  rollout = {"quantize": mode, "learner_fake_quant": fake}
  if mode == "fp8_block":  # veRL's FP8 stack: blockwise fp8 weights and an fp8 KV cache
    rollout["kv_dtype"] = "fp8"
  # int8 with TIS; fp8 without a correction: the mismatch monitor's forward runs either way.
  offpolicy = {"is_correction": "tis"} if mode == "int8" else {}
  cfg = _config(tmp_path, steps=2, offpolicy=offpolicy, rollout=rollout)
  trainer = Trainer(cfg, log=lambda *_: None)
  engine = trainer.sampler.engine
  generate, checked = engine.generate_steps, []

  def spy(params, *args):
    if trainer.state is not None and not checked:
      learner = nnx.to_flat_state(trainer.state.policy.params)
      quantized = dict(nnx.to_flat_state(params))
      n = 0
      for path, v in learner:
        q = quantized[path].get_value()
        if path[-2:] in (("attn", "q"), ("attn", "o"), ("mlp", "down")):
          in_ndim = 2 if path[-1] == "o" else 1
          ref = quantize_weight(v.get_value(), in_ndim, mode)
          assert type(q) is type(ref) and q.values.dtype == ref.values.dtype
          for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
          n += 1
        elif path[-1] == "embed":
          assert q is not None and not isinstance(q, QArray | BlockQArray)
      assert n == 3 * trainer.ctx.model_cfg.num_layers
      checked.append(True)
    return generate(params, *args)

  engine.generate_steps = spy
  trainer.run()
  trainer.close()
  assert checked
  # One decode program for the quantized rollouts, one for evaluating the float policy.
  assert engine.generate_compiles == 2
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if r["phase"] == "rl"]
  assert len(rl) == 2
  # Measured, never hidden: quantized rollouts are scored under the float learner. The mismatch
  # monitor covers every loss token of the batch before any update; rl/logprob_gap covers the
  # rows the first minibatch trains, all of them with TIS (without a correction,
  # skip_zero_advantage leaves the all-tied groups out: here every group ties).
  for r in rl:
    # The sampler's quantized forward over the batch rounds some real activations to zero: int8
    # every |x| under half its row's step (some, never most); e4m3 only what falls below its
    # smallest subnormal, ~4e-6 of the group's max (none, in this model).
    if mode == "int8":
      assert 0 < r["mismatch/act_underflow"] and 0 < r["mismatch/act_underflow_frac"] < 0.5
    else:
      assert r["mismatch/act_underflow_frac"] < 1e-3
    if fake:  # the learner scores with the sampler's numerics: only cache-vs-full rounding left
      assert r["mismatch/abs_logp_p99"] < 1e-4, r["mismatch/abs_logp_p99"]
      continue
    assert 1e-4 < r["mismatch/abs_logp_mean"] <= r["mismatch/abs_logp_p99"] + 1e-6 < 1.0
    assert r["mismatch/kl_k3"] > 0
    if mode == "int8":
      np.testing.assert_allclose(r["mismatch/abs_logp_mean"], r["rl/logprob_gap"], rtol=1e-4)
      assert np.isfinite(r["offpolicy/ratio_max"])


@pytest.mark.e2e
def test_skipping_zero_advantage_rows_leaves_the_update_as_it_was(tmp_path):
  # grpo_arith's rl.skip_zero_advantage='auto': the groups whose rewards tie have zero advantage
  # and are left out of the policy step (here 8 of 16 rows, on the 8 test devices), which divides
  # by the whole batch's denominator. One update from the same state with and without must agree.
  import jax.numpy as jnp

  from jaxrl import rewards

  @rewards.register("odd_prompts_tie_for_skip_test")
  def odd_tie(completion, record):
    a = int(record["prompt"].split("+")[0].split("-")[0])
    return 0.5 if a % 2 else float(len(completion) % 2)

  trainer, it, _ = _rl_trainer(
    tmp_path, "odd_prompts_tie_for_skip_test", devices=0, optim={"warmup_steps": 0}
  )
  learner = trainer.learner
  assert learner.skip_rows
  while True:  # a batch with both kinds of group
    batch, _ = _collect(trainer, 0, next(it))
    live = np.abs(np.asarray(batch.advantages)).reshape(4, -1).max(1) > 0
    if 0 < live.sum() <= 2:
      break
  fresh = jax.tree.map(jnp.copy, trainer.ctx.init_params)

  def update():
    state = learner.init(jax.tree.map(jnp.copy, fresh))
    state, m = learner.update(state, batch, 0)
    return jax.device_get(state.policy.params), jax.device_get(m)

  params_skipped, skipped = update()
  assert skipped["rl/trained_rows"] == 0.5  # 8 of the 16 rows: the live ones, padded
  learner.skip_rows = False
  params_full, full = update()
  assert "rl/trained_rows" in full and full["rl/trained_rows"] == 1.0
  assert learner.step_fn._cache_size() == 2  # one program per row count
  np.testing.assert_allclose(skipped["opt/grad_norm"], full["opt/grad_norm"], rtol=1e-5)
  assert skipped["opt/loss_tokens"] == full["opt/loss_tokens"]

  def leaf_diffs(x, y):
    return [np.abs(a - b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)]

  diffs = leaf_diffs(params_skipped, params_full)
  moved = leaf_diffs(params_full, fresh)
  step = max(m.max() for m in moved)
  assert step == pytest.approx(trainer.cfg.rl.optim.learning_rate, rel=1e-3)  # Adam: lr * g / |g|
  # Adam's first update is lr * g / (|g| + eps): the two gradients differ only by float
  # summation order (train_step_test bounds that), which moves no parameter by 0.1% of a step.
  assert max(d.max() for d in diffs) <= 1e-3 * step
  trainer.close()


@pytest.mark.e2e
def test_scoring_overlapped_with_decoding_gives_the_same_run(tmp_path):
  def rl_metric_lines(wd):
    rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    return [
      {k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if r["phase"] == "rl"
    ]

  lines = {}
  for overlap in (True, False):
    cfg = _config(tmp_path / str(overlap), steps=2, rollout={"overlap_rewards": overlap})
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.run()
    trainer.close()
    lines[overlap] = rl_metric_lines(tmp_path / str(overlap))
  assert lines[True] == lines[False]
