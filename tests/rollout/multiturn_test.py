"""Multi-turn rollouts (jaxrl.rollout.multiturn): trajectories hold the engine's exact tokens and
log-probs with observations interleaved and loss-masked, every turn of every episode in one
Driver.run (no turn barrier); the driver's on_finished feed; the calculator and Python tools."""

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import tiny_model

from jaxrl.rewards.sandbox import Limits
from jaxrl.rl.batch import rollout_columns
from jaxrl.rollout.collect import GroupSampler
from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.multiturn import (
  CalculatorEnv,
  EnvStep,
  PythonToolEnv,
  calculate,
  run_episodes,
)
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

TOK = ByteTokenizer()
SAMPLED = SamplingParams(temperature=1.0)
MAX_TURNS, MAX_NEW = 3, 6


@functools.cache
def _engine():
  cfg, graphdef, params = tiny_model()
  engine = Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=3,
    num_pages=48,
    page_size=4,
    max_prefill_length=60,
    prefill_chunk_size=16,
    max_target_length=64,
    tokenizer=TOK,
  )
  return engine, params


@dataclasses.dataclass
class Scripted:
  """Answers every turn with `obs[turn]` until they run out, then ends with reward 1."""

  obs: list
  stop_strings: tuple = ("q",)
  seen: list = dataclasses.field(default_factory=list)

  def step(self, action, finish_reason):
    self.seen.append((action, finish_reason))
    turn = len(self.seen) - 1
    if turn < len(self.obs):
      return EnvStep(self.obs[turn], reward=0.25)
    return EnvStep(None, reward=1.0, done=True)


def _run(driver, prompts, envs, **kw):
  """run_episodes with this file's engine, turn limits, sampling and seed."""
  _, params = _engine()
  return run_episodes(
    driver, params, prompts, envs, tokenizer=TOK, max_turns=MAX_TURNS, max_new_tokens=MAX_NEW,
    sampling=SAMPLED, seed=5, **kw,
  )  # fmt: skip


def _episodes(executor=None):
  engine, _ = _engine()
  prompts = [TOK.encode(f"task {i}:", add_bos=True) for i in range(4)]
  envs = [Scripted(["<a=1>", "<bb>"][: i % 3]) for i in range(4)]  # 1, 2, 3, 1 turns
  driver = Driver(engine, steps_per_call=4)
  runs = []
  real = driver.run
  driver.run = lambda *a, **k: (runs.append(1), real(*a, **k))[1]
  trajs = _run(driver, prompts, envs, policy_version=7, executor=executor)
  return trajs, envs, prompts, len(runs)


def test_trajectories_interleave_turns_and_masked_observations():
  trajs, envs, prompts, runs = _episodes()
  assert runs == 1  # every turn of every episode in one driver run: no turn barrier
  for traj, env, prompt in zip(trajs, envs, prompts, strict=True):
    assert traj.prompt_tokens.tolist() == prompt
    assert len(traj.turns) == len(env.seen) == len(env.obs) + 1
    assert traj.finish_reason == "done" and traj.reward == pytest.approx(1.0 + 0.25 * len(env.obs))
    want_mask = np.zeros(len(traj.tokens), bool)
    for k, (start, end) in enumerate(traj.turns):
      want_mask[start:end] = True
      assert TOK.decode(traj.tokens[start:end].tolist()) == env.seen[k][0]  # what the env saw
      if k < len(env.obs):  # the observation right after the turn, as its tokens
        obs = TOK.encode(env.obs[k])
        nxt = traj.turns[k + 1][0]
        assert traj.tokens[end:nxt].tolist() == obs
    np.testing.assert_array_equal(traj.loss_mask, want_mask)  # exactly the model's tokens
    assert np.all(traj.logprobs[~want_mask] == 0) and np.all(traj.versions[~want_mask] == -1)
    assert np.all(traj.versions[want_mask] == 7) and np.all(traj.logprobs[want_mask] < 0)


def test_each_turn_is_what_the_engine_samples_for_that_context():
  # Replaying any turn alone (its context as the prompt, its request id, the run's seed) gives
  # the trajectory's tokens and log-probs: the ids were never decoded and re-encoded.
  trajs, envs, _, _ = _episodes(executor=ThreadPoolExecutor(2))
  engine, params = _engine()
  replay = Driver(engine, steps_per_call=4)
  checked = 0
  for traj, env in zip(trajs, envs, strict=True):
    for k, (start, end) in enumerate(traj.turns):
      context = traj.prompt_tokens.tolist() + traj.tokens[:start].tolist()
      left = min(engine.max_target_length - len(traj.prompt_tokens), 64) - start
      req = Request(
        context,
        traj.episode * MAX_TURNS + k,
        sampling=SAMPLED,
        max_new_tokens=min(MAX_NEW, left),
        stop_strings=env.stop_strings,
      )
      (c,) = replay.run(params, [req], seed=5).finished
      assert c.tokens.tolist() == traj.tokens[start:end].tolist()
      np.testing.assert_allclose(c.logprobs, traj.logprobs[start:end], rtol=1e-5, atol=1e-6)
      checked += 1
  assert checked == 7


