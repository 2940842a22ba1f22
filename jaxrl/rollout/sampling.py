"""Token sampling: temperature, top-k, top-p, min-p; per-row RNG keys, behaviour log-probs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn. temperature=0 means greedy; top_k=0, top_p=1, min_p=0 switch filters off.

  min_p keeps the tokens whose tempered probability is at least min_p times the top one's.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")

  @property
  def logprob_temperature(self) -> float:
    """The temperature of the policy whose log-probs are reported (1 for greedy decoding)."""
    return self.temperature if self.temperature > 0 else 1.0


class RowSampling(NamedTuple):
  """Per-row sampling parameters as arrays, so one compiled step serves any mix of requests."""

  temperature: jax.Array  # [B] float32, 0 = greedy
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32, 1 = off
  min_p: jax.Array  # [B] float32, 0 = off

  @classmethod
  def stack(cls, params: Sequence[SamplingParams]) -> RowSampling:
    """Host-side: one row per SamplingParams (numpy arrays, placed by the jitted consumer)."""
    return cls(
      np.asarray([p.temperature for p in params], np.float32),
      np.asarray([p.top_k for p in params], np.int32),
      np.asarray([p.top_p for p in params], np.float32),
      np.asarray([p.min_p for p in params], np.float32),
    )

  @classmethod
  def broadcast(cls, params: SamplingParams, batch: int) -> RowSampling:
    """Host-side: the same SamplingParams on each of `batch` rows."""
    return cls.stack([params] * batch)


def filter_logits_rows(logits: jax.Array, rows: RowSampling) -> jax.Array:
  """Mask logits [B, V] outside each row's top-k set, top-p nucleus and min-p set to -inf.

  Top-p runs on the renormalised top-k set; min-p compares against the top token, which the other
  filters never remove, so its order does not matter. Each row has its own top_k, top_p, min_p
  ([B] arrays). Masking by a value threshold commutes with sorting, so the sorted top-k-masked
  logits are the sorted logits masked the same way: one descending sort serves all three.
  """
  v = logits.shape[-1]
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # [B, V] descending
  k = jnp.where((rows.top_k > 0) & (rows.top_k < v), rows.top_k, v)
  kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [B, 1]
  logits = jnp.where(logits < kth, _NEG_INF, logits)
  sorted_logits = jnp.where(sorted_logits < kth, _NEG_INF, sorted_logits)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  top_p = rows.top_p[:, None]
  cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  # top_p = 1 is off exactly: float cumsums can reach 1 early and would cut the tail.
  logits = jnp.where((top_p < 1.0) & (logits < cutoff), _NEG_INF, logits)
  floor = sorted_logits[:, :1] + jnp.log(rows.min_p[:, None])  # log(0) = -inf: off
  return jnp.where(logits < floor, _NEG_INF, logits)


def sample_rows(logits: jax.Array, keys: jax.Array, rows: RowSampling):
  """Draw one token per row with the row's own parameters; rows with temperature 0 take the argmax.

  logits: [B, V]; keys: [B] typed PRNG keys. Returns (tokens [B] int32, logprobs [B] float32).
  The log-prob is that of the drawn token under the row's full tempered distribution
  softmax(logits / T) (T = 1 for greedy rows) — the distribution the learner scores — not under
  the top-k/top-p/min-p truncation (the same convention as verl/TRL).
  """
  logits = logits.astype(jnp.float32)
  greedy = rows.temperature <= 0
  temp = jnp.where(greedy, 1.0, rows.temperature)[:, None]
  scaled = logits / temp
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  # The filters' full-vocabulary sort costs ~0.8 s per step at a 152k vocabulary on a CPU; when
  # no row filters (RL's usual temperature-only sampling) they are the identity, so skip them.
  v = logits.shape[-1]
  filtering = jnp.any(
    ((rows.top_k > 0) & (rows.top_k < v)) | (rows.top_p < 1.0) | (rows.min_p > 0.0)
  )
  filtered = jax.lax.cond(filtering, filter_logits_rows, lambda x, _: x, scaled, rows)
  # Greedy batches (evaluation) skip the per-row Gumbel draws; a row's token never depends on
  # whether they ran.
  drawn = jax.lax.cond(
    jnp.all(greedy),
    lambda k, x: jnp.zeros(x.shape[:1], jnp.int32),
    lambda k, x: jax.vmap(jax.random.categorical)(k, x).astype(jnp.int32),
    keys,
    filtered,
  )
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]


def filter_logits(logits: jax.Array, top_k: int, top_p: float, min_p: float = 0.0) -> jax.Array:
  """`filter_logits_rows` with the same top_k, top_p, min_p on every row of logits [B, V]."""
  rows = RowSampling.broadcast(SamplingParams(1.0, top_k, top_p, min_p), logits.shape[0])
  return filter_logits_rows(logits, rows)


def sample_tokens(logits: jax.Array, keys: jax.Array, params: SamplingParams):
  """`sample_rows` with the same SamplingParams on every row of logits [B, V]."""
  return sample_rows(logits, keys, RowSampling.broadcast(params, logits.shape[0]))
