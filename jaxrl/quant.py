"""int8 quantization for rollouts: a quantized-array pytree, W8A8 einsums, quantize-on-sync."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.kernels.contract import contract

_QMAX = 127.0  # symmetric int8: -128 is never used, so negation stays exact
QUANT_MODES = ("int8",)

# Dense projection weights by (module, name): the number of leading contracted (input) axes.
# o [N, H, D] contracts two; q, k, v [D, *, H], gate, up [D, F] and down [F, D] contract one.
_PROJECTIONS = {
  ("attn", "q"): 1,
  ("attn", "k"): 1,
  ("attn", "v"): 1,
  ("attn", "o"): 2,
  ("mlp", "gate"): 1,
  ("mlp", "up"): 1,
  ("mlp", "down"): 1,
}


class QArray(NamedTuple):
  """A weight W [*in, *out] as int8 values and one float32 scale per output channel.

  W ~= values * scale, scale broadcasting over the leading input axes.
  """

  values: jax.Array  # int8, W's shape
  scale: jax.Array  # float32, W's output axes

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def in_ndim(self) -> int:
    return self.values.ndim - self.scale.ndim


def _symmetric_int8(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(int8 values, float32 scale with `axes` kept as size 1): scale = max|x| over axes / 127."""
  x32 = x.astype(jnp.float32)
  # Times 1 / 127 rather than / 127: XLA rewrites a division by a constant into that product
  # anyway, so this spells out the rounding every backend (and the numpy tests) reproduces.
  scale = jnp.max(jnp.abs(x32), axis=axes, keepdims=True) * (1.0 / _QMAX)
  # An all-zero slice has scale 0: divide by 1 there so its values are 0, not NaN.
  safe = jnp.where(scale > 0, scale, 1.0)
  values = jnp.clip(jnp.round(x32 / safe), -_QMAX, _QMAX).astype(jnp.int8)
  return values, scale


def quantize_int8(w: jax.Array, in_ndim: int) -> QArray:
  """Per-output-channel symmetric int8 of W [*in, *out], whose first `in_ndim` axes are input."""
  if not 0 < in_ndim < w.ndim:
    raise ValueError(f"in_ndim must be in [1, {w.ndim - 1}] for a weight of shape {w.shape}")
  values, scale = _symmetric_int8(w, tuple(range(in_ndim)))
  return QArray(values, scale.reshape(w.shape[in_ndim:]))


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """values * scale as `dtype`: the reference for what the int8 path approximates."""
  return (q.values.astype(jnp.float32) * q.scale).astype(dtype)


def quantize_activations(x: jax.Array, contracted_axes) -> tuple[jax.Array, jax.Array]:
  """Dynamic per-row symmetric int8 of x over its `contracted_axes`.

  Returns (int8 values, x's shape; float32 scale, x's shape without the contracted axes).
  """
  axes = tuple(a % x.ndim for a in contracted_axes)
  values, scale = _symmetric_int8(x, axes)
  return values, jnp.squeeze(scale, axes)


def _parse(eq: str) -> tuple[str, str, str, str, str]:
  """(x spec, w spec, out spec, contracted, kept) of a two-operand projection einsum."""
  ins, out = eq.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  contracted = "".join(c for c in ws if c in xs)
  kept = "".join(c for c in ws if c not in xs)
  lead = "".join(c for c in xs if c not in ws)
  if ws != contracted + kept or out != lead + kept:
    raise ValueError(
      f"int8_einsum wants 'x,W->out' with W = [*contracted, *kept] and out = [*x lead, *kept], "
      f"got {eq!r}"
    )
  return xs, ws, out, contracted, kept


