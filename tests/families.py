"""Tiny configs of every supported model family, with random params, for the parity tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import ModelConfig, RopeScaling, Transformer
from jaxrl.models.transformer import apply
from jaxrl.models.transformer import token_logprobs as _token_logprobs

VOCAB = 67
REF_LEN = 24  # the one [1, S] shape of the no-cache references: one compile per family

# Jitted with the graphdef static; `temperature` stays traced.
token_logprobs = jax.jit(_token_logprobs, static_argnums=0)

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
  """(cfg, graphdef, params) of a family, weights drawn in numpy (jax.random init compiles a
  kernel per leaf shape). Larger than at init so outputs are far from uniform; norm scales
  (zero-centred ones around 0) and q/k/v biases are perturbed, so a misplaced one shows."""
  cfg = family_config(name)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(sorted(FAMILIES).index(name))

  def draw(path, leaf):
    z = rng.normal(size=leaf.shape)
    if "'scale'" in jax.tree_util.keystr(path):
      return jnp.asarray((0.0 if cfg.zero_centered_norms else 1.0) + 0.1 * z, leaf.dtype)
    return jnp.asarray(0.15 * z, leaf.dtype)

  return cfg, graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


def family_prompts(name: str, lengths) -> list[list[int]]:
  """Random prompts of the given lengths (ids >= 3), the same for a family on every call."""
  rng = np.random.default_rng(100 + sorted(FAMILIES).index(name))
  return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def right_padded(seqs) -> tuple[np.ndarray, np.ndarray]:
  """Sequences laid out in [B, REF_LEN] rows from column 0: (tokens int32, valid bool)."""
  tokens = np.zeros((len(seqs), REF_LEN), np.int32)
  for b, seq in enumerate(seqs):
    tokens[b, : len(seq)] = seq
  return tokens, np.arange(REF_LEN)[None] < np.array([len(s) for s in seqs])[:, None]


@functools.partial(jax.jit, static_argnums=0)
def greedy_rows(graphdef, params, tokens, lengths, n):
  """n argmax steps, each a full forward over the whole [B, S] row (no cache); the filler
  columns are in the causal future of every position read. Returns (tokens, min top-2 gap [B])."""
  b, s = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(s), (b, s))

  def step(i, carry):
    tokens, gap = carry
    length = lengths + i
    logits, _ = apply(graphdef, params, tokens, positions, jnp.arange(s)[None] < length[:, None])
    last = jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    top2 = jax.lax.top_k(last, 2)[0]
    tokens = tokens.at[jnp.arange(b), length].set(jnp.argmax(last, axis=-1).astype(tokens.dtype))
    return tokens, jnp.minimum(gap, top2[:, 0] - top2[:, 1])

  return jax.lax.fori_loop(0, n, step, (tokens, jnp.full((b,), jnp.inf)))


def greedy_reference(name: str, prompt_list, n: int) -> tuple[np.ndarray, float]:
  """Argmax decoding of each unpadded prompt by repeated full forwards: (tokens [B, n], the
  smallest top-1 vs top-2 logit gap met, so callers can refuse a near tie)."""
  _, graphdef, params = family_model(name)
  if max(len(p) for p in prompt_list) + n > REF_LEN:
    raise ValueError(f"prompt + {n} tokens exceed REF_LEN={REF_LEN}")
  tokens, _ = right_padded(prompt_list)
  lengths = np.array([len(p) for p in prompt_list], np.int32)
  out, gap = greedy_rows(graphdef, params, tokens, lengths, np.int32(n))
  out = np.asarray(out)
  completions = np.stack([out[b, k : k + n] for b, k in enumerate(lengths)])
  return completions, float(np.min(gap))


def learner_logprobs(name: str, tokens, valid, temperature: float = 1.0) -> np.ndarray:
  """The learner's `token_logprobs` [B, REF_LEN] of rows padded to REF_LEN columns."""
  _, graphdef, params = family_model(name)
  if tokens.shape[1] != REF_LEN:
    raise ValueError(f"rows have {tokens.shape[1]} columns; pad them to REF_LEN={REF_LEN}")
  return np.asarray(token_logprobs(graphdef, params, tokens, valid, temperature=temperature))
