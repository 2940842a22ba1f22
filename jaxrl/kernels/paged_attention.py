"""Paged attention: the paged KV-cache pytree, its scatter-write, and a pure-jnp reference path.

Keys and values live in a pool of fixed-size pages shared by every sequence; a per-sequence page
table maps block m (positions [m * page_size, (m + 1) * page_size)) to a page in the pool. The
pool is kv-head-major, [K, P, page_size, H], the layout of JAX's Pallas paged-attention kernels:
one page of one head is a contiguous [page_size, H] block. The reference path gathers each
sequence's pages per head, which is then already the [K, B, S, H] operand of a batched matmul, and
runs masked dot attention in that layout, so no step transposes the keys (with pages stored
[P, page_size, K, H] the gather came out interleaved and XLA fused a transpose into every copy:
about a quarter of a small model's decode step on a CPU). It works on every backend;
`paged_attention` is the one call site, where a Pallas kernel that reads the pages in place will
slot in behind `impl`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.kernels.attention import dot_attention

IMPLS = ("auto", "reference")


class PagedKV(NamedTuple):
  """One layer's paged KV cache as an attention layer sees it (a pytree).

  The model's attention branches on this type: new keys/values are scattered into their pages at
  their positions and the queries attend through `paged_attention`.
  """

  k_pages: jax.Array  # [K, P, page_size, H]
  v_pages: jax.Array  # [K, P, page_size, H]
  page_table: jax.Array  # [B, M] int32, page of each sequence's m-th block of positions
  lengths: jax.Array  # [B] int32: keys [0, lengths) are real once this call's keys are written


def write_kv(cache: PagedKV, k: jax.Array, v: jax.Array, positions: jax.Array) -> PagedKV:
  """Scatter k, v [B, T, K, H] to their pages at `positions` [B, T].

  Positions at or past `cache.lengths` (prompt padding, idle decode slots) are dropped, so they
  never touch a page another sequence owns. Under donation the scatter is in place.
  """
  num_pages, page_size = cache.k_pages.shape[1:3]
  m = cache.page_table.shape[1]
  block = positions // page_size
  page = jnp.take_along_axis(cache.page_table, jnp.clip(block, 0, m - 1), axis=1)  # [B, T]
  ok = (positions >= 0) & (positions < cache.lengths[:, None]) & (block < m)
  page = jnp.where(ok, page, num_pages)  # an out-of-range page index: mode="drop" skips it
  offset = positions % page_size

  def put(pages, x):  # x [B, T, K, H] -> pages[:, page, offset] of shape [K, B, T, H]
    return pages.at[:, page, offset].set(jnp.moveaxis(x, 2, 0).astype(pages.dtype), mode="drop")

  return cache._replace(k_pages=put(cache.k_pages, k), v_pages=put(cache.v_pages, v))


def paged_attention(
  q: jax.Array,
  cache: PagedKV,
  q_positions: jax.Array,
  *,
  window: int | None = None,
  soft_cap: float | None = None,
  scale: float | None = None,
  impl: str = "auto",
) -> jax.Array:
  """Causal grouped-query attention of q [B, T, N, H] over a paged cache -> [B, T, N, H].

  Query (b, t) at position q_positions[b, t] sees key s iff s < lengths[b], s <= its position
  and, with a sliding `window` W, s > position - W. `soft_cap` c maps scores to c * tanh(s / c)
  (after scaling by `scale`, default H**-0.5), as Gemma does.
  """
  if impl not in IMPLS:
    raise ValueError(f"paged attention impl={impl!r}; allowed: {IMPLS}")
  if window is not None and window <= 0:
    raise ValueError(f"paged attention window={window} must be a positive int (or None)")
  # Only the jnp reference exists yet; "auto" will pick a Pallas kernel on TPU/GPU.
  return paged_attention_reference(
    q,
    cache.k_pages,
    cache.v_pages,
    cache.page_table,
    cache.lengths,
    q_positions,
    window=window,
    soft_cap=soft_cap,
    scale=scale,
  )


def paged_attention_reference(
  q, k_pages, v_pages, page_table, lengths, q_positions, *, window=None, soft_cap=None, scale=None
) -> jax.Array:
  """Gather every sequence's pages per kv head into [K, B, M * page_size, H] and run masked dot
  attention in that layout (`jaxrl.kernels.attention.dot_attention`, kv_layout="KBSH")."""
  b, t, n, h = q.shape
  kh, _, page_size, _ = k_pages.shape
  m = page_table.shape[1]
  k = k_pages[:, page_table].reshape(kh, b, m * page_size, h).astype(q.dtype)
  v = v_pages[:, page_table].reshape(kh, b, m * page_size, h).astype(q.dtype)
  s = jnp.arange(m * page_size)[None, None, :]  # [1, 1, S]
  pos = q_positions[:, :, None]  # [B, T, 1]
  mask = (s < lengths[:, None, None]) & (s <= pos)  # [B, T, S]
  if window is not None:
    mask = mask & (s > pos - window)
  return dot_attention(q, k, v, mask, scale=scale, logit_cap=soft_cap, kv_layout="KBSH")
