"""Tiny configs of every supported model family, with random params, for the parity tests."""

import functools

import helpers
import numpy as np
from helpers import greedy_completions, numpy_model, token_logprobs

from jaxrl.models import ModelConfig, RopeScaling

VOCAB = 67
REF_LEN = 24  # the one [1, S] shape of the no-cache references: one compile per family

# Odd / prime sizes so a transposed axis shows; head_dim is even for RoPE.
_BASE = dict(
  vocab_size=VOCAB,
  num_layers=2,
  embed_dim=23,
  num_heads=6,
  num_kv_heads=2,
  head_dim=10,
  mlp_dim=37,
  rope_theta=1000.0,
  tie_embeddings=False,
  max_seq_len=64,
)

FAMILIES = {
  # Llama 3.2: llama3 RoPE scaling; original_max_position is small so that with head_dim 10
  # every frequency band (kept, smoothed, divided) occurs.
  "llama": dict(rope_theta=500.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
  "llama_mha": dict(num_heads=5, num_kv_heads=5, tie_embeddings=True),
  "qwen2": dict(num_kv_heads=3, qkv_bias=True, tie_embeddings=True),
  "qwen3": dict(qk_norm=True),
  # Window 5: shorter than the test sequences, and not a multiple of the engine's page size.
  "gemma3": dict(
    num_heads=3,
    num_kv_heads=1,
    qk_norm=True,
    tie_embeddings=True,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=5,
    rope_local_theta=50.0,
    query_pre_attn_scalar=20.0,
    mlp_activation="gelu_tanh",
    zero_centered_norms=True,
    post_norms=True,
    scale_embeddings=True,
    final_logit_softcap=5.0,
    attn_logit_softcap=3.0,
  ),
  "qwen3_moe": dict(
    qk_norm=True, num_experts=5, experts_per_token=2, moe_mlp_dim=13, norm_topk_prob=False
  ),
  "mixtral": dict(num_experts=5, experts_per_token=2, moe_mlp_dim=17, norm_topk_prob=True),
}


def family_config(name: str) -> ModelConfig:
  return ModelConfig(**{**_BASE, **FAMILIES[name]})


@functools.cache
def family_model(name: str):
  """(cfg, graphdef, params) of a family, weights drawn in numpy (`helpers.numpy_model`)."""
  cfg = family_config(name)
  return (cfg, *numpy_model(cfg, sorted(FAMILIES).index(name)))


def family_prompts(name: str, lengths) -> list[list[int]]:
  """Random prompts of the given lengths (ids >= 3), the same for a family on every call."""
  rng = np.random.default_rng(100 + sorted(FAMILIES).index(name))
  return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def right_padded(seqs) -> tuple[np.ndarray, np.ndarray]:
  """Sequences laid out in [B, REF_LEN] rows from column 0: (tokens int32, valid bool)."""
  return helpers.right_padded(seqs, REF_LEN)


def greedy_reference(name: str, prompt_list, n: int) -> tuple[np.ndarray, float]:
  """Argmax decoding of each unpadded prompt by repeated full forwards: (tokens [B, n], the
  smallest top-1 vs top-2 logit gap met, so callers can refuse a near tie)."""
  _, graphdef, params = family_model(name)
  return greedy_completions(graphdef, params, prompt_list, n, REF_LEN)


def learner_logprobs(name: str, tokens, valid, temperature: float = 1.0) -> np.ndarray:
  """The learner's `token_logprobs` [B, REF_LEN] of rows padded to REF_LEN columns."""
  _, graphdef, params = family_model(name)
  if tokens.shape[1] != REF_LEN:
    raise ValueError(f"rows have {tokens.shape[1]} columns; pad them to REF_LEN={REF_LEN}")
  return np.asarray(token_logprobs(graphdef, params, tokens, valid, temperature=temperature))
