"""Layer tests: RoPE scaling, sliding windows, soft-caps, Gemma norms vs HF; biases; validation."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxrl.models import ModelConfig
from jaxrl.models.config import RopeScaling
from jaxrl.models.layers import (
  RMSNorm,
  apply_rope,
  attention_mask,
  dot_attention,
  rope_inv_freq,
  softcap,
)
from jaxrl.models.transformer import Transformer


@pytest.mark.parametrize("head_dim, theta, original", [(8, 500.0, 16), (64, 500_000.0, 8192)])
def test_llama3_inv_freq_matches_hf(head_dim, theta, original):
  scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, original)
  hf_cfg = transformers.LlamaConfig(
    hidden_size=head_dim * 4,
    num_attention_heads=4,
    head_dim=head_dim,
    rope_parameters=dict(
      rope_type="llama3",
      rope_theta=theta,
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=original,
    ),
  )
  ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
  ours = np.asarray(rope_inv_freq(head_dim, theta, scaling))
  np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)
  # All three bands occur in the first case, so the comparison covers every branch.
  plain = np.asarray(rope_inv_freq(head_dim, theta))
  assert not np.allclose(ours, plain)


def test_rope_without_scaling_is_the_default_path():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
  pos = jax.numpy.tile(jax.numpy.arange(5), (2, 1))
  np.testing.assert_array_equal(apply_rope(x, pos, 100.0), apply_rope(x, pos, 100.0, None))


def _abstract_params(cfg):
  """Flat {path: Param} of shapes only: no init program to compile."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return dict(nnx.to_flat_state(nnx.state(model)))


def test_qkv_bias_params_have_shapes_and_axes():
  cfg = ModelConfig.tiny().replace(qkv_bias=True)
  flat = _abstract_params(cfg)
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  for name, shape, axes in [
    ("q_bias", (n, h), ("q_heads", "head_dim")),
    ("k_bias", (k, h), ("kv_heads", "head_dim")),
    ("v_bias", (k, h), ("kv_heads", "head_dim")),
  ]:
    var = flat[("layers", 1, "attn", name)]
    assert var.get_value().shape == shape and var.get_metadata()["axes"] == axes
  off = _abstract_params(ModelConfig.tiny())
  assert not any("bias" in str(path) for path in off)


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(kind="yarn"), "rope_scaling.kind"),
    (dict(factor=0.0), "rope_scaling.factor"),
    (dict(low_freq_factor=4.0, high_freq_factor=1.0), "low_freq_factor < high_freq_factor"),
    (dict(original_max_position=0), "rope_scaling.original_max_position"),
  ],
)
def test_bad_rope_scaling_names_field(kw, field):
  with pytest.raises(ValueError, match=field):
    RopeScaling(**kw)


def test_rope_scaling_must_be_the_dataclass():
  with pytest.raises(ValueError, match="model.rope_scaling"):
    ModelConfig.tiny().replace(rope_scaling={"rope_type": "llama3"})


def test_linear_rope_inv_freq_matches_hf():
  hf_cfg = transformers.LlamaConfig(
    hidden_size=56,
    num_attention_heads=4,
    head_dim=14,
    rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=8.0),
  )
  ref, _ = ROPE_INIT_FUNCTIONS["linear"](hf_cfg, torch.device("cpu"))
  ours = np.asarray(rope_inv_freq(14, 1000.0, RopeScaling("linear", factor=8.0)))
  np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("window, offset", [(None, 0), (3, 0), (3, 4), (1, 2)])
def test_sliding_window_mask_matches_hf_mask_function(window, offset):
  from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

  kv_valid = np.ones((2, 9), bool)
  kv_valid[1, :2] = False  # left padding
  t = 9 - offset  # the queries are the last t slots (offset > 0: a cache that is already filled)
  ours = np.asarray(attention_mask(jnp.asarray(kv_valid), t, offset, window))
  fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
  for b in range(2):
    for q in range(t):
      for s in range(9):
        want = bool(fn(b, 0, torch.tensor(offset + q), torch.tensor(s))) and kv_valid[b, s]
        assert ours[b, q, s] == want, (window, offset, b, q, s)


def test_dot_attention_with_scale_and_softcap_matches_hf_eager():
  from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

  b, t, n, k, h = 2, 7, 6, 2, 14
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, n, h)) * 3.0  # large scores, so the cap bites
  kk = jax.random.normal(keys[1], (b, t, k, h)) * 3.0
  v = jax.random.normal(keys[2], (b, t, k, h))
  valid = jnp.ones((b, t), bool).at[1, :2].set(False)
  mask = attention_mask(valid, t, 0, 3)
  ours = dot_attention(q, kk, v, mask, scale=20.0**-0.5, logit_cap=2.0)
  module = types.SimpleNamespace(head_dim=h, num_key_value_groups=n // k, training=False)

  def torch_bhtd(x):  # HF attention takes [B, heads, T, H]
    return torch.from_numpy(np.array(x)).transpose(1, 2)

  additive = torch.from_numpy(np.where(np.asarray(mask), 0.0, -1e30).astype(np.float32))[:, None]
  ref, _ = eager_attention_forward(
    module, torch_bhtd(q), torch_bhtd(kk), torch_bhtd(v), additive, scaling=20.0**-0.5, softcap=2.0
  )
  valid_q = np.asarray(valid)  # padded queries see nothing; their outputs are arbitrary
  np.testing.assert_allclose(np.asarray(ours)[valid_q], ref.numpy()[valid_q], atol=1e-5, rtol=0)
  uncapped = dot_attention(q, kk, v, mask, scale=20.0**-0.5)
  assert np.abs(np.asarray(uncapped - ours)[valid_q]).max() > 1e-2


def test_zero_centered_rmsnorm_matches_hf_gemma3():
  from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

  x = jax.random.normal(jax.random.key(1), (2, 5, 11))
  w = 0.3 * jax.random.normal(jax.random.key(2), (11,))
  norm = RMSNorm(11, 1e-6, zero_centered=True)
  np.testing.assert_array_equal(norm.scale[...], 0.0)  # identity scale at init, as in HF
  norm.scale[...] = w
  ref = Gemma3RMSNorm(11, eps=1e-6)
  with torch.no_grad():
    ref.weight.copy_(torch.from_numpy(np.array(w)))
    want = ref(torch.from_numpy(np.array(x))).numpy()
  np.testing.assert_allclose(np.asarray(norm(x)), want, atol=1e-6, rtol=0)


def test_softcap_is_cap_times_tanh():
  x = jnp.array([-100.0, -1.0, 0.0, 0.5, 30.0])
  np.testing.assert_allclose(softcap(x, 5.0), 5.0 * np.tanh(np.asarray(x) / 5.0), rtol=1e-6)
  assert softcap(x, None) is x
