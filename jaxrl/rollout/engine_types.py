"""The data of the rollout engine's JetStream Engine API: what a decode step returns
(`ResultTokens`, one int32 array per step, viewed per slot as `SlotData`), a prefilled prompt
(`Prefix`, `PrefillBatch`), the decode state every step reads and writes (`DecodeState`), the
per-request PRNG keys, and the checks a request's options get before they reach the device.
`jaxrl.rollout.engine.Engine` is what makes and consumes them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout.sampling import RowSampling, SamplingParams

MAX_STOP_TOKENS = 8  # stop-token ids per request checked on the device (EOS included)


def request_key(seed: int, request_id: int) -> jax.Array:
  """The PRNG key data [2] uint32 of one request; token i draws with fold_in(key, i)."""
  return request_keys(seed, [request_id])[0]


def request_keys(seed: int, request_ids) -> np.ndarray:
  """`request_key` of many requests [n, 2] uint32 in one device call (eagerly, each fold_in is a
  dispatch of its own: milliseconds per request on a CPU)."""
  ids = np.asarray(request_ids, np.int64).reshape(-1)
  bad = ids[(ids < 0) | (ids >= 2**31)]
  if bad.size:
    raise ValueError(f"request_id must be in [0, 2**31), got {int(bad[0])}")
  # Padded to a power of two (at least 8): one program per bucket, not one per request count
  # (a continuous-batching run admits every count from 1 to its slots). Each key depends on its
  # own id only, so the padding changes none of them.
  padded = np.zeros(max(8, 1 << max(ids.size - 1, 0).bit_length()), np.uint32)
  padded[: ids.size] = ids
  return np.asarray(_request_keys(np.int64(seed), padded))[: ids.size]


@jax.jit
def _request_keys(seed, ids):
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(base, i)))(ids)


class SlotData(NamedTuple):
  """One slot's (or one sample's) view of a ResultTokens; leading step axis for multi-step."""

  tokens: np.ndarray  # [..., 1] int32
  valid: np.ndarray  # [..., 1] bool: a token was produced for this slot at this step
  lengths: np.ndarray  # [...] int32: tokens generated so far, this one included
  log_prob: np.ndarray  # [..., 1] float32 behaviour log-prob of the token
  # [..., L, k] int32 experts each MoE layer chose for the token FED at this step (the previous
  # one), with Engine(capture_routes=True); None otherwise.
  routes: np.ndarray | None = None


@dataclasses.dataclass
class ResultTokens:
  """Every slot's token, validity, length, done flag and log-prob in ONE int32 array.

  data: [B, 5] (one step) or [steps, B, 5]; the log-prob column holds float32 bits, so one
  device->host copy carries everything the host loop needs. With captured routes (`routes_shape`
  = (L, k)) L * k more columns hold the experts of the token each slot fed.
  """

  data: jax.Array | np.ndarray
  tokens_idx: tuple[int, int] = (0, 1)
  valid_idx: tuple[int, int] = (1, 2)
  length_idx: tuple[int, int] = (2, 3)
  done_idx: tuple[int, int] = (3, 4)  # the slot finished (stop token / max tokens) at this token
  log_prob_idx: tuple[int, int] = (4, 5)
  samples_per_slot: int = 1
  routes_shape: tuple[int, int] | None = None  # (L, k): columns 5 .. 5 + L * k

  def copy_to_host_async(self) -> None:
    if isinstance(self.data, jax.Array):
      self.data.copy_to_host_async()

  def convert_to_numpy(self) -> ResultTokens:
    return dataclasses.replace(self, data=np.asarray(self.data))

  def get_result_at_slot(self, slot: int) -> SlotData:
    d = np.asarray(self.data)[..., slot, :]
    routes = None
    if self.routes_shape is not None:
      width = self.routes_shape[0] * self.routes_shape[1]
      routes = d[..., 5 : 5 + width].reshape(*d.shape[:-1], *self.routes_shape)
    return SlotData(
      tokens=d[..., slice(*self.tokens_idx)],
      valid=d[..., slice(*self.valid_idx)].astype(bool),
      lengths=d[..., self.length_idx[0]],
      log_prob=np.ascontiguousarray(d[..., slice(*self.log_prob_idx)]).view(np.float32),
      routes=routes,
    )

  def all_slots(self) -> SlotData:
    """Every slot's view at once: tokens, valid, log_prob [..., B, 1] and lengths [..., B]."""
    return self.get_result_at_slot(slice(None))

  @property
  def done(self) -> np.ndarray:
    return np.asarray(self.data)[..., self.done_idx[0]].astype(bool)


