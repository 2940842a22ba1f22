"""Routing replay (R3) in the model: forced experts, live gate weights, router gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import numpy_model

from jaxrl.models import ModelConfig
from jaxrl.models.moe import replay_route, route
from jaxrl.models.transformer import apply, apply_with_routing, positions_from_mask

pytestmark = pytest.mark.integration

_apply = jax.jit(apply, static_argnums=0)
_apply_with_routing = jax.jit(apply_with_routing, static_argnums=0)


def _cfg(**kw):
  return ModelConfig.tiny().replace(num_experts=5, experts_per_token=2, moe_mlp_dim=22, **kw)


def test_replay_route_gate_is_the_live_softmax_over_the_forced_experts():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((3, 4, 6)).astype(np.float32)
  forced = np.stack([rng.permutation(6)[:2] for _ in range(12)]).reshape(3, 4, 2)
  forced[0, 0] = -1  # not recorded: the token keeps its own routing
  w, e = replay_route(jnp.asarray(logits), jnp.asarray(forced), 2, True)
  w, e = np.asarray(w), np.asarray(e)
  own_w, own_e = (np.asarray(a) for a in route(jnp.asarray(logits), 2, True))
  np.testing.assert_array_equal(e[0, 0], own_e[0, 0])
  np.testing.assert_allclose(w[0, 0], own_w[0, 0], rtol=1e-6)
  for b, t in np.ndindex(3, 4):
    if (b, t) == (0, 0):
      continue
    np.testing.assert_array_equal(e[b, t], forced[b, t])
    s = logits[b, t, forced[b, t]].astype(np.float64)  # g_i = exp(s_i) / sum_j exp(s_j) over I
    np.testing.assert_allclose(w[b, t], np.exp(s) / np.exp(s).sum(), rtol=1e-5)
  # Without renormalisation (Qwen3-MoE's norm_topk_prob=False) the gate is the full softmax's
  # probability of each forced expert, as the model's own routing weights it.
  w2, _ = replay_route(jnp.asarray(logits), jnp.asarray(forced), 2, False)
  p = np.exp(logits.astype(np.float64))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(w2)[1, 2], p[1, 2, forced[1, 2]], rtol=1e-5)


@pytest.mark.parametrize("scan, renorm", [(False, True), (True, False)])
def test_replaying_the_models_own_routes_equals_the_normal_forward(scan, renorm):
  cfg = _cfg(scan_layers=scan, norm_topk_prob=renorm)
  graphdef, params = numpy_model(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 3, cfg.vocab_size)
  valid = jnp.ones((2, 7), bool).at[0, :2].set(False)
  pos = positions_from_mask(valid)
  plain, _, routing = _apply_with_routing(graphdef, params, tokens, pos, valid)
  own = jnp.moveaxis(routing["experts"], 0, 2)  # [L, B, T, k] -> [B, T, L, k]
  replayed, _ = _apply(graphdef, params, tokens, pos, valid, routes=own)
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(plain), atol=1e-6, rtol=0)
  unrecorded, _ = _apply(graphdef, params, tokens, pos, valid, routes=jnp.full_like(own, -1))
  np.testing.assert_allclose(np.asarray(unrecorded), np.asarray(plain), atol=1e-6, rtol=0)
  # Other experts give another output, and the router's own choice is still what is reported.
  other = (own + 1) % cfg.num_experts
  moved, _, routing2 = _apply_with_routing(graphdef, params, tokens, pos, valid, routes=other)
  assert np.max(np.abs(np.asarray(moved) - np.asarray(plain))) > 1e-3
  np.testing.assert_array_equal(
    np.asarray(routing2["experts"])[0], np.asarray(routing["experts"])[0]
  )  # layer 0's router sees the same input either way


def test_router_gets_gradients_under_replay():
  cfg = _cfg()
  graphdef, params = numpy_model(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 6), 3, cfg.vocab_size)
  valid = jnp.ones((2, 6), bool)
  pos = positions_from_mask(valid)
  _, _, routing = _apply_with_routing(graphdef, params, tokens, pos, valid)
  forced = (jnp.moveaxis(routing["experts"], 0, 2) + 2) % cfg.num_experts

  def loss(p):
    logits, _ = apply(graphdef, p, tokens, pos, valid, routes=forced)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 5])

  grads = jax.jit(jax.grad(loss))(params)
  for layer in range(cfg.num_layers):
    g = np.asarray(grads["layers"][layer]["mlp"]["router"][...])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-4, layer


def test_routes_on_a_dense_model_are_an_error():
  cfg = ModelConfig.tiny()
  graphdef, params = numpy_model(cfg)
  tokens = jnp.zeros((1, 3), jnp.int32)
  valid = jnp.ones((1, 3), bool)
  with pytest.raises(ValueError, match="needs an MoE model"):
    apply(
      graphdef, params, tokens, positions_from_mask(valid), valid, routes=jnp.zeros((1, 3, 2, 1))
    )
