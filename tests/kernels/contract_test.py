"""`contract`: the einsum it stands for, in value and gradient, and the dot it emits.

The projections of the transformer take the 2-D path (leading axes merged into rows); the
backward of a 2-D dot is a pair of 2-D dots, which is what removes the transposing copies of the
weight gradients (`docs/benchmarks.md`). Equations that do not fit fall back to one dot_general.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.contract import contract

CASES = [  # (equation, x shape, w shape, takes the 2-D path)
  ("BTD,DF->BTF", (3, 5, 8), (8, 6), True),  # MLP in
  ("BTD,DNH->BTNH", (3, 5, 8), (8, 4, 2), True),  # q projection
  ("BTNH,NHD->BTD", (3, 5, 4, 2), (4, 2, 8), True),  # o projection: two contracted axes
  ("BD,DV->BV", (3, 8), (8, 7), True),  # already 2-D
  ("BTD,VD->BTV", (3, 5, 8), (7, 8), False),  # tied unembedding: w contracts its last axis
  ("BTNH,HND->BTD", (3, 5, 4, 2), (2, 4, 8), False),  # x's contracted axes in the other order
  ("BTD,DF->BFT", (3, 5, 8), (8, 6), False),  # output not in [lead, kept] order
]


def _operands(xshape, wshape, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=xshape).astype(np.float32), rng.normal(size=wshape).astype(np.float32)


@pytest.mark.parametrize("eq, xshape, wshape, flat", CASES)
def test_contract_equals_the_numpy_einsum(eq, xshape, wshape, flat):
  x, w = _operands(xshape, wshape)
  got = contract(eq, jnp.asarray(x), jnp.asarray(w))
  want = np.einsum(eq.lower(), x.astype(np.float64), w.astype(np.float64))
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eq, xshape, wshape, flat", CASES)
def test_contract_gradients_equal_the_einsum_gradients(eq, xshape, wshape, flat):
  x, w = map(jnp.asarray, _operands(xshape, wshape))
  ct = jnp.asarray(np.random.default_rng(1).normal(size=jnp.einsum(eq, x, w).shape), jnp.float32)

  def loss(f):
    return lambda x, w: jnp.sum(f(eq, x, w) * ct)

  got = jax.grad(loss(contract), argnums=(0, 1))(x, w)
  want = jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, w)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def _dots(f, *args):
  jaxpr = jax.make_jaxpr(f)(*args).jaxpr
  return [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("eq, xshape, wshape, flat", CASES)
def test_projections_are_one_2d_dot_in_the_forward_and_the_backward(eq, xshape, wshape, flat):
  x, w = map(jnp.asarray, _operands(xshape, wshape))
  (fwd,) = _dots(lambda x, w: contract(eq, x, w), x, w)
  ranks = [v.aval.ndim for v in fwd.invars]
  assert (ranks == [2, 2]) == flat, (eq, ranks)
  assert len(fwd.params["dimension_numbers"][0][0]) == 1 or not flat
  bwd = _dots(jax.grad(lambda x, w: jnp.sum(contract(eq, x, w) ** 2), argnums=(0, 1)), x, w)
  assert len(bwd) == 3  # the forward, and one dot per operand's gradient
  if flat:  # each gradient contracts one axis of two 2-D operands: no multi-axis weight gradient
    for e in bwd:
      assert [v.aval.ndim for v in e.invars] == [2, 2]
      assert len(e.params["dimension_numbers"][0][0]) == 1


def test_integer_accumulation_is_kept_on_the_2d_path():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.integers(-127, 128, size=(2, 3, 8)), jnp.int8)
  w = jnp.asarray(rng.integers(-127, 128, size=(8, 5)), jnp.int8)
  got = contract("BTD,DF->BTF", x, w, preferred_element_type=jnp.int32)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(
    np.asarray(got), np.einsum("btd,df->btf", np.asarray(x, np.int64), np.asarray(w, np.int64))
  )