def test_a_groups_episodes_share_the_prefill_of_their_first_turn():
  # 3 prompts x 2 episodes; with group_ids each prompt's first turn is prefilled once, and the
  # episodes are the very ones sampled without (request ids, not slots, fix every draw).
  engine, params = _engine()
  prompts = [TOK.encode(f"task {i}:", add_bos=True) for i in range(3) for _ in range(2)]
  out = {}
  for grouped in (False, True):
    envs = [Scripted(["<a=1>"][: k % 2]) for k in range(6)]  # 1 or 2 turns
    stats = {}
    groups = [k // 2 for k in range(6)] if grouped else None
    trajs = _run(Driver(engine, steps_per_call=4), prompts, envs, group_ids=groups, stats=stats)
    out[grouped] = trajs, stats
  (plain, plain_stats), (grouped, grouped_stats) = out[False], out[True]
  later = sum(len(t.turns) - 1 for t in plain)
  assert later == 3
  assert plain_stats["prefill_prompts"] == 6 + later
  assert grouped_stats["prefill_prompts"] == 3 + later  # one prefill per prompt's group
  for a, b in zip(plain, grouped, strict=True):
    assert a.tokens.tolist() == b.tokens.tolist() and a.turns == b.turns
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  with pytest.raises(ValueError, match="the episodes of group 0 do not share their prompt"):
    run_episodes(Driver(engine), params, prompts[1:3], [Scripted([]), Scripted([])],
                 tokenizer=TOK, max_turns=1, max_new_tokens=2, group_ids=[0, 0])  # fmt: skip


def test_turn_and_length_limits_end_an_episode():
  engine, params = _engine()
  prompts = [TOK.encode("go:", add_bos=True)] * 2
  endless = [Scripted(["+"] * 10), Scripted(["x" * 30] * 10)]
  driver = Driver(engine, steps_per_call=4)
  a, b = run_episodes(
    driver, params, prompts, endless, tokenizer=TOK, max_turns=2, max_new_tokens=4,
    max_total_tokens=30, sampling=SAMPLED,
  )  # fmt: skip
  assert a.finish_reason == "turns" and len(a.turns) == 2
  assert b.finish_reason == "length" and len(b.turns) == 1  # its 30-token observation: no room
  for t in (a, b):  # an observation no turn reads is not appended
    assert len(t.tokens) == t.turns[-1][1] and t.loss_mask[-1]
  with pytest.raises(ValueError, match="2 prompts but 1 environments"):
    run_episodes(driver, params, prompts, endless[:1], tokenizer=TOK, max_turns=2, max_new_tokens=4)


def test_the_driver_refuses_a_fed_request_it_cannot_run_as_fed():
  engine, params = _engine()
  driver = Driver(engine, steps_per_call=4)
  first = Request(TOK.encode("a", add_bos=True), 0, max_new_tokens=2)
  again = Request(TOK.encode("b", add_bos=True), 0, max_new_tokens=2)  # id 0 is taken
  with pytest.raises(ValueError, match="fed requests are ungrouped, not resumed, with ids"):
    driver.run(params, [first], on_finished=lambda done: [again])
  grouped = Request(TOK.encode("b", add_bos=True), 1, group_id=3, max_new_tokens=2)
  with pytest.raises(ValueError, match="fed requests are ungrouped"):
    Driver(engine).run(params, [first], on_finished=lambda done: [grouped])


@pytest.mark.parametrize(
  ("expr", "value"),
  [
    ("48/2", "24"),
    ("3*(4+5)", "27"),
    ("7/2", "3.5"),
    ("-5+2", "-3"),
    ("17 % 5", "2"),
    ("10/3", "3.333333"),
    ("2**10", None),  # powers are not the calculator's
    ("__import__('os')", None),
    ("1/0", None),
    ("99999999*99999999", None),  # past 1e12
    ("4+", None),
    ("x*2", None),
  ],
)
def test_the_calculator_evaluates_arithmetic_only(expr, value):
  assert calculate(expr) == value


def test_the_calculator_env_answers_calls_and_scores_the_final_turn():
  env = CalculatorEnv(answer="24")
  assert env.step("half of 48 is <<48/2=", "stop_string") == EnvStep("24>>")
  assert env.step("then <<2**99=", "stop_string") == EnvStep("?>>")
  assert env.step("so x =", "stop_string") == EnvStep(None)  # an "=" that is no call
  assert env.calls == 2
  assert env.step(" so the answer is 24", "stop") == EnvStep(None, reward=1.0, done=True)
  assert env.step(" so the answer is 25", "stop").reward == 0.0
  assert env.step("<<48/2=", "length").done  # a cut-off call is no call


def test_the_python_tool_runs_code_in_the_sandbox():
  env = PythonToolEnv(limits=Limits(cpu_s=2, wall_s=5.0), score=lambda t: float("42" in t))
  assert env.step("<py>print(6*7)</py>", "stop_string") == EnvStep("<out>42\n</out>")
  failed = env.step("<py>1/0</py>", "stop_string").observation
  assert failed == "<out>ZeroDivisionError: division by zero</out>"
  env_leak = env.step("<py>import os; print(sorted(os.environ))</py>", "stop_string")
  # An empty environment; Python itself may add LC_CTYPE (PEP 538 C-locale coercion).
  assert env_leak.observation in ("<out>[]\n</out>", "<out>['LC_CTYPE']\n</out>")
  assert env.step("it is 42", "stop") == EnvStep(None, reward=1.0, done=True)


def test_a_group_sampler_row_is_an_episode_with_its_observations_off_the_loss():
  # rl.rollout.env: GroupSampler rows are whole episodes; the TrainBatch columns attend to the
  # observation tokens (valid) but train only the model's (loss_mask), versions -1 on them.
  cfg, graphdef, params = tiny_model()
  obs = TOK.encode("<ok>")
  sampler = GroupSampler(
    cfg, graphdef, prompt_len=12, max_new_tokens=24, eos_ids=(TOK.eos_id,), pad_id=0,
    sampling=SAMPLED, max_concurrent_decodes=4, page_size=4, tokenizer=TOK,
    env_factory=lambda: Scripted(["<ok>"]), max_turns=3, turn_tokens=6,
  )  # fmt: skip
  prompts = [TOK.encode("a:", add_bos=True), TOK.encode("bb:", add_bos=True)]
  rollout, stats = sampler(params, prompts, group_size=2, seed=1, version=4)
  assert stats["turns"] == 8.0  # two turns an episode: one observation between them
  mask, model = np.asarray(rollout.mask), np.asarray(rollout.model_mask)
  for row in range(4):
    between = mask[row] & ~model[row]
    assert rollout.tokens[row][between].tolist() == obs
    assert rollout.versions[row][model[row] & mask[row]].tolist() == [4] * int(model[row].sum())
  cols = rollout_columns(rollout)
  p = rollout.prompt_tokens.shape[1]
  np.testing.assert_array_equal(cols["loss_mask"][:, p:] > 0, mask & model)
  np.testing.assert_array_equal(cols["valid"][:, p:], mask)
  assert np.all(cols["versions"][:, p:][mask & ~model] == -1)
  again, _ = sampler(params, prompts, group_size=2, seed=1, version=4)  # fixed by the seed
  np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(rollout.tokens))


