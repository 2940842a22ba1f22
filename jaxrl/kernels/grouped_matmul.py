"""Grouped matmul for MoE experts: out [M, N] with rows [start_e, end_e) of lhs [M, K] (rows sorted
by expert, group_sizes [E] consecutive) multiplied by rhs[e] [K, N]; rows past sum(group_sizes)
are zero. `jax.lax.ragged_dot` is the reference.

The Pallas kernel follows megablox (the grouped matmul of MaxText's MoE on TPU): the rows are cut
into tiles of bm; a tile that straddles a group boundary is visited once per group it holds, so
the grid walks at most m_tiles + E - 1 "visits" (plus N tiles). A scalar-prefetched table gives
each visit its group and row tile; the visit multiplies the tile by its group's weight block,
keeps the rows of that group (a row mask) and accumulates into the tile's output block, which
stays resident across a tile's consecutive visits and is zeroed at its first. Tiles past the last
group are visited once, to be zeroed. Mosaic TPU (`pltpu.PrefetchScalarGridSpec`).

The Triton kernel (`pallas_gpu`; Triton has no scalar prefetch) runs a (row tiles, N tiles) grid:
each program loads its tile's group span (the first group with rows in it and one past the
last, from a table made before the call) and loops over those groups, each a loop over K in bk
slices of lhs tile @ rhs[group]'s column block, keeping that group's rows; a tile no group
reaches stays zero. Blocks are powers of two of at least 16 (`jaxrl.kernels.blocks`), the
operands zero-padded to them (Triton named in the call's params: jax 0.10 would otherwise lower
it through Mosaic GPU, whose shared memory cannot hold a block of every expert). Both kernels are
tested through the Pallas interpreter and lowered for their backends on a CPU
(tests/kernels/lowering_test.py); the Triton one also ran on an NVIDIA H200 (2026-12-04,
docs/benchmarks.md: 1.8-2.8x `ragged_dot` over 8 experts, 7.7-10.8x over 64). `auto` picks
pallas_tpu on a TPU, pallas_gpu on a GPU and `tiled` (below) elsewhere.

`tiled` is the same visit walk in plain jnp, for CPUs: the visits' row tiles and their groups'
weights gathered into one batched matmul [V, bm, K] @ [V, K, N], each visit's rows outside its
group zeroed, the visits summed into their tiles (`jax.ops.segment_sum`). It does about m + E bm
rows of work where XLA's CPU ragged_dot does about E m (each row through every expert): with 8
experts several times faster, gradients included (`bench/grouped_matmul_cpu.py`,
docs/benchmarks.md). Plain autodiff gives its gradient. The weight gather costs V copies of one
expert's [K, N] block, so it is for small models (a CPU's), not an accelerator's experts.

The custom VJP differentiates the reference (ragged_dot's own gradients: lhs through the
transposed weights, rhs as each group's lhs^T @ dy), so the kernel can sit in the training path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jaxrl.kernels.blocks import gpu_block, round_up
from jaxrl.kernels.partition import kernel_mesh, shard_mapped

IMPLS = ("auto", "reference", "tiled", "pallas_tpu", "pallas_gpu")


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


def tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, bm: int = 128) -> jax.Array:
  """The grouped matmul as one batched jnp matmul over the visit table's (group, row tile) pairs
  (see the module docstring): float32 accumulation, returned as lhs.dtype."""
  m = lhs.shape[0]
  bm = min(bm, m)
  mp = -(-m // bm) * bm
  tiles = jnp.pad(lhs, ((0, mp - m), (0, 0))).reshape(mp // bm, bm, -1)
  group, tile, ranges = visit_table(group_sizes, mp, bm)
  y = jnp.einsum(
    "vmk,vkn->vmn", tiles[tile], rhs[jnp.maximum(group, 0)], preferred_element_type=jnp.float32
  )
  rows = tile[:, None] * bm + jnp.arange(bm, dtype=jnp.int32)[None]
  keep = (rows >= ranges[:, :1]) & (rows < ranges[:, 1:])
  y = jnp.where(keep[..., None], y, 0.0)
  out = jax.ops.segment_sum(y, tile, num_segments=mp // bm, indices_are_sorted=True)
  return out.reshape(mp, -1)[:m].astype(lhs.dtype)


def _gmm_tpu_kernel(group_ref, tile_ref, range_ref, lhs_ref, rhs_ref, o_ref, *, bm: int):
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
    functools.partial(_gmm_tpu_kernel, bm=bm),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
  )(group, tile, ranges, lhs_p, rhs_p)
  return out[:m, :n].astype(lhs.dtype)


def tile_spans(group_sizes: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array]:
  """For each row tile of bm rows (m rows in all): the first group with rows in it and one past
  the last, as int32 [tiles] each (first >= last: no group's rows, the tile stays zero). An empty
  group between two others falls inside a span; it keeps no rows."""
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  lo = jnp.arange(-(-m // bm), dtype=jnp.int32) * bm
  first = jnp.searchsorted(ends, lo, side="right")  # groups ending at or before the tile
  last = jnp.searchsorted(starts, lo + bm, side="left")  # groups starting before its end
  return first.astype(jnp.int32), last.astype(jnp.int32)


def _gmm_gpu_kernel(first_ref, last_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, o_ref, *, bk: int):
  i = pl.program_id(0)
  bm, bn = o_ref.shape
  rows = i * bm + jnp.arange(bm, dtype=jnp.int32)

  def group(g, total):
    def k_step(q, acc):
      a = lhs_ref[:, pl.ds(q * bk, bk)]
      b = rhs_ref[g, pl.ds(q * bk, bk), :]
      return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    y = jax.lax.fori_loop(0, lhs_ref.shape[1] // bk, k_step, jnp.zeros((bm, bn), jnp.float32))
    keep = (rows >= starts_ref[g]) & (rows < ends_ref[g])
    return total + jnp.where(keep[:, None], y, 0.0)

  total = jax.lax.fori_loop(first_ref[i], last_ref[i], group, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = total


def _triton(lhs, rhs, group_sizes, *, block, interpret):
  from jax.experimental.pallas import triton as pltriton

  m, k = lhs.shape
  e, _, n = rhs.shape
  bm, bn = gpu_block(block[0], m), gpu_block(block[1], n)
  bk = gpu_block(block[2] if len(block) > 2 else 64, k)
  mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
  lhs_p = jnp.pad(lhs, ((0, mp - m), (0, kp - k)))
  rhs_p = jnp.pad(rhs, ((0, 0), (0, kp - k), (0, np_ - n)))
  first, last = tile_spans(group_sizes, mp, bm)
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  starts = ends - group_sizes.astype(jnp.int32)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
  # Triton named explicitly: with no compiler params jax 0.10 lowers a GPU pallas_call through
  # Mosaic GPU, which copies every block into shared memory (rhs's whole expert column block
  # overflows it; tests/kernels/lowering_test.py).
  out = pl.pallas_call(
    functools.partial(_gmm_gpu_kernel, bk=bk),
    grid=(mp // bm, np_ // bn),
    in_specs=[
      whole(first),
      whole(last),
      whole(starts),
      whole(ends),
      pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
      pl.BlockSpec((e, kp, bn), lambda i, j: (0, 0, j)),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
    out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
    compiler_params=pltriton.CompilerParams(),
    interpret=interpret,
  )(first, last, starts, ends, lhs_p, rhs_p)
  return out[:m, :n].astype(lhs.dtype)


def resolve_impl(impl: str) -> str:
  """`auto` -> the backend's kernel (pallas_tpu / pallas_gpu), or `tiled` on a CPU."""
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl must be one of {IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "tiled")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs, rhs, group_sizes, impl, block, interpret):
  if impl == "reference":
    return reference(lhs, rhs, group_sizes)
  if impl == "pallas_gpu":
    return _triton(lhs, rhs, group_sizes, block=block, interpret=interpret)
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
  block: tuple[int, ...] = (128, 128),
  interpret: bool = False,
) -> jax.Array:
  """lhs [M, K] (rows grouped by expert), rhs [E, K, N], group_sizes [E] int -> [M, N] in
  lhs.dtype (see the module docstring). block = (bm, bn), clipped to the operands (`tiled` reads
  bm only); pallas_gpu
  takes an optional third entry bk (default 64) and rounds each to a power of two >= 16."""
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
      f"grouped_matmul needs lhs [M, K] and rhs [E, K, N], got {lhs.shape} and {rhs.shape}"
    )
  if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
      f"group_sizes must be [E={rhs.shape[0]}] integers, got {group_sizes.shape} "
      f"{group_sizes.dtype}"
    )
  impl = resolve_impl(impl)
  if impl == "tiled":  # plain jnp: autodiff gives its own (equally tiled) gradient
    return tiled(lhs, rhs, group_sizes, block[0])
  mesh = kernel_mesh()
  if mesh is None or impl == "reference":
    return _gmm(lhs, rhs, group_sizes, impl, tuple(block), interpret)
  # A kernel on a mesh outside the expert-parallel shard_map: whole operands on every device
  # (jaxrl.kernels.partition); with an expert axis each device runs its own experts instead.
  kernel = lambda a, b, g: _gmm(a, b, g, impl, tuple(block), interpret)  # noqa: E731
  return shard_mapped(kernel, mesh, (P(), P(), P()), P())(lhs, rhs, group_sizes)
