"""Paged attention: the paged KV-cache pytree, its scatter-write, and a pure-jnp reference path.

Keys and values live in a pool of fixed-size pages shared by every sequence; a per-sequence page
table maps block m (positions [m * page_size, (m + 1) * page_size)) to a page in the pool. The
pool is kv-head-major, [K, P, page_size, H], the layout of JAX's Pallas paged-attention kernels:
one page of one head is a contiguous [page_size, H] block. The reference path gathers each
sequence's pages per head, which is then already the [K, B, S, H] operand of a batched matmul, and
runs masked dot attention in that layout, so no step transposes the keys (with pages stored
[P, page_size, K, H] the gather came out interleaved and XLA fused a transpose into every copy:
about a quarter of a small model's decode step on a CPU). It works on every backend;
`paged_attention` is the one call site: `impl="pallas_tpu"` runs a Pallas kernel that reads each
page in place through the page table (`paged_attention_pallas`); `impl="pallas_gpu"` runs JAX's
own Triton paged-attention kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, same page
layout) for decode steps (`paged_attention_gpu`); `auto` the reference. The Triton path was
compiled on an NVIDIA H200 on 2026-12-04 (docs/benchmarks.md): 2.5-2.7x the gather path for one
decode step of 64 sequences with bf16 pages, but no gain inside the engine at 288 positions, so
`auto` stays the reference; the Mosaic TPU kernel has run only through the Pallas interpreter
and is lowered for a TPU on a CPU in tests (tests/kernels/lowering_test.py), never compiled.

An fp8 cache (pages of float8_e4m3fn, `PagedKV.k_scale` / `v_scale` per kv head) stores each
key and value divided by its head's scale, saturated at the format's largest value. Reading it
costs no dequantized copy: q (k s) = (q s) k, so the queries of each kv head are multiplied by
its key scale before the scores and the output by its value scale after, on either path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jaxrl.kernels.attention import dot_attention
from jaxrl.kernels.partition import kernel_mesh, mesh_axes_of, shard_mapped

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")


class PagedKV(NamedTuple):
  """One layer's paged KV cache as an attention layer sees it (a pytree).

  The model's attention branches on this type: new keys/values are scattered into their pages at
  their positions and the queries attend through `paged_attention`.
  """

  k_pages: jax.Array  # [K, P, page_size, H]
  v_pages: jax.Array  # [K, P, page_size, H]
  page_table: jax.Array  # [B, M] int32, page of each sequence's m-th block of positions
  lengths: jax.Array  # [B] int32: keys [0, lengths) are real once this call's keys are written
  # fp8 pages: float32 [K] per-kv-head scales (the stored value is x / scale); None otherwise.
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None


FP8_KV_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_kv(x: jax.Array, scale: jax.Array, axis: int, dtype) -> jax.Array:
  """x / scale (scale per kv head, x's `axis`), clipped to the fp8 range, as `dtype`: never
  inf or NaN, however far a value lies past the calibrated range."""
  shape = [1] * x.ndim
  shape[axis] = -1
  scaled = x.astype(jnp.float32) / scale.reshape(shape)
  return jnp.clip(scaled, -FP8_KV_MAX, FP8_KV_MAX).astype(dtype)


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

  def put(pages, x, scale):  # x [B, T, K, H] -> pages[:, page, offset] of shape [K, B, T, H]
    x = jnp.moveaxis(x, 2, 0)
    x = x.astype(pages.dtype) if scale is None else quantize_kv(x, scale, 0, pages.dtype)
    return pages.at[:, page, offset].set(x, mode="drop")

  return cache._replace(
    k_pages=put(cache.k_pages, k, cache.k_scale), v_pages=put(cache.v_pages, v, cache.v_scale)
  )


def paged_attention(
  q: jax.Array,
  cache: PagedKV,
  q_positions: jax.Array,
  *,
  window: int | None = None,
  soft_cap: float | None = None,
  scale: float | None = None,
  impl: str = "auto",
  interpret: bool = False,
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
  if cache.k_scale is not None:  # fp8 pages: fold each head's scales into q and the output
    # in float32, each product rounded once to q's dtype (a scale rounded to bfloat16 first
    # would skew every score or output of its head by the same up to 2**-9).
    kh, n = cache.k_pages.shape[0], q.shape[2]
    per_head = lambda s: jnp.repeat(s.astype(jnp.float32), n // kh)[:, None]  # noqa: E731 [N, 1]
    fold = lambda x, s: (x.astype(jnp.float32) * per_head(s)).astype(x.dtype)  # noqa: E731
    out = paged_attention(
      fold(q, cache.k_scale),
      cache._replace(k_scale=None, v_scale=None),
      q_positions,
      window=window,
      soft_cap=soft_cap,
      scale=scale,
      impl=impl,
      interpret=interpret,
    )
    return fold(out, cache.v_scale)
  if impl == "pallas_tpu":
    kernel = functools.partial(
      paged_attention_pallas, window=window, soft_cap=soft_cap, scale=scale, interpret=interpret
    )
    return _per_head_shards(kernel, q, cache, q_positions)
  if impl == "pallas_gpu" and q.shape[1] == 1 and window is None:
    kernel = functools.partial(
      paged_attention_gpu, soft_cap=soft_cap, scale=scale, interpret=interpret
    )
    return _per_head_shards(lambda q, cache, _: kernel(q, cache), q, cache, q_positions)
  # "pallas_gpu" covers decode steps of full-attention layers; a sliding-window layer or a
  # multi-token call (T > 1) runs the reference.
  # "auto" stays the reference (see the module docstring).
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


def _per_head_shards(kernel, q: jax.Array, cache: PagedKV, q_positions: jax.Array) -> jax.Array:
  """kernel(q, cache, q_positions), on a mesh of several devices per shard of the kv heads
  (`jaxrl.kernels.partition`): each device attends with its heads' pages and queries, as the
  engine lays the pool out (kv heads split as the rules place them, the page table, lengths and
  positions on every device); heads the rules replicate are computed on every device."""
  mesh = kernel_mesh()
  if mesh is None:
    return kernel(q, cache, q_positions)
  ax = mesh_axes_of(mesh, "act_kv_heads", cache.k_pages.shape[0])
  heads, pages = P(None, None, ax, None), P(ax, None, None, None)
  cache_spec = cache._replace(k_pages=pages, v_pages=pages, page_table=P(), lengths=P())
  return shard_mapped(kernel, mesh, (heads, cache_spec, P()), heads)(q, cache, q_positions)


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


_MASKED = -1e30  # a finite "minus infinity": a row with no visible key yet never makes NaN


def _paged_kernel(
  table_ref, lengths_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref,
  *, page_size, window, soft_cap, scale,
):  # fmt: skip
  """One (sequence b, kv head, page m) step of flash-decoding: the page's keys against the
  head's G grouped queries of every query position, folded into a running max, sum and output."""
  b, m = pl.program_id(0), pl.program_id(2)

  @pl.when(m == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, _MASKED)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  length = lengths_ref[b]

  @pl.when(m * page_size < length)  # pages past the sequence are never read
  def _():
    q = q_ref[0, 0].astype(jnp.float32)  # [R, H], R = T * G
    k = k_ref[0, 0].astype(jnp.float32)  # [page_size, H]
    v = v_ref[0, 0].astype(jnp.float32)
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ()))) * scale  # [R, page_size]
    if soft_cap is not None:
      scores = soft_cap * jnp.tanh(scores / soft_cap)
    keys = m * page_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    pos = pos_ref[0, 0]  # [R, 1]
    visible = (keys < length) & (keys <= pos)
    if window is not None:
      visible = visible & (keys > pos - window)
    scores = jnp.where(visible, scores, _MASKED)
    m_prev = m_ref[...]  # [R, 1]
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(scores - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v)
    m_ref[...] = m_new

  @pl.when(m == pl.num_programs(2) - 1)
  def _():
    l = l_ref[...]
    o_ref[0, 0] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def paged_attention_pallas(
  q: jax.Array,
  cache: PagedKV,
  q_positions: jax.Array,
  *,
  window: int | None = None,
  soft_cap: float | None = None,
  scale: float | None = None,
  interpret: bool = False,
) -> jax.Array:
  """`paged_attention` as a Pallas (Mosaic TPU) kernel over a (B, K, M) grid that reads page
  table[b, m] of kv head k in place (the table and lengths scalar-prefetched), with an online
  softmax across pages, so no step gathers the pages into a contiguous copy. Pages at or past a
  sequence's length are skipped. A query with no visible key returns zeros (the reference gives
  the mean of the masked values; such rows are padding either way)."""
  from jax.experimental.pallas import tpu as pltpu

  b, t, n, h = q.shape
  kh, _, page_size, _ = cache.k_pages.shape
  g = n // kh
  m = cache.page_table.shape[1]
  r = t * g
  # [B, T, K, G, H] -> [B, K, T * G, H]: row t * G + j is query position t, head k * G + j.
  qr = jnp.moveaxis(q.reshape(b, t, kh, g, h), 2, 1).reshape(b, kh, r, h)
  pos = jnp.broadcast_to(q_positions[:, None, :, None], (b, kh, t, g)).reshape(b, kh, r, 1)
  kernel = functools.partial(
    _paged_kernel,
    page_size=page_size,
    window=window,
    soft_cap=soft_cap,
    scale=h**-0.5 if scale is None else scale,
  )
  page = lambda i, k, j, table, lengths: (k, table[i, j], 0, 0)  # noqa: E731
  head = lambda i, k, j, table, lengths: (i, k, 0, 0)  # noqa: E731
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(b, kh, m),
    in_specs=[
      pl.BlockSpec((1, 1, r, h), head),
      pl.BlockSpec((1, 1, r, 1), head),
      pl.BlockSpec((1, 1, page_size, h), page),
      pl.BlockSpec((1, 1, page_size, h), page),
    ],
    out_specs=pl.BlockSpec((1, 1, r, h), head),
    scratch_shapes=[
      pltpu.VMEM((r, 1), jnp.float32),
      pltpu.VMEM((r, 1), jnp.float32),
      pltpu.VMEM((r, h), jnp.float32),
    ],
  )
  out = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((b, kh, r, h), q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
  )(cache.page_table, cache.lengths, qr, pos, cache.k_pages, cache.v_pages)
  return jnp.moveaxis(out.reshape(b, kh, t, g, h), 1, 2).reshape(b, t, n, h)