def int8_einsum(eq: str, x: jax.Array, q: QArray) -> jax.Array:
  """W8A8 `einsum(eq, x, W)`: x quantized per row, int8 x int8 -> int32, then rescaled.

  eq is one of project()'s einsums ("BTD,DNH->BTNH", "BTNH,NHD->BTD", "BTD,DF->BTF", ...).
  On CPU XLA lowers the int8 einsum to an integer dot that is ~1.8x the speed of the float32
  one at decode shapes, whereas converting int8 weights to float inside jit materialises them
  (slower than float32): hence both operands int8, never weight-only dequantization.
  Returns x.dtype.
  """
  xs, _, _, contracted, kept = _parse(eq)
  if len(contracted) != q.in_ndim:
    raise ValueError(
      f"{eq!r} contracts {len(contracted)} axes but the weight has {q.in_ndim} input axes"
    )
  xq, x_scale = quantize_activations(x, tuple(xs.index(c) for c in contracted))
  acc = contract(eq, xq, q.values, preferred_element_type=jnp.int32)  # out = [*lead, *kept]
  x_scale = x_scale.reshape(x_scale.shape + (1,) * len(kept))
  # Unlike a float dot's output, this elementwise rescale fuses into its consumer (XLA CPU may
  # contract it with a residual add into an FMA), so its last-ulp rounding can depend on the
  # surrounding program.
  return (acc.astype(jnp.float32) * x_scale * q.scale).astype(x.dtype)


def _quantized_leaves(flat) -> dict:
  """{path: in_ndim} of the leaves `quantize_params` turns into QArrays."""
  # MoE layers keep a router beside their gate/up/down expert stacks: those stay float.
  moe = {path[:-1] for path, _ in flat if path[-1] == "router"}
  out = {}
  for path, v in flat:
    in_ndim = _PROJECTIONS.get(tuple(path[-2:]))
    if (
      in_ndim is not None
      and type(v) is nnx.Param
      and path[:-1] not in moe
      and not isinstance(v.get_value(), QArray)
    ):
      out[path] = in_ndim
  return out


def quantize_params(params: nnx.State, mode: str = "int8") -> nnx.State:
  """Quantize-on-sync: the param State with each dense projection weight made a `QArray`.

  Quantized: attention q, k, v, o and the dense MLP's gate, up, down (per output channel), which
  `jaxrl.models.linear.project` then runs as W8A8 (`int8_einsum`). Left as they are: the
  embedding and head, norms, q/k/v biases, LoRA adapters (nnx.LoRAParam: project applies them in
  float, so for a LoRA policy only the frozen base is quantized) and MoE router and expert
  weights (they go through ragged_dot, which has no int8 path here). Pure and jittable; but a
  jitted call returns fresh copies of the leaves it leaves alone, so the RL loop uses
  `Quantizer`, which passes those through as the very same arrays. Use with the same graphdef:
  `nnx.merge(graphdef, quantize_params(params))`.
  """
  if mode not in QUANT_MODES:
    raise ValueError(f"quantize_params: unknown mode {mode!r}; allowed modes: {QUANT_MODES}")
  flat = nnx.to_flat_state(params)
  todo = _quantized_leaves(flat)
  out = {}
  for path, v in flat:
    if path in todo:
      v = v.replace(quantize_int8(v.get_value(), todo[path]))
    out[path] = v
  return nnx.from_flat_state(out)


class Quantizer:
  """`quantize_params` for the sampler's sync: one jitted call over the projection weights only.

  Every other leaf (embedding, head, norms, biases, LoRA adapters, MoE weights) is the learner's
  own array in the result, not a copy, so a sync moves only the int8 values and scales: about a
  quarter of the projection weights' float32 bytes, nothing for the rest.
  """

  def __init__(self, mode: str = "int8"):
    if mode not in QUANT_MODES:
      raise ValueError(f"Quantizer: unknown mode {mode!r}; allowed modes: {QUANT_MODES}")
    self.mode = mode
    self._jitted = {}  # tuple of (path, in_ndim) -> the jitted quantizer of those weights

  def __call__(self, params: nnx.State) -> nnx.State:
    flat = nnx.to_flat_state(params)
    todo = _quantized_leaves(flat)
    key = tuple(todo.items())
    if key not in self._jitted:
      dims = [d for _, d in key]

      def quantize_all(ws):
        return [quantize_int8(w, d) for w, d in zip(ws, dims, strict=True)]

      self._jitted[key] = jax.jit(quantize_all)
    by_path = dict(flat)
    qs = self._jitted[key]([by_path[path].get_value() for path, _ in key])
    out = dict(flat)
    for (path, _), q in zip(key, qs, strict=True):
      out[path] = by_path[path].replace(q)
    return nnx.from_flat_state(out)
