"""Mixed precision: float32 master weights with bfloat16 compute train at RL learning rates, as
float32 does and bfloat16 storage does not; the compute-dtype view the sampler reads gives the
masters' forward bit for bit; the mixed path's loss and gradient stay within stated bounds of the
float32 path's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import graphdef_of, numpy_model

from jaxrl.models import ModelConfig
from jaxrl.models.precision import ComputeCast
from jaxrl.models.transformer import apply, positions_from_mask
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.objectives import PolicyLoss
from jaxrl.rl.train_step import init_state, make_optimizer, make_train_step

pytestmark = pytest.mark.integration


def _adamw_1e6():
  return make_optimizer(learning_rate=1e-6, warmup_steps=0, total_steps=10, schedule="constant")


def test_adamw_at_1e6_moves_float32_masters_and_not_bfloat16_storage():
  """The measurement behind float32 masters: 10 AdamW steps at lr 1e-6 on a 256 x 256 weight
  drawn N(0, 0.02). bfloat16 spaces a weight of 0.02 about 1.2e-4 from its neighbours, so an
  update of ~1e-6 rounds to nothing; float32 moves every weight."""
  w = jax.random.normal(jax.random.key(0), (256, 256)) * 0.02
  opt = _adamw_1e6()

  def changed(dtype) -> float:
    params = {"w": w.astype(dtype)}
    state = opt.init(params)
    p = params
    for i in range(10):
      g = {"w": jax.random.normal(jax.random.key(i + 1), (256, 256), jnp.float32)}
      updates, state = opt.update(g, state, p)
      p = jax.tree.map(lambda a, u: (a + u).astype(a.dtype), p, updates)
    return float(jnp.mean(p["w"] != params["w"]))

  assert changed(jnp.float32) > 0.999
  assert changed(jnp.bfloat16) < 0.05  # the failure mode masters exist for (1.8% measured)


def _batch(cfg: ModelConfig, rows: int = 8, length: int = 24, seed: int = 0) -> TrainBatch:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
  valid = np.ones((rows, length), bool)
  valid[: rows // 2, :3] = False  # left padding on half the rows
  mask = np.zeros((rows, length), np.float32)
  mask[:, length // 2 :] = 1.0
  adv = np.repeat(rng.normal(size=(rows, 1)), length, axis=1).astype(np.float32) * mask
  old = (rng.normal(size=(rows, length)) * 0.1 - 5.0).astype(np.float32) * mask
  z = np.zeros((rows, length), np.float32)
  return TrainBatch(
    tokens=jnp.asarray(tokens),
    valid=jnp.asarray(valid),
    loss_mask=jnp.asarray(mask),
    advantages=jnp.asarray(adv),
    old_logprobs=jnp.asarray(old),
    ref_logprobs=jnp.asarray(z),
    versions=jnp.zeros((rows, length), jnp.int32),
  )


def _model(dtype: str, param_dtype: str):
  cfg = ModelConfig.tiny().replace(dtype=dtype, param_dtype=param_dtype)
  graphdef, params = numpy_model(cfg)
  # Init-sized weights (numpy_model's are 0.15: far from the magnitudes the issue is about).
  params = jax.tree.map(lambda x: (x * 0.02 / 0.15).astype(x.dtype) if x.ndim >= 2 else x, params)
  return cfg, graphdef, params


def _train(dtype: str, param_dtype: str, steps: int = 10):
  cfg, graphdef, params = _model(dtype, param_dtype)
  opt = _adamw_1e6()
  step = make_train_step(opt, PolicyLoss(graphdef), donate=False)
  state = init_state(params, opt)
  for i in range(steps):
    state, _ = step(state, _batch(cfg, seed=i))
  return params, state.params


def _matrices(params):
  return [x for x in jax.tree.leaves(params) if x.ndim >= 2]


def test_bfloat16_compute_over_float32_masters_trains_like_float32_at_lr_1e6():
  """A GRPO (PPO-clip) update of the tiny model, 10 steps at lr 1e-6: with float32 masters and
  bfloat16 compute every weight moves, in the direction float32 compute moves it; with bfloat16
  storage almost none does."""
  start, f32 = _train("float32", "float32")
  start_mixed, mixed = _train("bfloat16", "float32")
  start_bf16, bf16 = _train("bfloat16", "bfloat16")
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(mixed))  # masters stay float32

  def moved(new, old) -> float:
    pairs = zip(_matrices(new), _matrices(old), strict=True)
    return sum(int(jnp.sum(a != b)) for a, b in pairs) / sum(x.size for x in _matrices(old))

  assert moved(f32, start) > 0.99
  assert moved(mixed, start_mixed) > 0.99
  assert moved(bf16, start_bf16) < 0.05  # 1.8% measured: bfloat16 storage rounds updates away
  delta = lambda p: jnp.concatenate(  # noqa: E731
    [(a - b).ravel() for a, b in zip(_matrices(p), _matrices(start), strict=True)]
  )
  d32, dmix = delta(f32), delta(mixed)
  cos = float(jnp.dot(d32, dmix) / (jnp.linalg.norm(d32) * jnp.linalg.norm(dmix)))
  # Measured (AMD EPYC, AVX-512): cosine 0.9993, norm ratio 1.0001.
  assert cos > 0.99, cos
  ratio = float(jnp.linalg.norm(dmix) / jnp.linalg.norm(d32))
  assert 0.95 < ratio < 1.05, ratio


def test_mixed_loss_and_gradient_within_stated_bounds_of_float32():
  """The bounds docs/design.md states: on the tiny model the bfloat16-compute policy loss is
  within 0.5% of the float32 one and its gradient within 3% (relative L2 error), cosine > 0.999
  (measured: 0.03%, 0.84%, 0.99996)."""
  cfg32, graphdef32, params = _model("float32", "float32")
  graphdef_mix = graphdef_of(cfg32.replace(dtype="bfloat16"))
  batch = _batch(cfg32)

  def loss_and_grad(graphdef):
    loss = PolicyLoss(graphdef)
    f = jax.jit(jax.value_and_grad(lambda p: loss(p, batch)[0] / loss.denominator(batch)))
    return f(params)

  l32, g32 = loss_and_grad(graphdef32)
  lmix, gmix = loss_and_grad(graphdef_mix)
  flat32 = jnp.concatenate([x.ravel() for x in jax.tree.leaves(g32)])
  flatmix = jnp.concatenate([x.ravel() for x in jax.tree.leaves(gmix)])
  rel_loss = abs(float(lmix - l32)) / abs(float(l32))
  rel_grad = float(jnp.linalg.norm(flatmix - flat32) / jnp.linalg.norm(flat32))
  cos = float(jnp.dot(flat32, flatmix) / (jnp.linalg.norm(flat32) * jnp.linalg.norm(flatmix)))
  assert rel_loss < 0.005, rel_loss
  assert rel_grad < 0.03, rel_grad
  assert cos > 0.999, cos


def test_compute_view_is_the_masters_forward_bit_for_bit_in_half_the_bytes():
  cfg, graphdef, params = _model("bfloat16", "float32")
  cast = ComputeCast(cfg)
  assert cast.active
  view = cast.view(params)
  flat_p, flat_v = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(view))
  for path, var in flat_p.items():
    x, y = var.get_value(), flat_v[path].get_value()
    if x.ndim >= 2:
      assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    else:  # norms stay the learner's own float32 arrays: no copy
      assert y is x
  matrices = sum(x.size for x in _matrices(params))
  assert cast.last_bytes == 2 * matrices and cast.calls == 1
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 17)), jnp.int32)
  valid = jnp.ones(tokens.shape, bool)
  fwd = jax.jit(lambda p: apply(graphdef, p, tokens, positions_from_mask(valid), valid)[0])
  np.testing.assert_array_equal(np.asarray(fwd(params)), np.asarray(fwd(view)))
  cast.view(params)
  assert cast._cache_size() == 1 and cast.calls == 2  # one compiled cast, reused every step


def test_compute_view_copy_and_the_inactive_case():
  cfg, _, params = _model("bfloat16", "float32")
  cast = ComputeCast(cfg)
  copy = cast.copy(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy), strict=True):
    assert a is not b  # every leaf fresh: it outlives the learner's donated buffers
    np.testing.assert_array_equal(np.asarray(a.astype(b.dtype)), np.asarray(b))
  same = ComputeCast(cfg.replace(dtype="float32"))
  assert not same.active and same.view(params) is params and same.calls == 0


def test_bfloat16_storage_keeps_its_moments_dtype_and_one_program():
  """float32 gradients must not promote bfloat16 AdamW moments after the first update: the next
  step would compile again, and a resume would restore the moments in another dtype."""
  cfg, graphdef, params = _model("bfloat16", "bfloat16")
  opt = _adamw_1e6()
  step = make_train_step(opt, PolicyLoss(graphdef), donate=False)
  state = init_state(params, opt)
  before = [x.dtype for x in jax.tree.leaves(state.opt_state)]
  for i in range(3):
    state, _ = step(state, _batch(cfg, seed=i))
  assert [x.dtype for x in jax.tree.leaves(state.opt_state)] == before
  assert jnp.dtype(jnp.bfloat16) in before
  assert step._cache_size() == 1