def _largest_divisor(n: int, cap: int) -> int:
  return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _gpu_blocks(pages: int) -> tuple[int, int]:
  """(k_splits, pages per compute block) for `pages` page-table columns: Triton's block shapes
  must be powers of two, so the block is the largest power of two (at most 8) dividing the
  pages, and the splits (at most 16) divide what is left (48 pages: 8 per block, 6 splits)."""
  per_block = min(pages & -pages, 8)
  return _largest_divisor(pages // per_block, 16), per_block


def paged_attention_gpu(
  q: jax.Array,
  cache: PagedKV,
  *,
  soft_cap: float | None = None,
  scale: float | None = None,
  interpret: bool = False,
) -> jax.Array:
  """One decode step (q [B, 1, N, H], each row's query at its newest key: it sees keys
  [0, lengths)) through JAX's Triton paged-attention kernel, which reads the pages in place
  through the page table, splitting each sequence's pages into up to 16 partitions combined by
  a final flash-decoding reduction. The kernel does not scale q, so q arrives scaled. 8-bit
  pages go in with unit per-token scales, which makes the kernel upcast each page block before
  its dot (a [K, P, page_size] float32 array of ones: 4 / H of the pages' bytes)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as triton_paged

  b, t, n, h = q.shape
  if t != 1:
    raise ValueError(f"paged_attention_gpu decodes one position per row, got T={t}")
  m = cache.page_table.shape[1]
  k_splits, per_block = _gpu_blocks(m)
  scales = None
  if jnp.dtype(cache.k_pages.dtype).itemsize == 1:
    scales = jnp.ones(cache.k_pages.shape[:3], jnp.float32)
  qs = q[:, 0] * jnp.asarray(h**-0.5 if scale is None else scale, q.dtype)
  out = triton_paged.paged_attention(
    qs,
    cache.k_pages,
    cache.v_pages,
    cache.page_table,
    cache.lengths.astype(jnp.int32),
    scales,
    scales,
    block_h=16,
    pages_per_compute_block=per_block,
    k_splits=k_splits,
    interpret=interpret,
    attn_logits_soft_cap=soft_cap,
  )
  return out[:, None].astype(q.dtype)
