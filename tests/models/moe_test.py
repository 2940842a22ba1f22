"""MoE tests: ragged_dot dispatch vs a dense reference, routing, aux loss, capture, presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import apply, decode_through_cache, perturbed_model
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from jaxrl.models import ModelConfig
from jaxrl.models.config import PRESETS
from jaxrl.models.moe import load_balancing_loss, moe_dense_reference, moe_dispatch, route
from jaxrl.models.transformer import Transformer, positions_from_mask
from jaxrl.models.transformer import apply_with_routing as _apply_with_routing

pytestmark = pytest.mark.integration

apply_with_routing = jax.jit(_apply_with_routing, static_argnums=0)


def _moe_cfg(**kw):
  return ModelConfig.tiny().replace(
    num_experts=5, experts_per_token=2, moe_mlp_dim=22, rope_theta=1000.0, **kw
  )


def _experts(rng, e, d, f):
  gate, up = (0.3 * rng.standard_normal((e, d, f)).astype(np.float32) for _ in range(2))
  down = 0.3 * rng.standard_normal((e, f, d)).astype(np.float32)
  return gate, up, down


@pytest.mark.parametrize(
  "e, k, renormalize, starved",
  [(5, 2, True, 3), (7, 3, False, 0), (3, 1, True, None)],
)
def test_ragged_dispatch_matches_dense_reference(e, k, renormalize, starved):
  rng = np.random.default_rng(e)
  b, t, d, f = 3, 7, 13, 11
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  logits = rng.standard_normal((b, t, e)).astype(np.float32)
  if starved is not None:
    logits[..., starved] = -30.0  # this expert is in no token's top k: an empty ragged group
  weights, experts = route(jnp.asarray(logits), k, renormalize)
  if starved is not None:
    assert not np.any(np.asarray(experts) == starved)
  gate, up, down = _experts(rng, e, d, f)
  dispatch = jax.jit(moe_dispatch)
  ours = dispatch(x, weights, experts, gate, up, down)
  ref = moe_dense_reference(x, weights, experts, gate, up, down)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5, rtol=0)

  # The gradients training needs agree too (ragged_dot's transpose rules vs plain einsums).
  def loss(fn, *args):
    return jnp.sum(jnp.sin(fn(*args)))

  args = (jnp.asarray(x), weights, experts, gate, up, down)
  grads = jax.jit(jax.grad(lambda *a: loss(moe_dispatch, *a), argnums=(0, 1, 3, 4, 5)))(*args)
  ref_grads = jax.grad(lambda *a: loss(moe_dense_reference, *a), argnums=(0, 1, 3, 4, 5))(*args)
  for g, rg in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(rg), atol=1e-4, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_numpy(renormalize):
  logits = np.random.default_rng(0).standard_normal((4, 6, 7)).astype(np.float32)
  weights, experts = route(jnp.asarray(logits), 3, renormalize)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want_experts = np.argsort(-p, axis=-1)[..., :3]
  want = np.take_along_axis(p, want_experts, axis=-1)
  if renormalize:
    want = want / want.sum(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(experts), want_experts)
  np.testing.assert_allclose(np.asarray(weights), want, atol=1e-6, rtol=0)


def _np_aux_loss(router_logits, top_k, valid):
  """E * sum_e f_e P_e over unpadded tokens of every layer, written out with loops."""
  num_layers, b, t, e = router_logits.shape
  counts, prob_sum, rows = np.zeros(e), np.zeros(e), 0
  for layer in range(num_layers):
    for i in range(b):
      for j in range(t):
        if not valid[i, j]:
          continue
        z = router_logits[layer, i, j].astype(np.float64)
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        counts[np.argsort(-p)[:top_k]] += 1
        prob_sum += p
        rows += 1
  return e * np.sum(counts / rows * prob_sum / rows)


def test_load_balancing_loss_matches_numpy_and_hf():
  rng = np.random.default_rng(1)
  router_logits = rng.standard_normal((3, 2, 5, 7)).astype(np.float32)  # [L, B, T, E]
  valid = np.ones((2, 5), bool)
  valid[1, :2] = False
  for mask in (None, valid):
    ours = float(load_balancing_loss(jnp.asarray(router_logits), 2, mask))
    want = _np_aux_loss(router_logits, 2, np.ones_like(valid) if mask is None else mask)
    np.testing.assert_allclose(ours, want, rtol=1e-5)
    hf = load_balancing_loss_func(
      tuple(torch.from_numpy(x.reshape(-1, 7)) for x in router_logits),
      num_experts=7,
      top_k=2,
      attention_mask=None if mask is None else torch.from_numpy(mask).long(),
    )
    np.testing.assert_allclose(ours, float(hf), rtol=1e-5)


def test_moe_model_cached_decoding_equals_full_forward():
  cfg = _moe_cfg()
  graphdef, params = perturbed_model(cfg)
  b, t, p = 2, 9, 5
  tokens = jax.random.randint(jax.random.key(3), (b, t), 3, cfg.vocab_size)
  valid = jnp.ones((b, t), bool).at[1, :3].set(False)
  full, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  cached = decode_through_cache(graphdef, params, cfg, tokens, valid, p)
  np.testing.assert_allclose(np.asarray(cached)[valid], np.asarray(full)[valid], atol=1e-5)


def test_apply_with_routing_returns_each_layers_top_k():
  cfg = _moe_cfg(norm_topk_prob=False)
  graphdef, params = perturbed_model(cfg)
  tokens = jax.random.randint(jax.random.key(0), (2, 6), 3, cfg.vocab_size)
  valid = jnp.ones((2, 6), bool)
  pos = positions_from_mask(valid)
  logits, _, routing = apply_with_routing(graphdef, params, tokens, pos, valid)
  plain, _ = apply(graphdef, params, tokens, pos, valid)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))
  experts, router_logits = np.asarray(routing["experts"]), np.asarray(routing["router_logits"])
  assert experts.shape == (cfg.num_layers, 2, 6, 2) and experts.dtype == np.int32
  assert router_logits.shape == (cfg.num_layers, 2, 6, 5)
  np.testing.assert_array_equal(experts, np.argsort(-router_logits, axis=-1)[..., :2])

  @jax.jit
  def layer0_router_logits(params):
    # Layer 0's router sees the embedded tokens through the first half of block 0.
    model = nnx.merge(graphdef, params)
    block = model.layers[0]
    x = model.embed[...][tokens]
    x = x + block.attn(block.attn_norm(x), pos, valid)[0]
    return jnp.einsum("BTD,DE->BTE", block.mlp_norm(x), block.mlp.router[...])

  np.testing.assert_allclose(router_logits[0], np.asarray(layer0_router_logits(params)), atol=1e-5)
  # A dense model has nothing to report (shapes only: no need to build it).
  dense = nnx.eval_shape(lambda: Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0)))
  dense_graphdef, dense_params = nnx.split(dense)
  out = jax.eval_shape(
    lambda p: _apply_with_routing(dense_graphdef, p, tokens, pos, valid), dense_params
  )
  assert out[2] is None


@pytest.mark.parametrize("preset, total", [("qwen3_30b_a3b", 30.5e9), ("mixtral_8x7b", 46.7e9)])
def test_preset_parameter_count_matches_published(preset, total):
  cfg = PRESETS[preset]()
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert abs(count - total) / total < 0.01, count
  layer = nnx.state(abstract.layers[0].mlp, nnx.Param)
  assert layer["gate"].shape == (cfg.num_experts, cfg.embed_dim, cfg.moe_mlp_dim)
  assert layer["down"].shape == (cfg.num_experts, cfg.moe_mlp_dim, cfg.embed_dim)


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(num_experts=-1), "num_experts"),
    (dict(num_experts=4, experts_per_token=0, moe_mlp_dim=8), "experts_per_token"),
    (dict(num_experts=4, experts_per_token=5, moe_mlp_dim=8), "experts_per_token"),
    (dict(num_experts=4, experts_per_token=2, moe_mlp_dim=0), "moe_mlp_dim"),
    (dict(experts_per_token=2), "experts_per_token=2 needs model.num_experts"),
  ],
)
def test_bad_moe_config_names_field(kw, field):
  with pytest.raises(ValueError, match=field):
    ModelConfig.tiny().replace(**kw)
