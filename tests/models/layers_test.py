"""Layer tests: Llama-3 RoPE scaling against HF, q/k/v biases, RopeScaling validation."""

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxrl.models import ModelConfig
from jaxrl.models.config import RopeScaling
from jaxrl.models.layers import apply_rope, rope_inv_freq
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
