"""Token sampling: temperature, top-k, top-p, with per-row RNG keys and behaviour log-probs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn. temperature=0 means greedy; top_k=0 and top_p=1 switch filters off."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def logprob_temperature(self) -> float:
    """The temperature of the policy whose log-probs are reported (1 for greedy decoding)."""
    return self.temperature if self.temperature > 0 else 1.0


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Mask logits [B, V] outside the top-k set and outside the top-p nucleus to -inf."""
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, _NEG_INF, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass strictly before it is < top_p: the smallest set reaching top_p.
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, _NEG_INF, logits)
  return logits


def sample_tokens(logits: jax.Array, keys: jax.Array, params: SamplingParams):
  """Draw one token per row. logits: [B, V] float32; keys: [B] typed PRNG keys.

  Returns (tokens [B] int32, logprobs [B] float32). The log-prob is that of the drawn token under
  the full tempered distribution softmax(logits / T) — the distribution the learner scores —
  not under the top-k/top-p truncation (the same convention as verl/TRL).
  """
  logits = logits.astype(jnp.float32)
  scaled = logits / params.logprob_temperature
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  if params.temperature == 0:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    tokens = jax.vmap(jax.random.categorical)(keys, filtered)
  tokens = tokens.astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
