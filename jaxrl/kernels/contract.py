"""Weight contractions as the CPU and accelerator matmul units like them.

`jnp.einsum("BTNH,NHD->BTD", x, w)` lowers to a dot_general contracting (H, N), not (N, H): XLA
then transposes the weight into [H, N, D] before every call (on a CPU a full copy of the o
projection's weight at each decode step, and at each training forward). `contract` emits the
same product with the contracted axes in the order the weight stores them, so a row-major
weight is read in place as one [N * H, D] matrix.

When `x`'s contracted axes are its trailing ones and `w`'s its leading ones (every projection of
the transformer: `BTD,DNH->BTNH`, `BTNH,NHD->BTD`, `BTD,DF->BTF`, ...), the product is emitted as
one 2-D `lax.dot` of `x` as [B * T, K] by `w` as [K, N]. The FLOPs are the same; what changes is
the backward. With the batch axes kept apart, the weight gradient `BTD,BTF->DF` contracts two
axes, and XLA:CPU lays its operand out feature-major for it: the elementwise gradient that feeds
it (e.g. SiLU's) becomes a transposing copy that reads three [B*T, F] arrays with a stride of F,
a third of a small model's train step on a 2-core Xeon (`docs/benchmarks.md`, "Where jaxrl's
train step goes"). As a 2-D dot the weight gradient is a transposed-LHS matmul that the CPU's
GEMM takes as it is. Merging the leading axes is free for a row-major array, and a sharding over
the batch axis (the major one) carries through the merge.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def contract(eq: str, x: jax.Array, w: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """`jnp.einsum(eq, x, w)` for a two-operand equation without batch axes (every index of `w`
  either contracted with `x` or kept in the output), contracting in `w`'s axis order; a 2-D dot
  when `x` ends with and `w` starts with the contracted axes."""
  ins, out = eq.split("->")
  xs, ws = ins.split(",")
  contracted = [c for c in ws if c in xs]
  if any(c in out for c in contracted) or len(set(xs)) != len(xs) or len(set(ws)) != len(ws):
    return jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type)
  n = len(contracted)
  lead = [c for c in xs if c not in contracted]
  kept = [c for c in ws if c not in contracted]
  trailing = list(xs[len(xs) - n :]) == contracted
  if n and trailing and list(ws[:n]) == contracted and lead + kept == list(out):
    k = math.prod(w.shape[:n])
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    y = jax.lax.dot(x2, w2, preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[: len(lead)], *w.shape[n:])
  dims = (([xs.index(c) for c in contracted], [ws.index(c) for c in contracted]), ((), ()))
  y = jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)
  got = lead + kept
  if got != list(out):
    y = jnp.transpose(y, [got.index(c) for c in out])
  return y
