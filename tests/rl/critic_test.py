"""The critic: value model alignment and init, the value loss against numpy, PPO in the loop."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import smoke_configdict
from flax import nnx
from helpers import numpy_model

from jaxrl import rewards
from jaxrl.config import CriticConfig, RewardConfig, validate
from jaxrl.mesh import get_rules, make_mesh, shard_params
from jaxrl.models.config import ModelConfig
from jaxrl.models.lora import merge_lora
from jaxrl.models.transformer import apply, make_model, positions_from_mask
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.critic import Critic, ValueLoss
from jaxrl.rl.loop import Trainer

pytestmark = pytest.mark.integration

CFG = ModelConfig.tiny(vocab_size=37)


@rewards.register("ppo_starts_with_one_for_test")
def _starts_with_one(completion, record):
  """A reward a barely trained tiny model reaches by itself (exact match would be all 0)."""
  return float(completion.startswith("1"))


@pytest.fixture(scope="module")
def setup():
  mesh = make_mesh(1, -1, 1)
  rules = get_rules("fsdp_tp")
  graphdef, params = make_model(CFG, seed=3)
  params = shard_params(params, mesh, rules)
  critic = Critic(CFG, CriticConfig(learning_rate=3e-3), total_updates=100, mesh=mesh, rules=rules)
  return critic, graphdef, params


def _tokens(b=3, t=9, seed=0):
  rng = np.random.default_rng(seed)
  toks = rng.integers(1, CFG.vocab_size, (b, t)).astype(np.int32)
  valid = np.ones((b, t), bool)
  valid[0, :2] = False  # left padding
  return jnp.asarray(toks), jnp.asarray(valid)


def test_critic_starts_from_the_policy_trunk_with_zero_values(setup):
  critic, _, params = setup
  state = critic.init(CFG, params)
  trunk = state.params["trunk"]
  assert "head" not in trunk  # the unused output head is not allocated
  for path, x in nnx.to_flat_state(trunk):
    src = dict(nnx.to_flat_state(params))[path]
    np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(src.get_value()))
    # A copy, not an alias: the policy's train step donates its arrays.
    ptr = lambda a: a.addressable_shards[0].data.unsafe_buffer_pointer()  # noqa: E731
    assert ptr(x.get_value()) != ptr(src.get_value())
  toks, valid = _tokens()
  np.testing.assert_array_equal(critic.values(state.params, toks, valid), 0.0)


def test_values_read_the_policy_hidden_states_and_only_the_prefix(setup):
  critic, graphdef, params = setup
  state = critic.init(CFG, params)
  rng = np.random.default_rng(1)
  head = rng.normal(size=CFG.embed_dim).astype(np.float32)
  p = state.params
  p["value_head"] = nnx.Param(jnp.asarray(head))
  p["value_bias"] = nnx.Param(jnp.asarray(0.25, jnp.float32))
  toks, valid = _tokens()
  values = np.asarray(critic.values(p, toks, valid))
  # Reference: the policy's own final-normed hidden states (same trunk weights), dotted by hand.
  h, _ = apply(graphdef, params, toks, positions_from_mask(valid), valid, return_hidden=True)
  expect = np.asarray(h) @ head + 0.25
  # Compared where the prefix ends on a real token (a pad row's state is never in a loss).
  real = np.asarray(valid)[:, :-1]
  np.testing.assert_allclose(values[:, 1:][real], expect[:, :-1][real], rtol=1e-5, atol=1e-5)
  assert np.all(values[:, 0] == 0)
  # Column j values the prefix tokens[:, :j]: changing token j leaves columns <= j unchanged.
  j = 5
  toks2 = toks.at[:, j].set((toks[:, j] + 1) % CFG.vocab_size)
  values2 = np.asarray(critic.values(p, toks2, valid))
  keep = real[:, :j]
  np.testing.assert_array_equal(values2[:, 1 : j + 1][keep], values[:, 1 : j + 1][keep])
  assert np.abs(values2[:, j + 1 :] - values[:, j + 1 :]).max() > 1e-4


def test_lora_policy_gives_a_critic_of_merged_weights(setup):
  critic, _, _ = setup
  cfg = dataclasses.replace(CFG, lora_rank=4, lora_alpha=8.0, lora_targets=("q", "down"))
  _, params = numpy_model(cfg, seed=5, zero_lora_b=False)  # B drawn: merging changes weights
  mesh, rules = make_mesh(1, -1, 1), get_rules("fsdp_tp")
  critic = Critic(cfg, CriticConfig(), total_updates=1, mesh=mesh, rules=rules)
  state = critic.init(cfg, params)
  _, merged = merge_lora(cfg, params)
  got = dict(nnx.to_flat_state(state.params["trunk"]))
  assert not any("lora" in "/".join(map(str, k)) for k in got)
  for path, x in nnx.to_flat_state(merged):
    if path[0] != "head":
      np.testing.assert_allclose(np.asarray(got[path].get_value()), np.asarray(x.get_value()))


def _value_batch(values_old, returns, mask, toks, valid):
  z = jnp.zeros(toks.shape, jnp.float32)
  v = jnp.full(toks.shape, -1, jnp.int32)
  return TrainBatch(toks, valid, mask, z, z, z, v, values=values_old, returns=returns)


def test_value_loss_matches_numpy_and_the_critic_fits_returns(setup):
  critic, _, params = setup
  state = critic.init(CFG, params)
  toks, valid = _tokens(b=4, t=8, seed=2)
  rng = np.random.default_rng(3)
  mask = np.zeros((4, 8), np.float32)
  mask[:, 4:] = 1
  mask[3, 6:] = 0  # a shorter completion
  returns = (rng.normal(size=(4, 8)) * mask).astype(np.float32)
  old = (rng.normal(size=(4, 8)) * 0.3 * mask).astype(np.float32)
  batch = _value_batch(*(jnp.asarray(x) for x in (old, returns, mask)), toks, valid)
  p = state.params
  p["value_head"] = nnx.Param(jnp.asarray(rng.normal(size=CFG.embed_dim), jnp.float32))
  values = np.asarray(critic.values(p, toks, valid), np.float64)
  loss = ValueLoss(critic.graphdef, clip=0.2)
  total, metrics = loss(p, batch)
  # numpy PPO2 value loss: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)
  clipped_v = old + np.clip(values - old, -0.2, 0.2)
  per = 0.5 * np.maximum((values - returns) ** 2, (clipped_v - returns) ** 2) * mask
  np.testing.assert_allclose(float(total), per.sum(), rtol=1e-5)
  assert float(loss.denominator(batch)) == mask.sum()
  # Trained on fixed targets (clip off), the critic's error falls.
  state = critic.init(CFG, params)
  fit_batch = batch._replace(values=batch.returns)  # anchor = target: the clip never binds
  errors = []
  for _ in range(30):
    state, m = critic.step(state, fit_batch)
    errors.append(float(m["critic/abs_error"]))
  assert errors[-1] < 0.5 * errors[0], errors
  assert critic.step._cache_size() == 1


def _ppo_config(workdir, **rl):
  c = smoke_configdict(
    workdir,
    sft={"steps": 10},
    rl={
      "steps": 4,
      "advantage": "gae",
      "group_size": 1,
      "prompts_per_step": 32,
      "critic": {"warmup_steps": 1, "learning_rate": 1e-3},
    },
    eval={"every": 2, "num_examples": 16},
    checkpoint={"every": 2},
    reward={"name": "ppo_starts_with_one_for_test"},
  )
  c.rl.update(rl)  # on top of the rl defaults above, nested sections key by key
  return validate(c)


def _rl_lines(wd):
  lines = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
  return [
    {k: v for k, v in r.items() if not k.startswith("time/")} for r in lines if r["phase"] == "rl"
  ]


@pytest.mark.e2e
def test_ppo_warmup_trains_only_the_critic_and_resume_repeats_a_full_run(tmp_path):
  full = Trainer(_ppo_config(tmp_path / "full"), log=lambda *_: None)
  full.run()
  expect = jax.device_get((full.state.policy.params, full.state.critic.params))
  full.close()

  part = Trainer(_ppo_config(tmp_path / "part"), log=lambda *_: None)
  part.run_sft()
  sft = [np.array(x) for x in jax.tree.leaves(part.sft_params)]
  part.run_rl(until=1)  # the one warm-up step: only the critic trains
  part.rl_ckpt.wait()
  after = [np.array(x) for x in jax.tree.leaves(part.state.policy.params)]
  assert all(np.array_equal(a, b) for a, b in zip(sft, after, strict=True))
  assert float(part.state.critic.step) == 1 and float(part.state.policy.step) == 0
  # The head starts at 0, so the first update moves the head (the trunk's gradient is 0).
  assert np.abs(np.asarray(part.state.critic.params["value_head"].get_value())).max() > 0
  part.close()

  resumed = Trainer(_ppo_config(tmp_path / "part"), log=lambda *_: None)
  resumed.run()
  got = jax.device_get((resumed.state.policy.params, resumed.state.critic.params))
  resumed.close()
  lines = _rl_lines(tmp_path / "part")
  assert lines == _rl_lines(tmp_path / "full")
  assert lines[0]["rl/updates"] == 0 and "rl/loss" not in lines[0] and "critic/loss" in lines[0]
  assert lines[1]["rl/updates"] == 1 and "rl/loss" in lines[1]
  for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.e2e
def test_ppo_raises_a_learnable_reward(tmp_path):
  """One sample per prompt, the critic as the only baseline: reward still climbs."""
  cfg = _ppo_config(tmp_path, steps=8, optim={"learning_rate": 3e-3}, prompts_per_step=64)
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  trainer.close()
  reward = [r["rl/reward_mean"] for r in _rl_lines(tmp_path)]
  assert np.mean(reward[-2:]) > np.mean(reward[:2]) + 0.2, reward


def test_kl_in_reward_is_a_per_token_penalty_with_gae(tmp_path):
  """beta * k1 folded into the reward: the batch's GAE returns equal a numpy GAE of the
  terminal reward minus beta * (log pi_old - log pi_ref) per token."""

  @rewards.register("quarter_for_test")
  def quarter(completion, record):
    return 0.25

  critic = dict(warmup_steps=1, lam=1.0)
  kl = {"beta": 0.5, "in_reward": True, "estimator": "k1"}
  cfg = _ppo_config(tmp_path, kl=kl, critic=critic)
  cfg = dataclasses.replace(cfg, reward=RewardConfig("quarter_for_test", "raise"))
  trainer = Trainer(cfg, log=lambda *_: None)
  p = trainer.ctx.init_params
  ref = jax.tree.map(lambda x: x * 1.1, p)  # a reference that differs
  state = trainer.learner.init(p)
  assert trainer.learner.loss.beta == 0.0  # rl.kl.in_reward: not also a loss term
  it = iter(trainer.ctx.task.train_dataset(seed=0, batch_size=32))
  batch, stats = trainer.experience.collect(
    0, state.policy.params, next(it), ref_params=ref, critic_params=state.critic.params
  )
  mask = np.asarray(batch.loss_mask, np.float64)
  kl = (np.asarray(batch.old_logprobs) - np.asarray(batch.ref_logprobs)) * mask
  assert np.abs(kl).max() > 1e-3
  # Initial values are 0, gamma = lam = 1: the return at t is the reward-to-go of its row.
  last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
  r = np.zeros(mask.shape)
  r[np.arange(len(r)), last] = 0.25
  per_token = r - 0.5 * kl
  expect = np.cumsum(per_token[:, ::-1], axis=1)[:, ::-1] * mask
  np.testing.assert_allclose(np.asarray(batch.returns), expect, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["rl/kl_in_reward"], kl.sum() / mask.sum(), rtol=1e-5)
  trainer.close()


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_loss_gradient_matches_finite_differences(setup, clip):
  """d/dt L(params + t u) at t = 0 by central differences equals <grad L, u> for the critic's
  token-mean value loss (h, rtol as in objectives_test's finite-difference check)."""
  critic, _, params = setup
  p = critic.init(CFG, params).params
  rng = np.random.default_rng(11)
  p["value_head"] = nnx.Param(jnp.asarray(rng.normal(size=CFG.embed_dim), jnp.float32))
  toks, valid = _tokens(b=4, t=8, seed=4)
  mask = np.zeros((4, 8), np.float32)
  mask[:, 3:] = 1
  returns = rng.normal(size=(4, 8)).astype(np.float32) * mask
  old = np.asarray(critic.values(p, toks, valid)) + rng.normal(0, 0.3, (4, 8)).astype(np.float32)
  batch = _value_batch(*(jnp.asarray(x) for x in (old * mask, returns, mask)), toks, valid)
  loss = ValueLoss(critic.graphdef, clip=clip)
  den = loss.denominator(batch)
  f = jax.jit(lambda q: loss(q, batch)[0] / den)
  grads = jax.jit(jax.grad(lambda q: loss(q, batch)[0] / den))(p)
  leaves, treedef = jax.tree.flatten(p)
  u = [rng.normal(size=x.shape).astype(np.float32) * (np.sqrt(np.mean(np.square(x))) or 1.0)
       for x in leaves]  # fmt: skip
  directional = sum(
    float(np.vdot(np.asarray(g), v)) for g, v in zip(jax.tree.leaves(grads), u, strict=True)
  )
  at = lambda t: float(f(treedef.unflatten([x + t * v for x, v in zip(leaves, u, strict=True)])))  # noqa: E731
  h = 1e-3
  assert abs(directional) > 1e-3
  np.testing.assert_allclose((at(h) - at(-h)) / (2 * h), directional, rtol=1e-2)


def test_micro_batched_critic_step_equals_one_batch(setup):
  critic, _, params = setup
  mesh, rules = make_mesh(1, -1, 1), get_rules("fsdp_tp")
  cfg = CriticConfig(learning_rate=3e-3)
  micro = Critic(CFG, cfg, total_updates=10, mesh=mesh, rules=rules, num_microbatches=2)
  toks, valid = _tokens(b=4, t=8, seed=6)
  mask = np.zeros((4, 8), np.float32)
  mask[:, 5:] = 1
  returns = np.random.default_rng(7).normal(size=(4, 8)).astype(np.float32) * mask
  batch = _value_batch(*(jnp.asarray(x) for x in (returns * 0.5, returns, mask)), toks, valid)
  one, _ = critic.step(critic.init(CFG, params), batch)
  two, _ = micro.step(micro.init(CFG, params), batch)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
