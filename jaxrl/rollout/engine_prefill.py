"""The engine's prefill: one prompt (chunked past `prefill_chunk_size`) or many prompts in one
jitted call, each drawing the first token of every sample of its GRPO group.

`PrefillMixin` is a part of `jaxrl.rollout.engine.Engine`, kept in its own file: it reads the
engine's configuration (cfg, graphdef, seed, max_target_length, routes_shape, the chunk size and
the mesh shardings), its jitted `_prefill_jit` and its stats, all set by `Engine.__init__`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.transformer import apply, apply_with_routing, init_cache
from jaxrl.rollout.engine_types import (
  MAX_STOP_TOKENS,
  PrefillBatch,
  Prefix,
  ResultTokens,
  first_index_array,
  next_pow2,
  pack_result,
  per_sample,
  request_keys,
  step_keys,
  stop_array,
)
from jaxrl.rollout.kv_cache import pages_for
from jaxrl.rollout.sampling import RowSampling, SamplingParams, sample_rows

MIN_PREFILL_BUCKET = 8


class PrefillMixin:
  """Prefill and first-token sampling of `Engine` (see the module docstring)."""

  def prefill_bucket(self, length: int) -> int:
    """Padded length of a prompt (or last chunk) of `length` tokens: a power of two."""
    return min(max(next_pow2(length), MIN_PREFILL_BUCKET), self._chunk)

  def check_prompt(self, length: int, max_new_tokens: int) -> None:
    if length <= 0:
      raise ValueError("prompt is empty; it needs at least one token")
    if length > self._max_prefill:
      raise ValueError(
        f"prompt has {length} tokens, longer than the engine's max_prefill_length of "
        f"{self._max_prefill}"
      )
    if max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if length + max_new_tokens > self.max_target_length:
      raise ValueError(
        f"prompt of {length} tokens + max_new_tokens={max_new_tokens} exceeds the engine's "
        f"max_target_length of {self.max_target_length}"
      )

  def prefill(
    self,
    *,
    params,
    existing_prefix=None,
    padded_tokens,
    true_length,
    sampler=None,
    request_id=None,
    rng=None,
    max_new_tokens=None,
    stop_token_ids=(),
  ):
    """Prefill one chunk (the whole prompt if it fits) and draw one first token."""
    return self.prefill_multisampling(
      params=params,
      existing_prefix=existing_prefix,
      padded_tokens=padded_tokens,
      true_length=true_length,
      sampler=sampler,
      rng=rng,
      num_samples=1,
      request_id=request_id,
      max_new_tokens=max_new_tokens,
      stop_token_ids=stop_token_ids,
    )

  def prefill_multisampling(
    self,
    *,
    params,
    existing_prefix: Prefix | None = None,
    padded_tokens,
    true_length: int,
    sampler: SamplingParams | Sequence[SamplingParams] | None = None,
    rng=None,
    num_samples: int = 1,
    request_id: int | None = None,
    max_new_tokens: int | None = None,
    stop_token_ids: Sequence[int] = (),
    first_index: int = 0,
  ) -> tuple[Prefix, ResultTokens]:
    """Run `padded_tokens` [T] (its first `true_length` real) after `existing_prefix`, then draw
    `num_samples` first tokens from the last real position: a GRPO group shares this prefill.

    sampler: one SamplingParams for all samples or one per sample (default: temperature 1).
    rng: [num_samples] PRNG keys (typed or key data); default request_key(engine seed,
    request_id + j). max_new_tokens / stop_token_ids are carried to `insert`.
    first_index: where the drawn token sits in its request's key stream (token i draws with
    fold_in(key, i)): > 0 resumes a sequence whose first `first_index` tokens end the prompt
    (a partial rollout re-prefilled), so it draws what an uninterrupted one would.
    Returns (Prefix, ResultTokens with data [num_samples, 5]).
    """
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    t = tokens.shape[0]
    start = 0 if existing_prefix is None else existing_prefix.length
    if not 0 < true_length <= t:
      raise ValueError(f"true_length={true_length} must be in [1, len(padded_tokens)={t}]")
    total = start + true_length
    max_new = self.max_target_length - total if max_new_tokens is None else max_new_tokens
    self.check_prompt(total, max_new)
    first_index = first_index_array(first_index, num_samples)
    samplers = per_sample(sampler, num_samples)
    stop_ids = stop_array(stop_token_ids)
    keys = self._sample_keys(rng, num_samples, request_id)
    capacity = self._capacity(start + t)
    if existing_prefix is None:
      cache = None  # zeros made inside the jitted prefill: eagerly, 2 L dispatches per prompt
    else:
      cache = existing_prefix.cache
      if cache[0][0].shape[1] < capacity:  # a later chunk: grow to the next capacity bucket
        pad = ((0, 0), (0, capacity - cache[0][0].shape[1]), (0, 0), (0, 0))
        cache = tuple((jnp.pad(k, pad), jnp.pad(v, pad)) for k, v in cache)
      if self._mesh is not None:  # a no-op for a cache already so placed (every one made here)
        cache = jax.device_put(cache, self.kv_sharding)
    rows = RowSampling.stack(samplers)
    cache, first, logp, data, routes = self._prefill_jit(
      params,
      cache,
      tokens[None],
      np.int32(start),
      np.asarray([true_length], np.int32),
      np.zeros(num_samples, np.int32),
      first_index,
      keys,
      rows,
      stop_ids[None],
      np.asarray([max_new], np.int32),
      capacity=capacity if cache is None else 0,  # a static arg: 0 when unused, so no recompile
    )
    self.stats["prefill_calls"] += 1
    self.stats["prefill_tokens"] += t
    if routes is not None:  # this chunk's positions after the earlier chunks'
      routes = np.asarray(routes)[0, :true_length]
      if existing_prefix is not None and existing_prefix.routes is not None:
        routes = np.concatenate([existing_prefix.routes, routes])
    prefix = Prefix(cache, total, first, logp, keys, rows, max_new, stop_ids, first_index, routes)
    return prefix, ResultTokens(data, samples_per_slot=num_samples)

  def prefill_prompt(self, params, prompt: Sequence[int], **kw) -> tuple[Prefix, ResultTokens]:
    """Prefill a whole prompt (token ids), bucketed, in chunks past `prefill_chunk_size`.

    Keyword arguments are those of `prefill_multisampling` (sampler, rng, num_samples, ...).
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    n = len(prompt)
    self.check_prompt(n, kw.get("max_new_tokens") or 1)
    # An empty prefix sized for the whole prompt: one cache shape (one compile) for every chunk.
    prefix = None if n <= self._chunk else self._empty_prefix(self._capacity(n))
    for start in range(0, n, self._chunk):
      piece = prompt[start : start + self._chunk]
      # Chunks of a long prompt all have the chunk shape; a short prompt gets its own bucket.
      width = self._chunk if n > self._chunk else self.prefill_bucket(len(piece))
      padded = np.zeros(width, np.int32)
      padded[: len(piece)] = piece
      prefix, result = self.prefill_multisampling(
        params=params, existing_prefix=prefix, padded_tokens=padded, true_length=len(piece), **kw
      )
    return prefix, result

  def prefill_batch(
    self,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: Sequence[int],
    sampler: Sequence[SamplingParams],
    rng,
    max_new_tokens: Sequence[int],
    stop_token_ids: Sequence[Sequence[int]],
    first_index: Sequence[int] | None = None,
  ) -> tuple[PrefillBatch, ResultTokens]:
    """Prefill K whole prompts (each at most `prefill_chunk_size` tokens) in ONE jitted call and
    draw the first token of each of their samples: prompt k has num_samples[k] samples.

    sampler, rng ([N, 2] key data): one per sample, prompt-major (N = sum(num_samples));
    max_new_tokens / stop_token_ids: one per prompt, carried to `insert_batch`; first_index
    (default 0): one per sample, as in `prefill_multisampling`. The call is
    padded to buckets, so one program serves every batch of one (prompt count, sample count,
    length) bucket: prompts and samples to powers of two (or, with the engine's
    `prefill_batch_prompts`, prompts to that count and samples to the power of two at or above
    that count times the most samples of one prompt), length to the longest prompt's
    `prefill_bucket`.
    Prompts sharing a length bucket give the tokens, log-probs and cache entries
    `prefill_prompt` gives each alone.
    Returns (PrefillBatch, ResultTokens with data [N, 5]).
    """
    k = len(prompts)
    counts = [int(g) for g in num_samples]
    if k == 0 or len(counts) != k or len(max_new_tokens) != k or len(stop_token_ids) != k:
      raise ValueError(
        f"prefill_batch needs one num_samples, max_new_tokens and stop_token_ids per prompt; got "
        f"{k} prompts, {len(counts)}, {len(max_new_tokens)} and {len(stop_token_ids)}"
      )
    if any(g <= 0 for g in counts):
      raise ValueError(f"num_samples must be positive, got {counts}")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    for length, max_new in zip(lengths, max_new_tokens, strict=True):
      self.check_prompt(int(length), int(max_new))
    if lengths.max() > self._chunk:
      raise ValueError(
        f"prefill_batch takes prompts of at most prefill_chunk_size={self._chunk} tokens, got "
        f"{int(lengths.max())}; prefill longer ones in chunks with prefill_prompt"
      )
    n = sum(counts)
    samplers = list(sampler)
    rng = np.asarray(rng)
    if len(samplers) != n or rng.shape != (n, 2):
      raise ValueError(
        f"prefill_batch needs one sampler and one [2] key per sample ({n}); got "
        f"{len(samplers)} samplers and keys of shape {rng.shape}"
      )
    width = self.prefill_bucket(int(lengths.max()))
    kb, nb = next_pow2(k), next_pow2(n)
    if self.prefill_batch_prompts is not None:
      if k > self.prefill_batch_prompts:
        raise ValueError(
          f"prefill_batch got {k} prompts; this engine's prefill_batch_prompts is "
          f"{self.prefill_batch_prompts} (split the batch)"
        )
      kb = self.prefill_batch_prompts
      nb = next_pow2(kb * max(counts))
    tokens = np.zeros((kb, width), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, : lengths[i]] = p
    true_len = np.ones(kb, np.int32)  # padding rows: one token, never read
    true_len[:k] = lengths
    group = np.zeros(nb, np.int32)
    group[:n] = np.repeat(np.arange(k, dtype=np.int32), counts)
    keys = np.zeros((nb, 2), np.uint32)
    keys[:n] = rng
    index = np.zeros(nb, np.int32)
    index[:n] = first_index_array(0 if first_index is None else first_index, n)
    rows = RowSampling.stack(samplers + [SamplingParams()] * (nb - n))
    stop = np.full((kb, MAX_STOP_TOKENS), -1, np.int32)
    stop[:k] = [stop_array(ids) for ids in stop_token_ids]
    max_new = np.ones(kb, np.int32)
    max_new[:k] = max_new_tokens
    cache, first, logp, data, routes = self._prefill_jit(
      params,
      None,
      tokens,
      np.int32(0),
      true_len,
      group,
      index,
      keys,
      rows,
      stop,
      max_new,
      capacity=width,
    )
    self.stats["prefill_calls"] += 1
    self.stats["prefill_tokens"] += int(k * width)
    batch = PrefillBatch(
      cache, lengths, first, logp, keys, rows, group[:n], max_new[:k], stop[:k], tuple(counts),
      index, routes,
    )  # fmt: skip
    return batch, ResultTokens(data[:n], samples_per_slot=n)

  def _empty_prefix(self, capacity: int) -> Prefix:
    none = np.zeros(0)
    return Prefix(self._zero_cache(capacity), 0, none, none, none, None, 0, none, none)

  def _capacity(self, n: int) -> int:
    """Prefix cache length: the prompt bucket, or whole chunks in a power-of-two count."""
    if n <= self._chunk:
      return self.prefill_bucket(n)
    return self._chunk * next_pow2(pages_for(n, self._chunk))

  def _sample_keys(self, rng, num_samples: int, request_id: int | None) -> np.ndarray:
    if rng is None:
      base = 0 if request_id is None else request_id
      return request_keys(self.seed, base + np.arange(num_samples))
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.key_data(rng)
    if rng.shape != (num_samples, 2):
      raise ValueError(f"rng has shape {rng.shape}; num_samples={num_samples} needs one key each")
    return rng

  def _prefill_fn(
    self, params, cache, tokens, start, true_len, group, index, keys, rows, stop_ids, max_new, *,
    capacity,
  ):  # fmt: skip
    """K prompts tokens [K, T] from position `start` (a scalar: > 0 only for a later chunk of one
    prompt), true lengths [K]; sample n draws from prompt group[n] with keys[n], rows[n], as the
    index[n]-th token of its request."""
    if cache is None:
      cache = init_cache(self.cfg, tokens.shape[0], capacity)
    s, t = cache[0][0].shape[1], tokens.shape[1]
    positions = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    kv_valid = jnp.arange(s)[None] < (start + true_len)[:, None]
    logits, cache, routes = self._forward(
      params, tokens, positions, kv_valid, cache=cache, cache_index=start, logits_at=true_len - 1
    )
    if routes is not None:
      routes = jnp.moveaxis(routes, 0, 2)  # [K, T, L, k]
    n = keys.shape[0]
    first, logp = sample_rows(logits[group], step_keys(keys, index), rows)
    done = jnp.any(first[:, None] == stop_ids[group], -1) | (max_new[group] <= 1)
    data = pack_result(first, jnp.ones(n, bool), jnp.ones(n, jnp.int32), done, logp)
    return cache, first, logp, data, routes

  def _forward(self, params, *args, **kwargs):
    """The model's forward, with each MoE layer's top-k experts ([L, B, T, k] int32) when the
    engine captures routes, else None: (logits, cache, routes)."""
    if self.routes_shape is None:
      return (*apply(self.graphdef, params, *args, **kwargs), None)
    logits, cache, routing = apply_with_routing(self.graphdef, params, *args, **kwargs)
    return logits, cache, routing["experts"]
