"""A step on 8 simulated devices (fsdp x tensor) computes what the single-device step computes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.config import KLConfig
from jaxrl.mesh import get_rules, make_mesh, named_sharding, shard_params
from jaxrl.models import ModelConfig
from jaxrl.models.transformer import make_model
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.objectives import PolicyLoss
from jaxrl.rl.train_step import Optimizer, init_state, make_train_step
from jaxrl.rollout.collect import left_pad
from jaxrl.rollout.reference import make_sampler, row_keys
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration


def _batch(cfg, b=16, t=12):
  k = jax.random.split(jax.random.key(7), 4)
  tokens = jax.random.randint(k[0], (b, t), 3, cfg.vocab_size)
  valid = jnp.ones((b, t), bool).at[::3, :2].set(False)
  loss_mask = jnp.zeros((b, t)).at[:, 6:].set(1.0)
  adv = jax.random.normal(k[1], (b, 1)) * loss_mask
  old = -3.0 + 0.3 * jax.random.normal(k[2], (b, t))
  ref = -3.0 + 0.3 * jax.random.normal(k[3], (b, t))
  return TrainBatch(
    tokens, valid, loss_mask, adv, old * loss_mask, ref * loss_mask, jnp.zeros((b, t), jnp.int32)
  )


def _run(mesh, graphdef, params, batch):
  rules = get_rules("fsdp_tp")
  params = shard_params(jax.tree.map(jnp.copy, params), mesh, rules)
  opt = Optimizer(optax.sgd(0.5), lambda s: 0.5)  # update = -0.5 * grad: compares gradients
  step = make_train_step(opt, PolicyLoss(graphdef, kl=KLConfig(beta=0.1)), num_microbatches=2)
  batch = jax.device_put(batch, named_sharding(mesh, ("batch",), rules))
  state, metrics = step(init_state(params, opt), batch)
  state, metrics2 = step(state, batch)
  assert step._cache_size() == 1
  return state, jax.device_get(metrics), jax.device_get(metrics2)


def test_sharded_step_equals_single_device_step():
  cfg = ModelConfig.tiny()
  graphdef, params = make_model(cfg, seed=3)
  batch = _batch(cfg)
  single = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  sharded = make_mesh(data=1, fsdp=4, tensor=2)
  s1, m1, m1b = _run(single, graphdef, params, batch)
  s8, m8, m8b = _run(sharded, graphdef, params, batch)

  # The sharded run really is sharded.
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(s8.params)}
  assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs), specs
  for m_a, m_b in ((m1, m8), (m1b, m8b)):
    for key in ("rl/loss", "rl/kl", "rl/pg_loss", "rl/entropy", "opt/grad_norm"):
      np.testing.assert_allclose(m_b[key], m_a[key], rtol=1e-5, atol=1e-6, err_msg=key)
  # Two SGD steps: params - init = -0.5 * (g1 + g2). Compare those updates, per leaf, relative
  # to the leaf's largest update (float32 sums in a different order across shards).
  leaves = zip(
    jax.tree.leaves(params), jax.tree.leaves(s1.params), jax.tree.leaves(s8.params), strict=True
  )
  for p0, a, b in leaves:
    da, db = np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0)
    np.testing.assert_allclose(db, da, rtol=0, atol=1e-5 * np.abs(da).max())


def test_sampler_on_sharded_params_matches_single_device():
  cfg = ModelConfig.tiny()
  graphdef, params = make_model(cfg, seed=5)
  rules = get_rules("fsdp_tp")
  toks, mask = left_pad([[1, 7, 8, 9], [1, 20], [1, 30, 31, 32, 33, 34]] * 4, 8, 0)
  keys = row_keys(jax.random.key(0), np.arange(len(toks)))
  sample = make_sampler(
    graphdef,
    cfg,
    prompt_len=8,
    max_new_tokens=6,
    eos_id=2,
    pad_id=0,
    sampling=SamplingParams(temperature=0.8, top_k=20),
  )
  outs = []
  for mesh in (make_mesh(1, 1, 1, devices=jax.devices()[:1]), make_mesh(1, 4, 2)):
    p = shard_params(jax.tree.map(jnp.copy, params), mesh, rules)
    outs.append(jax.device_get(sample(p, toks, mask, keys)))
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-5)