@pytest.mark.e2e
def test_an_rl_run_trains_on_episodes_and_never_on_their_observations(
  tmp_path, monkeypatch, smoke_config
):
  # rl.rollout.env through the whole loop: the environment (scripted here, so that every episode
  # has an observation whatever the tiny model writes) answers, the learner's batches attend to
  # the observation tokens and leave them out of the loss.
  import jax

  from jaxrl.rl import experience
  from jaxrl.rl.loop import Trainer

  monkeypatch.setattr(experience, "env_factory", lambda cfg: lambda: Scripted(["<ok>"]))
  cfg = smoke_config(
    tmp_path,
    sft={"steps": 4},
    eval={"every": 0, "num_examples": 8},
    rl={
      "steps": 2,
      "prompts_per_step": 4,
      "group_size": 2,
      "max_new_tokens": 16,
      "rollout": {"env": "calculator", "max_turns": 2, "turn_tokens": 5},
    },
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  trained, update = [], trainer.learner.update
  trainer.learner.update = lambda state, batch, step: (
    trained.append(jax.device_get(batch)), update(state, batch, step))[1]  # fmt: skip
  trainer.run()
  trainer.close()
  obs = TOK.encode("<ok>")
  assert len(trained) == 2
  for batch in trained:
    valid, loss = np.asarray(batch.valid), np.asarray(batch.loss_mask) > 0
    tokens = np.asarray(batch.tokens)
    for row in range(tokens.shape[0]):
      seen = tokens[row][valid[row] & ~loss[row]].tolist()  # prompt, then the observation
      assert seen[-len(obs) :] == obs and loss[row].any()
      assert np.all(np.asarray(batch.advantages)[row][~loss[row]] == 0)
