"""Grouped matmul for MoE experts: out [M, N] with rows [start_e, end_e) of lhs [M, K] (rows sorted
by expert, group_sizes [E] consecutive) multiplied by rhs[e] [K, N]; rows past sum(group_sizes)
are zero. `jax.lax.ragged_dot` is the reference.

The Pallas kernel follows megablox (the grouped matmul of MaxText's MoE on TPU): the rows are cut
into tiles of bm; a tile that straddles a group boundary is visited once per group it holds, so
the grid walks at most m_tiles + E - 1 "visits" (plus N tiles). A scalar-prefetched table gives
each visit its group and row tile; the visit multiplies the tile by its group's weight block,
keeps the rows of that group (a row mask) and accumulates into the tile's output block, which
stays resident across a tile's consecutive visits and is zeroed at its first. Tiles past the last
group are visited once, to be zeroed. Mosaic TPU (`pltpu.PrefetchScalarGridSpec`); tested through
the Pallas interpreter. `auto` picks it on a TPU, the reference elsewhere (XLA's ragged_dot).

The custom VJP differentiates the reference (ragged_dot's own gradients: lhs through the
transposed weights, rhs as each group's lhs^T @ dy), so the kernel can sit in the training path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

IMPLS = ("auto", "reference", "pallas_tpu")


def reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`jax.lax.ragged_dot` accumulated in float32, returned as lhs.dtype."""
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def visit_table(group_sizes: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The grid's visits, in row order: every (group, row tile) pair where the group has rows in
  the tile; then one visit (group -1, no rows) for each tile past the groups, so it is zeroed;
  then the last tile again (no rows) up to the bound m_tiles + E. Returns int32 group ids [V],
  tile ids [V] and row ranges [V, 2] (the group's [start, end); empty for group -1)."""
  e = group_sizes.shape[0]
  tiles = -(-m // bm)
  v = tiles + e  # an upper bound: sum over groups of their tiles <= tiles + E - 1
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // bm
  count = jnp.where(sizes > 0, (jnp.maximum(ends, 1) - 1) // bm - first + 1, 0)
  cum = jnp.cumsum(count)
  total = cum[-1]
  idx = jnp.arange(v, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(cum, idx, side="right"), e - 1).astype(jnp.int32)
  tile = first[group] + idx - (cum[group] - count[group])
  # Past the groups: the tiles no group reached (rows >= sum(sizes)), then the last tile again.
  used_tiles = jnp.where(total > 0, (jnp.maximum(ends[-1], 1) - 1) // bm + 1, 0)
  tail = jnp.minimum(used_tiles + idx - total, tiles - 1)
  real = idx < total
  tile = jnp.where(real, tile, tail).astype(jnp.int32)
  lo = jnp.where(real, starts[group], 0)
  hi = jnp.where(real, ends[group], 0)
  return jnp.where(real, group, -1), tile, jnp.stack([lo, hi], -1).astype(jnp.int32)


def _kernel(group_ref, tile_ref, range_ref, lhs_ref, rhs_ref, o_ref, *, bm: int):
  v = pl.program_id(1)
  tile = tile_ref[v]
  prev = tile_ref[jnp.maximum(v - 1, 0)]

  @pl.when((v == 0) | (tile != prev))
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  keep = (rows >= range_ref[v, 0]) & (rows < range_ref[v, 1])
  y = jnp.dot(lhs_ref[...], rhs_ref[0], preferred_element_type=jnp.float32)
  o_ref[...] += jnp.where(keep, y, 0.0)


def _pallas(lhs, rhs, group_sizes, *, block, interpret):
  from jax.experimental.pallas import tpu as pltpu

  m, k = lhs.shape
  e, _, n = rhs.shape
  bm, bn = min(block[0], m), min(block[1], n)
  mp, np_ = -(-m // bm) * bm, -(-n // bn) * bn
  lhs_p = jnp.pad(lhs, ((0, mp - m), (0, 0)))
  rhs_p = jnp.pad(rhs, ((0, 0), (0, 0), (0, np_ - n)))
  group, tile, ranges = visit_table(group_sizes, mp, bm)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=3,
    grid=(np_ // bn, group.shape[0]),
    in_specs=[
      pl.BlockSpec((bm, k), lambda j, v, g, t, r: (t[v], 0)),
      pl.BlockSpec((1, k, bn), lambda j, v, g, t, r: (jnp.maximum(g[v], 0), 0, j)),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda j, v, g, t, r: (t[v], j)),
  )
  out = pl.pallas_call(
    functools.partial(_kernel, bm=bm),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
  )(group, tile, ranges, lhs_p, rhs_p)
  return out[:m, :n].astype(lhs.dtype)


def resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl must be one of {IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  return "pallas_tpu" if jax.default_backend() == "tpu" else "reference"


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs, rhs, group_sizes, impl, block, interpret):
  if impl == "reference":
    return reference(lhs, rhs, group_sizes)
  return _pallas(lhs, rhs, group_sizes, block=block, interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, impl, block, interpret):
  return _gmm(lhs, rhs, group_sizes, impl, block, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(impl, block, interpret, res, dy):
  lhs, rhs, group_sizes = res
  _, vjp = jax.vjp(lambda a, b: reference(a, b, group_sizes), lhs, rhs)
  d_lhs, d_rhs = vjp(dy)
  return d_lhs, d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  impl: str = "auto",
  block: tuple[int, int] = (128, 128),
  interpret: bool = False,
) -> jax.Array:
  """lhs [M, K] (rows grouped by expert), rhs [E, K, N], group_sizes [E] int -> [M, N] in
  lhs.dtype (see the module docstring). block = (bm, bn), clipped to the operands."""
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
      f"grouped_matmul needs lhs [M, K] and rhs [E, K, N], got {lhs.shape} and {rhs.shape}"
    )
  if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
      f"group_sizes must be [E={rhs.shape[0]}] integers, got {group_sizes.shape} "
      f"{group_sizes.dtype}"
    )
  return _gmm(lhs, rhs, group_sizes, resolve_impl(impl), tuple(block), interpret)
