"""Dense presets: abstract parameter counts match the published checkpoint sizes."""

import math

import jax
import pytest
from flax import nnx

from jaxrl.models.config import PRESETS, ModelConfig, from_preset
from jaxrl.models.transformer import Transformer

# preset -> (published parameter count, whether that count includes a stored lm_head copy).
# Qwen3-1.7B ties its embeddings (config.json tie_word_embeddings=true), yet its safetensors hold
# a separate lm_head.weight, and the Hub's 2.03B counts it; the model card's "1.7B" does not.
PUBLISHED = {
  "qwen2p5_0p5b_instruct": (494.0e6, False),
  "qwen2p5_1p5b_instruct": (1.544e9, False),
  "qwen3_0p6b": (0.596e9, False),
  "qwen3_1p7b": (2.03e9, True),
  "qwen3_8b": (8.19e9, False),
  "llama3p2_1b": (1.236e9, False),
  "llama3p2_3b": (3.213e9, False),
}


def _count(cfg: ModelConfig) -> int:
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # shapes only, no memory
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _abstract_param_count(cfg: ModelConfig) -> int:
  # Blocks are identical, so the count is affine in L; tracing 2 layers instead of 36 keeps the
  # test fast. The test below checks this against a full trace.
  one, two = _count(cfg.replace(num_layers=1)), _count(cfg.replace(num_layers=2))
  return one + (cfg.num_layers - 1) * (two - one)


def test_layer_extrapolation_equals_full_count():
  cfg = ModelConfig.qwen2p5_0p5b_instruct()
  assert _abstract_param_count(cfg) == _count(cfg) == 494_032_768


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_published_size(name):
  cfg = from_preset(name)
  published, counts_stored_head = PUBLISHED[name]
  count = _abstract_param_count(cfg)
  if counts_stored_head:
    assert cfg.tie_embeddings
    count += cfg.vocab_size * cfg.embed_dim
  assert abs(count - published) <= 0.005 * published, (name, count, published)


def test_qwen3_1p7b_non_embedding_count_matches_model_card():
  # The model card: 1.4B non-embedding parameters; checks the layers independently of the head.
  cfg = ModelConfig.qwen3_1p7b()
  non_embedding = _abstract_param_count(cfg) - cfg.vocab_size * cfg.embed_dim
  assert abs(non_embedding - 1.4e9) <= 0.05 * 1.4e9  # the card rounds to one decimal


@pytest.mark.parametrize(
  "name, tied, qkv_bias, qk_norm",
  [
    ("qwen2p5_0p5b_instruct", True, True, False),
    ("qwen2p5_1p5b_instruct", True, True, False),
    ("qwen3_1p7b", True, False, True),
    ("qwen3_8b", False, False, True),
    ("llama3p2_3b", True, False, False),
  ],
)
def test_dense_preset_flags(name, tied, qkv_bias, qk_norm):
  cfg = PRESETS[name]()
  assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (tied, qkv_bias, qk_norm)
  # bfloat16 compute over float32 master weights: the optimizer's updates are not rounded away.
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")


def test_llama3p2_3b_rope_scaling_matches_1b():
  assert ModelConfig.llama3p2_3b().rope_scaling == ModelConfig.llama3p2_1b().rope_scaling
  scaling = ModelConfig.llama3p2_3b().rope_scaling
  assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == (32.0, 1.0, 4.0)
  assert scaling.original_max_position == 8192


def test_arith_small_moe_is_arith_small_with_experts_in_the_mlp():
  dense, moe = ModelConfig.arith_small(), ModelConfig.arith_small_moe()
  assert moe.replace(num_experts=0, experts_per_token=0, moe_mlp_dim=0) == dense
  layers, d, e, f = dense.num_layers, dense.embed_dim, moe.num_experts, moe.moe_mlp_dim
  # Each layer's dense MLP (gate, up, down) is replaced by a router and e experts of width f.
  want = (
    _abstract_param_count(dense) - layers * 3 * d * dense.mlp_dim + layers * (d * e + e * 3 * d * f)
  )
  assert _abstract_param_count(moe) == want
  assert moe.experts_per_token * f == dense.mlp_dim // 2  # half the active MLP width per token
