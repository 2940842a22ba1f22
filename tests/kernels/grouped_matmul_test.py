"""The MoE grouped matmul (jaxrl.kernels.grouped_matmul): the megablox-style Mosaic TPU kernel and
the Triton kernel through the Pallas interpreter, and the plain-jnp tiled walk (the CPU's
choice), against `jax.lax.ragged_dot`, on group layouts
that straddle tiles, leave groups empty and leave trailing rows; their visit table and tile
spans; the custom VJP; the errors. (The Triton kernel's blocks are at least 16: with 21 rows and
N = 20 its grid is 2 x 2 tiles, boundaries inside tiles and a short last column block.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.blocks import gpu_block
from jaxrl.kernels.grouped_matmul import (
  grouped_matmul,
  reference,
  resolve_impl,
  tile_spans,
  visit_table,
)

KERNELS = ("pallas_tpu", "pallas_gpu")
IMPLS = ("tiled", *KERNELS)  # tiled: plain jnp, no interpreter

K, N = 12, 20  # bn = 8: a short last column block
LAYOUTS = {
  "straddling": [5, 3, 9, 4],  # 21 rows in tiles of 8: boundaries inside tiles
  "empty_groups": [0, 11, 0, 10],
  "one_group": [0, 0, 21, 0],
  "trailing_rows": [4, 4, 2, 3],  # 13 of 21 rows grouped: the rest are zero
  "tile_aligned": [8, 8, 0, 5],
}


def _operands(sizes, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.normal(size=(21, K)).astype(np.float32), dtype)
  rhs = jnp.asarray(rng.normal(size=(len(sizes), K, N)).astype(np.float32), dtype)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_matches_ragged_dot(layout, impl):
  lhs, rhs, sizes = _operands(LAYOUTS[layout])
  want = np.asarray(reference(lhs, rhs, sizes))
  got = np.asarray(
    jax.jit(lambda a, b, s: grouped_matmul(a, b, s, impl=impl, block=(8, 8), interpret=True))(
      lhs, rhs, sizes
    )
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Against numpy, group by group; rows past the groups are zero.
  ends = np.cumsum(LAYOUTS[layout])
  for e, (lo, hi) in enumerate(zip(ends - LAYOUTS[layout], ends, strict=True)):
    np.testing.assert_allclose(
      got[lo:hi], np.asarray(lhs)[lo:hi] @ np.asarray(rhs)[e], rtol=1e-5, atol=1e-5
    )
  assert np.all(got[ends[-1] :] == 0)


def test_visit_table_covers_each_tile_and_group_pair_once_in_row_order():
  group, tile, ranges = (np.asarray(a) for a in visit_table(jnp.asarray([5, 3, 9, 4, 0]), 24, 8))
  real = group >= 0
  pairs = list(zip(group[real], tile[real], strict=True))
  # Rows [0,5) g0 t0; [5,8) g1 t0; [8,17) g2 t1,t2; [17,21) g3 t2; g4 empty.
  assert pairs == [(0, 0), (1, 0), (2, 1), (2, 2), (3, 2)]
  assert [tuple(r) for r in ranges[real]] == [(0, 5), (5, 8), (8, 17), (8, 17), (17, 21)]
  assert len(group) == 3 + 5  # tiles + E: the bound
  assert np.all(np.diff(tile) >= 0)  # a tile's visits are consecutive
  assert np.all(ranges[~real] == 0)


def test_tile_spans_name_the_groups_with_rows_in_each_tile():
  # Rows [0,5) g0; [5,8) g1; [8,17) g2; [17,21) g3; g4 empty (at row 21, inside tile 2: visited,
  # keeps no rows); tile 3 (rows 24-31) past them all.
  first, last = (np.asarray(a) for a in tile_spans(jnp.asarray([5, 3, 9, 4, 0]), 32, 8))
  assert [list(range(f, max(f, la))) for f, la in zip(first, last, strict=True)] == [
    [0, 1],
    [2],
    [2, 3, 4],
    [],
  ]
  # g0 (at row 0) is not visited (it ends where tile 0 starts); g2 (row 11) and g4 (row 21) are.
  first, last = (np.asarray(a) for a in tile_spans(jnp.asarray([0, 11, 0, 10, 0]), 24, 8))
  assert list(first) == [1, 1, 3] and list(last) == [2, 4, 5]


def test_gpu_blocks_are_powers_of_two_of_at_least_16():
  assert [gpu_block(128, d) for d in (1, 16, 20, 96, 128, 1000)] == [16, 16, 32, 128, 128, 128]
  assert gpu_block(8, 21) == 16 and gpu_block(100, 300) == 128


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_are_ragged_dots(impl):
  lhs, rhs, sizes = _operands(LAYOUTS["straddling"], seed=1)
  dy = jnp.asarray(np.random.default_rng(2).normal(size=(21, N)).astype(np.float32))

  def loss(impl):
    return lambda a, b: jnp.sum(
      grouped_matmul(a, b, sizes, impl=impl, block=(8, 8), interpret=True) * dy
    )

  got = jax.grad(loss(impl), argnums=(0, 1))(lhs, rhs)
  want = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes) * dy), argnums=(0, 1))(
    lhs, rhs
  )
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_and_errors(impl):
  lhs, rhs, sizes = _operands(LAYOUTS["straddling"], dtype=jnp.bfloat16)
  got = grouped_matmul(lhs, rhs, sizes, impl=impl, block=(8, 8), interpret=True)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(reference(lhs, rhs, sizes), np.float32), rtol=2e-2,
    atol=2e-2,
  )  # fmt: skip
  assert resolve_impl("auto") == "tiled"  # on this CPU
  with pytest.raises(ValueError, match="impl must be one of"):
    grouped_matmul(lhs, rhs, sizes, impl="triton")
  with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[E, K, N\]"):
    grouped_matmul(lhs[:, :3], rhs, sizes)
  with pytest.raises(ValueError, match=r"group_sizes must be \[E=4\] integers"):
    grouped_matmul(lhs, rhs, sizes[:3])
