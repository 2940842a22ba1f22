"""Weight contractions with the contracted axes in the weight's own order.

`jnp.einsum("BTNH,NHD->BTD", x, w)` lowers to a dot_general contracting (H, N), not (N, H): XLA
then transposes the weight into [H, N, D] before every call (on a CPU a full copy of the o
projection's weight at each decode step, and at each training forward). `contract` emits the
same product with the contracted axes in the order the weight stores them, so a row-major
weight is read in place as one [N * H, D] matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def contract(eq: str, x: jax.Array, w: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """`jnp.einsum(eq, x, w)` for a two-operand equation without batch axes (every index of `w`
  either contracted with `x` or kept in the output), contracting in `w`'s axis order."""
  ins, out = eq.split("->")
  xs, ws = ins.split(",")
  contracted = [c for c in ws if c in xs]
  if any(c in out for c in contracted) or len(set(xs)) != len(xs) or len(set(ws)) != len(ws):
    return jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type)
  dims = (([xs.index(c) for c in contracted], [ws.index(c) for c in contracted]), ((), ()))
  y = jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)
  got = [c for c in xs if c not in contracted] + [c for c in ws if c not in contracted]
  if got != list(out):
    y = jnp.transpose(y, [got.index(c) for c in out])
  return y
