"""The v0 static sampler, kept as a reference for tests and benchmarks: not a rollout path.

Training samples only through the engine (jaxrl.rollout.collect.GroupSampler). This is the
simplest correct sampler of the same model: one jitted call does prefill and the whole decode
loop over a contiguous KV cache, prompts left-padded to one bucket so every row writes the same
cache column at each step, stopping on one EOS id. Tests compare the engine's greedy tokens and
log-probs against it; the decode benchmark reports it beside the engine and its peers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import apply, init_cache, positions_from_mask
from jaxrl.rollout.sampling import SamplingParams, sample_tokens
from jaxrl.rollout.types import LENGTH, STOP, Rollout


def row_keys(seed_key: jax.Array, ids) -> jax.Array:
  """One PRNG key per sequence, derived from (seed key, sequence id): sampling then does not
  depend on which row or batch a sequence lands in."""
  return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(jnp.asarray(ids, jnp.uint32))


def make_sampler(
  graphdef,
  cfg: ModelConfig,
  *,
  prompt_len: int,
  max_new_tokens: int,
  eos_id: int,
  pad_id: int,
  sampling: SamplingParams,
):
  """Jitted `sample(params, prompt_tokens [B, P], prompt_mask [B, P], keys [B]) -> Rollout`."""
  if prompt_len <= 0 or max_new_tokens <= 0:
    raise ValueError(
      f"prompt_len ({prompt_len}) and max_new_tokens ({max_new_tokens}) must be positive"
    )
  if prompt_len + max_new_tokens > cfg.max_seq_len:
    raise ValueError(
      f"prompt_len + max_new_tokens = {prompt_len} + {max_new_tokens} exceeds the model's "
      f"max_seq_len = {cfg.max_seq_len}"
    )
  p, n = prompt_len, max_new_tokens

  def step_keys(keys, i):
    return jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)

  def sample(params, prompt_tokens, prompt_mask, keys, version=0) -> Rollout:
    b = prompt_tokens.shape[0]
    cache = init_cache(cfg, b, p + n)
    kv_valid = jnp.concatenate([prompt_mask, jnp.zeros((b, n), bool)], axis=1)
    last = jnp.full((b,), p - 1, jnp.int32)
    logits, cache = apply(
      graphdef,
      params,
      prompt_tokens,
      positions_from_mask(prompt_mask),
      kv_valid,
      cache=cache,
      cache_index=0,
      logits_at=last,
    )
    prompt_lens = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
    tok, lp = sample_tokens(logits, step_keys(keys, 0), sampling)
    out_tokens = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(tok)
    out_logp = jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp)
    done = tok == eos_id

    def cond(carry):
      i, _, _, _, _, done, _ = carry
      return (i < n - 1) & ~jnp.all(done)

    def body(carry):
      # Token i (already sampled) is fed at cache column p + i; it produces token i + 1.
      i, tok, cache, kv_valid, out, done, logp = carry
      kv_valid = jax.lax.dynamic_update_slice_in_dim(kv_valid, jnp.ones((b, 1), bool), p + i, 1)
      logits, cache = apply(
        graphdef,
        params,
        tok[:, None],
        (prompt_lens + i)[:, None],
        kv_valid,
        cache=cache,
        cache_index=p + i,
        logits_at=jnp.zeros((b,), jnp.int32),
      )
      nxt, lp = sample_tokens(logits, step_keys(keys, i + 1), sampling)
      nxt = jnp.where(done, pad_id, nxt)
      lp = jnp.where(done, 0.0, lp)
      out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i + 1, 1)
      logp = jax.lax.dynamic_update_slice_in_dim(logp, lp[:, None], i + 1, 1)
      return i + 1, nxt, cache, kv_valid, out, done | (nxt == eos_id), logp

    carry = (jnp.int32(0), tok, cache, kv_valid, out_tokens, done, out_logp)
    _, _, _, _, out_tokens, done, out_logp = jax.lax.while_loop(cond, body, carry)

    is_eos = out_tokens == eos_id
    # Valid up to and including the first EOS: no EOS strictly before this column.
    eos_before = jnp.cumsum(is_eos, axis=1) - is_eos
    mask = eos_before == 0
    truncated = ~jnp.any(is_eos, axis=1)
    return Rollout(
      prompt_tokens=prompt_tokens,
      prompt_mask=prompt_mask,
      tokens=jnp.where(mask, out_tokens, pad_id),
      mask=mask,
      logprobs=jnp.where(mask, out_logp, 0.0),
      versions=jnp.where(mask, jnp.asarray(version, jnp.int32), -1),
      lengths=jnp.sum(mask, axis=1, dtype=jnp.int32),
      truncated=truncated,
      finish_reason=jnp.where(truncated, LENGTH, STOP).astype(jnp.int32),
    )

  return jax.jit(sample)
