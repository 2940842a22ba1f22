"""RL loop tests: the sampler reads the learner's arrays, compile once, exact resume."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import configs.grpo_arith as grpo_arith
from jaxrl.config import RewardConfig, validate
from jaxrl.rl.loop import Trainer


def _config(workdir, **rl):
  c = grpo_arith.get_config("smoke")
  c.workdir = str(workdir)
  c.log.progress = False
  c.log.tensorboard = False
  c.model.preset = "tiny"
  c.sft.steps = 10
  c.rl.steps = 4
  c.eval.every = 2
  c.eval.num_examples = 16
  c.eval.batch_size = 16
  c.checkpoint.every = 2
  c.rl.update(rl)
  return validate(c)


def _pointers(tree):
  """Device-buffer addresses of every shard of every leaf (the Trainer uses all 8 test devices)."""
  return [
    s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards
  ]


@pytest.fixture(scope="module")
def run_with_spy(tmp_path_factory):
  trainer = Trainer(_config(tmp_path_factory.mktemp("spy"), beta=0.05), log=lambda *_: None)
  seen = []
  sample = trainer.sample_fn

  def spy(params, *args):
    learner = trainer.state.params
    seen.append((params is learner, _pointers(params), _pointers(learner)))
    return sample(params, *args)

  trainer.sample_fn = spy
  trainer.run()
  yield trainer, seen
  trainer.close()


def test_sampler_receives_the_learners_own_arrays(run_with_spy):
  trainer, seen = run_with_spy
  assert len(seen) == trainer.cfg.rl.steps
  for same_object, sampler_ptrs, learner_ptrs in seen:
    assert same_object
    assert sampler_ptrs == learner_ptrs  # same device buffers: zero bytes copied


def test_steps_compile_once(run_with_spy):
  trainer, _ = run_with_spy
  assert trainer.rl_step._cache_size() == 1
  assert trainer.sft_step._cache_size() == 1
  assert trainer.greedy_fn._cache_size() == 1


def test_run_writes_metrics_checkpoints_and_plot(run_with_spy):
  trainer, _ = run_with_spy
  wd = trainer.workdir
  lines = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3, 4]
  for key in (
    "rl/loss",
    "rl/kl",
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
  assert (wd / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert json.loads((wd / "summary.json").read_text())["accuracy_after_rl"] >= 0
  assert trainer.rl_ckpt.latest_step() == 4
  assert trainer.sft_ckpt.latest_step() == 10


def test_resume_repeats_an_uninterrupted_run(tmp_path):
  def rl_lines(wd):
    out = []
    for line in (wd / "metrics.jsonl").read_text().splitlines():
      r = json.loads(line)
      if r["phase"] == "rl":
        out.append({k: v for k, v in r.items() if not k.startswith("time/")})
    return out

  full = Trainer(_config(tmp_path / "full"), log=lambda *_: None)
  full.run()
  full_params = jax.device_get(full.state.params)
  full.close()

  part = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  part.run(until=2)
  assert part.rl_ckpt.latest_step() == 2
  part.close()
  resumed = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  resumed.run()
  resumed_params = jax.device_get(resumed.state.params)
  resumed.close()

  assert rl_lines(tmp_path / "part") == rl_lines(tmp_path / "full")
  for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(resumed_params), strict=True):
    np.testing.assert_array_equal(a, b)


def test_interrupted_warm_start_resumes_to_the_same_params(tmp_path):
  full = Trainer(_config(tmp_path / "full"), log=lambda *_: None)
  full.run_sft()
  expect = [np.array(x) for x in jax.tree.leaves(full.sft_params)]
  full.close()
  part = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  part.run_sft(until=7)  # checkpoint.every=2: the forced save at 7 is what resumes
  assert part.sft_ckpt.latest_step() == 7
  part.close()
  resumed = Trainer(_config(tmp_path / "part"), log=lambda *_: None)
  resumed.run_sft()
  got = [np.array(x) for x in jax.tree.leaves(resumed.sft_params)]
  resumed.close()
  for a, b in zip(expect, got, strict=True):
    np.testing.assert_array_equal(a, b)


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
  errors = [r["rl/reward_errors"] for r in line if r["phase"] == "rl"]
  assert errors and errors[0] > 0


def test_prompt_longer_than_the_bucket_is_an_error_naming_it(tmp_path):
  c = grpo_arith.get_config("smoke")
  c.workdir = str(tmp_path)
  c.log.progress = False
  c.model.preset = "tiny"
  c.rl.max_prompt_len = 5  # "BOS 12+34=" needs 7
  trainer = Trainer(validate(c), log=lambda *_: None)
  with pytest.raises(ValueError, match=r"prompt '\d+[+-]\d+=' has \d+ tokens.*max_prompt_len=5"):
    trainer.run()
  trainer.close()
  assert not list(tmp_path.glob("checkpoints/*/[0-9]*"))


def test_grpo_raises_a_learnable_reward(tmp_path):
  """End to end, RL moves reward the right way: a reward the policy can reach by itself
  (answers that start with "1") climbs well above where it started."""
  from jaxrl import rewards

  @rewards.register("starts_with_one_for_test")
  def starts_with_one(completion, record):
    return float(completion.startswith("1"))

  cfg = _config(tmp_path, steps=8, learning_rate=3e-3, prompts_per_step=8, group_size=8)
  cfg = dataclasses.replace(cfg, reward=RewardConfig("starts_with_one_for_test", "raise"))
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  trainer.close()
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  reward = [r["rl/reward_mean"] for r in lines if r["phase"] == "rl"]
  assert np.mean(reward[-2:]) > np.mean(reward[:2]) + 0.2, reward