def pack_result(tokens, valid, lengths, done, logprobs) -> jax.Array:
  lp_bits = jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)
  cols = (tokens, valid.astype(jnp.int32), lengths, done.astype(jnp.int32), lp_bits)
  return jnp.stack([c.astype(jnp.int32) for c in cols], axis=-1)


class Prefix(NamedTuple):
  """A prefilled prompt: its contiguous KV cache and the first token of each of its G samples."""

  cache: tuple  # L pairs (k, v), each [1, S, K, H]; positions [0, length) are the prompt
  length: int  # prompt tokens prefilled so far (host int)
  tokens: jax.Array  # [G] int32 first sampled tokens (meaningful once the prompt is complete)
  logprobs: jax.Array  # [G] float32
  keys: jax.Array  # [G, 2] uint32 per-sample request keys
  sampling: RowSampling  # [G] per-sample parameters
  max_new_tokens: int
  stop_ids: np.ndarray  # [MAX_STOP_TOKENS] int32, -1 = unused
  first_index: np.ndarray  # [G] int32 index of the first token in each sample's key stream
  routes: np.ndarray | None = None  # [length, L, k] int32 experts of each prompt position


class PrefillBatch(NamedTuple):
  """K prompts prefilled in one call (`prefill_batch`): their caches and the first token of each
  of their N samples, prompt-major. Arrays are padded to the call's buckets (Kb >= K, Nb >= N)."""

  cache: tuple  # L pairs (k, v), each [Kb, S, K, H]; row i positions [0, lengths[i]) real
  lengths: np.ndarray  # [K] int32 prompt lengths (host)
  tokens: jax.Array  # [Nb] int32 first sampled tokens
  logprobs: jax.Array  # [Nb] float32
  keys: np.ndarray  # [Nb, 2] uint32 per-sample request keys
  sampling: RowSampling  # [Nb] per-sample parameters
  group: np.ndarray  # [N] int32: the prompt of each sample
  max_new: np.ndarray  # [K] int32
  stop_ids: np.ndarray  # [K, MAX_STOP_TOKENS] int32, -1 = unused
  num_samples: tuple  # [K] samples per prompt
  first_index: np.ndarray  # [Nb] int32 index of the first token in each sample's key stream
  routes: jax.Array | None = None  # [Kb, T, L, k] int32 experts of each prompt position


class DecodeState(NamedTuple):
  """Everything a decode step reads and writes, for all B = max_concurrent_decodes slots."""

  k_pages: tuple  # L arrays [K, P, page_size, H]
  v_pages: tuple
  page_table: jax.Array  # [B, M] int32
  lengths: jax.Array  # [B] int32 positions in the cache = position of the token fed next
  tokens: jax.Array  # [B] int32 the last sampled token, fed at the next step
  steps: jax.Array  # [B] int32 tokens generated so far (= index of the next one to draw)
  active: jax.Array  # [B] bool
  max_new: jax.Array  # [B] int32
  stop_ids: jax.Array  # [B, MAX_STOP_TOKENS] int32
  keys: jax.Array  # [B, 2] uint32
  sampling: RowSampling  # [B] arrays
  k_scale: jax.Array  # [L, K] float32 per-layer, per-kv-head scales of fp8 pages (1: unused)
  v_scale: jax.Array


def step_keys(keys, index):
  return jax.vmap(lambda k, i: jax.random.fold_in(jax.random.wrap_key_data(k), i))(keys, index)


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def per_sample(sampler, num_samples: int) -> list[SamplingParams]:
  if num_samples <= 0:
    raise ValueError(f"num_samples must be positive, got {num_samples}")
  if sampler is None or isinstance(sampler, SamplingParams):
    return [sampler or SamplingParams()] * num_samples
  sampler = list(sampler)
  if len(sampler) != num_samples:
    raise ValueError(f"{len(sampler)} samplers given; num_samples={num_samples} needs one each")
  return sampler


def first_index_array(first_index, n: int) -> np.ndarray:
  """[n] int32 key-stream indices of n samples' first tokens, from one int or one per sample."""
  index = np.broadcast_to(np.asarray(first_index, np.int32), (n,)).copy()
  if index.min(initial=0) < 0:
    raise ValueError(f"first_index must be non-negative, got {index.tolist()}")
  return index


def stop_array(stop_token_ids) -> np.ndarray:
  ids = sorted({int(i) for i in stop_token_ids})
  if len(ids) > MAX_STOP_TOKENS:
    raise ValueError(f"{len(ids)} stop_token_ids given; at most {MAX_STOP_TOKENS} are supported")
  if any(i < 0 for i in ids):
    raise ValueError(f"stop_token_ids must be non-negative token ids, got {ids}")
  out = np.full(MAX_STOP_TOKENS, -1, np.int32)
  out[: len(ids)] = ids
  return out
