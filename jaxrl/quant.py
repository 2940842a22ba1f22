"""Quantization for rollouts: quantized-array pytrees (int8, fp8 per channel or in blocks),
W8A8 einsums, quantize-on-sync.

Modes (`QUANT_MODES`, config rl.rollout.quantize):
  int8       symmetric int8 per output channel, activations per row; int8 x int8 -> int32
  fp8        float8_e4m3fn per output channel, activations per row; fp8 x fp8 -> float32
  fp8_e5m2   the same in float8_e5m2 (more range, one mantissa bit less)
  fp8_block  float8_e4m3fn in 128 x 128 weight blocks and 1 x 128 activation groups (the
             recipe of "DeepSeek-V3 Technical Report", arXiv 2412.19437): an outlier only
             coarsens its own block
  fp4        (research) microscaled float4_e2m1fn: a scale per 16 consecutive input elements of
             each weight column and of each activation row, NVFP4's block layout with the
             scales kept in float32; no backend here has fp4 dots, so both operands are upcast
             to float32 before the dot (accuracy studies, not speed)
  nvfp4      (research) fp4 as NVIDIA's NVFP4 stores it: the same e2m1 values and 16-input
             blocks, each block scale itself a float8_e4m3fn, times one float32 scale per
             weight (per token for activations) that brings the block scales into e4m3's range;
             the scales' own rounding (3 mantissa bits) adds to the error of fp4
fp8 values saturate: the scale maps a slice's largest magnitude to the format's largest finite
value and the scaled values are clipped there before the cast, so no input (however large)
becomes inf or NaN (a float8_e4m3fn cast of anything past 448 is NaN). fp8 dots run on any
backend; where the hardware has no fp8 units (CPUs) XLA upcasts them, which costs speed only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.kernels.contract import contract
from jaxrl.kernels.partition import kernel_mesh, matmul_split, sharded_matmul
from jaxrl.kernels.quant_matmul import quant_matmul, resolve_impl

_QMAX = 127.0  # symmetric int8: -128 is never used, so negation stays exact
QUANT_MODES = ("int8", "fp8", "fp8_e5m2", "fp8_block", "fp4", "nvfp4")
# mode -> (value dtype, weight block (input edge, output edge); None = per output channel).
_MODES = {
  "int8": (jnp.int8, None),
  "fp8": (jnp.float8_e4m3fn, None),
  "fp8_e5m2": (jnp.float8_e5m2, None),
  "fp8_block": (jnp.float8_e4m3fn, (128, 128)),
  "fp4": (jnp.float4_e2m1fn, (16, 1)),
  "nvfp4": (jnp.float4_e2m1fn, (16, 1)),
}
# Modes whose block scales are themselves stored in a narrow float, under a float32 scale per
# weight (per row of activations): mode -> the block scales' dtype.
_SCALE_DTYPES = {"nvfp4": jnp.float8_e4m3fn}
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
FP4_DTYPES = (jnp.float4_e2m1fn,)

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
  """A weight W [*in, *out] as int8 or fp8 values and one float32 scale per output channel.

  W ~= values * scale, scale broadcasting over the leading input axes.
  """

  values: jax.Array  # int8 / float8_*, W's shape
  scale: jax.Array  # float32, W's output axes

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def in_ndim(self) -> int:
    return self.values.ndim - self.scale.ndim


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=("values", "scale", "tensor_scale"),
  meta_fields=("block", "in_ndim"),
)
@dataclasses.dataclass(frozen=True)
class BlockQArray:
  """A weight W [*in, *out] in blocks: W viewed as a [K, N] matrix (K = prod(in), N =
  prod(out)) is cut into block[0] x block[1] tiles (the last ones short where the edges do not
  divide), each with its own scale: W[k, n] ~= values[k, n] * scale[k // bk, n // bn], times
  `tensor_scale` where the block scales are stored narrow (nvfp4: e4m3 block scales)."""

  values: jax.Array  # fp8 / fp4 (or int8), W's shape
  scale: jax.Array  # float32 (or e4m3 under a tensor_scale) [ceil(K / bk), ceil(N / bn)]
  block: tuple[int, int]
  in_ndim: int
  tensor_scale: jax.Array | None = None  # float32 [] with narrow block scales, else None

  def block_scales(self) -> jax.Array:
    """The float32 scale of each block, tensor scale included."""
    scale = self.scale.astype(jnp.float32)
    return scale if self.tensor_scale is None else scale * self.tensor_scale

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape


def _qmax(dtype) -> float:
  """The largest magnitude a value of `dtype` holds: 127 (int8, kept symmetric) or the float
  format's largest finite value (448 for e4m3fn, 57344 for e5m2, 6 for e2m1fn)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:
    return _QMAX
  if dtype not in FP8_DTYPES + FP4_DTYPES:
    raise ValueError(
      f"quantized values must be int8 or one of {FP8_DTYPES + FP4_DTYPES}, got {dtype}"
    )
  return float(jnp.finfo(dtype).max)


def _symmetric(x: jax.Array, axes: tuple[int, ...], dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
  """(values of `dtype`, float32 scale with `axes` kept as size 1): scale = max|x| over axes /
  the format's largest value; int8 rounds to nearest, fp8 to nearest even (the cast)."""
  qmax = _qmax(dtype)
  x32 = x.astype(jnp.float32)
  # Times 1 / qmax rather than / qmax: XLA rewrites a division by a constant into that product
  # anyway, so this spells out the rounding every backend (and the numpy tests) reproduces.
  scale = jnp.max(jnp.abs(x32), axis=axes, keepdims=True) * (1.0 / qmax)
  # An all-zero slice has scale 0: divide by 1 there so its values are 0, not NaN.
  safe = jnp.where(scale > 0, scale, 1.0)
  scaled = x32 / safe
  if jnp.dtype(dtype) == jnp.int8:
    scaled = jnp.round(scaled)
  # The largest element can land a rounding past qmax: clipped, never cast to inf / NaN.
  values = jnp.clip(scaled, -qmax, qmax).astype(dtype)
  return values, scale


def _two_level(
  x: jax.Array, axes: tuple[int, ...], outer_axes: tuple[int, ...], dtype, scale_dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """NVFP4-style scaling of x: (values of `dtype`, block scales of `scale_dtype` with `axes`
  kept as size 1, float32 outer scale with `outer_axes` (a superset of `axes`) kept). The outer
  scale maps x's largest magnitude over `outer_axes` to qmax(dtype) * qmax(scale_dtype), so the
  largest block's scale is the scale format's largest value; each block scale (its max / qmax,
  in outer-scale units) is then rounded to `scale_dtype`, and the values divided by the rounded
  product, clipped (a block scale that rounded down saturates its largest value) and cast."""
  qmax, smax = _qmax(dtype), _qmax(scale_dtype)
  x32 = x.astype(jnp.float32)
  mag = jnp.abs(x32)
  outer = jnp.max(mag, axis=outer_axes, keepdims=True) * (1.0 / (qmax * smax))
  outer_safe = jnp.where(outer > 0, outer, 1.0)
  ratio = jnp.max(mag, axis=axes, keepdims=True) * (1.0 / qmax) / outer_safe
  block = jnp.clip(ratio, 0.0, smax).astype(scale_dtype)
  eff = block.astype(jnp.float32) * outer_safe
  safe = jnp.where(eff > 0, eff, 1.0)
  values = jnp.clip(x32 / safe, -qmax, qmax).astype(dtype)
  return values, block, outer


def _symmetric_int8(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  return _symmetric(x, axes, jnp.int8)


def quantize(w: jax.Array, in_ndim: int, dtype=jnp.int8) -> QArray:
  """Per-output-channel symmetric quantization of W [*in, *out] (the first `in_ndim` axes are
  input) to int8 or an fp8 dtype."""
  if not 0 < in_ndim < w.ndim:
    raise ValueError(f"in_ndim must be in [1, {w.ndim - 1}] for a weight of shape {w.shape}")
  values, scale = _symmetric(w, tuple(range(in_ndim)), dtype)
  return QArray(values, scale.reshape(w.shape[in_ndim:]))


def quantize_int8(w: jax.Array, in_ndim: int) -> QArray:
  """Per-output-channel symmetric int8 of W [*in, *out], whose first `in_ndim` axes are input."""
  return quantize(w, in_ndim, jnp.int8)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def quantize_blocks(
  w: jax.Array,
  in_ndim: int,
  dtype=jnp.float8_e4m3fn,
  block: tuple[int, int] = (128, 128),
  scale_dtype=None,
) -> BlockQArray:
  """Blockwise symmetric quantization of W [*in, *out] seen as [K, N]: one scale per
  block[0] x block[1] tile (edge tiles are short; a block edge past the matrix's is the whole
  edge). With `scale_dtype` the block scales are stored in it under one float32 tensor scale
  (`_two_level`, NVFP4's layout)."""
  if not 0 < in_ndim < w.ndim:
    raise ValueError(f"in_ndim must be in [1, {w.ndim - 1}] for a weight of shape {w.shape}")
  if len(block) != 2 or min(block) < 1:
    raise ValueError(f"block must be two positive ints, got {block!r}")
  k, n = math.prod(w.shape[:in_ndim]), math.prod(w.shape[in_ndim:])
  bk, bn = min(int(block[0]), k), min(int(block[1]), n)
  w2 = _pad_to(_pad_to(w.reshape(k, n), 0, bk), 1, bn)  # zeros never raise a block's max
  gk, gn = w2.shape[0] // bk, w2.shape[1] // bn
  tiles = w2.reshape(gk, bk, gn, bn)
  tensor_scale = None
  if scale_dtype is None:
    values, scale = _symmetric(tiles, (1, 3), dtype)
  else:
    values, scale, tensor_scale = _two_level(tiles, (1, 3), (0, 1, 2, 3), dtype, scale_dtype)
    tensor_scale = tensor_scale.reshape(())
  values = values.reshape(gk * bk, gn * bn)[:k, :n].reshape(w.shape)
  return BlockQArray(values, scale.reshape(gk, gn), (bk, bn), in_ndim, tensor_scale)


def dequantize(q: QArray | BlockQArray, dtype=jnp.float32) -> jax.Array:
  """values * scale as `dtype`: the reference for what the quantized path approximates."""
  if isinstance(q, BlockQArray):
    bk, bn = q.block
    k, n = math.prod(q.shape[: q.in_ndim]), math.prod(q.shape[q.in_ndim :])
    scale = jnp.repeat(jnp.repeat(q.block_scales(), bk, axis=0)[:k], bn, axis=1)[:, :n]
    w = q.values.astype(jnp.float32).reshape(k, n) * scale
    return w.reshape(q.shape).astype(dtype)
  return (q.values.astype(jnp.float32) * q.scale).astype(dtype)


def quantize_activations(
  x: jax.Array, contracted_axes, dtype=jnp.int8
) -> tuple[jax.Array, jax.Array]:
  """Dynamic per-row symmetric quantization of x over its `contracted_axes` (int8 or fp8).

  Returns (values, x's shape; float32 scale, x's shape without the contracted axes).
  """
  axes = tuple(a % x.ndim for a in contracted_axes)
  values, scale = _symmetric(x, axes, dtype)
  _count_underflow(x, values)
  return values, jnp.squeeze(scale, axes)


def quantize_activation_groups(
  x: jax.Array, group: int, dtype=jnp.float8_e4m3fn, scale_dtype=None
) -> tuple[jax.Array, jax.Array]:
  """Dynamic symmetric quantization of x [..., K] in groups of `group` along its last axis
  (the last group short when it does not divide): (values [..., K], float32 scale
  [..., ceil(K / group)]). With `scale_dtype` (nvfp4) each group's scale is rounded to it
  under a float32 scale per row (`_two_level`; per token, so a token's numerics do not depend
  on what else is in the batch), and the scale returned is their float32 product."""
  k = x.shape[-1]
  g = min(group, k)
  xp = _pad_to(x, x.ndim - 1, g)
  tiles = xp.reshape(*x.shape[:-1], xp.shape[-1] // g, g)
  if scale_dtype is None:
    values, scale = _symmetric(tiles, (tiles.ndim - 1,), dtype)
  else:
    row = (tiles.ndim - 2, tiles.ndim - 1)
    values, block, outer = _two_level(tiles, (tiles.ndim - 1,), row, dtype, scale_dtype)
    scale = block.astype(jnp.float32) * jnp.where(outer > 0, outer, 1.0)
  values = values.reshape(xp.shape)[..., :k]
  _count_underflow(x, values)
  return values, scale[..., 0]


class UnderflowCounter:
  """Counts the activations a quantized forward rounds to zero although they are not zero (the
  mismatch monitor's underflow count): int8 loses every |x| under half its row's step, fp8
  what falls below its smallest subnormal after scaling.

  Functions traced inside `tracing()` (under jit: at their first call) report, at every call,
  each activation quantization's count through a host callback; `read()` returns the totals
  since the last read, (zeroed, nonzero). With a token mask ([B, T] bool) given to `tracing`,
  only the activations of real tokens count (projections whose input starts with [B, T], or
  [B * T] rows).
  """

  _active: UnderflowCounter | None = None

  def __init__(self):
    self.zeroed = self.nonzero = 0
    self.mask = None

  @contextlib.contextmanager
  def tracing(self, mask=None):
    previous, UnderflowCounter._active = UnderflowCounter._active, self
    self.mask = mask
    try:
      yield self
    finally:
      UnderflowCounter._active, self.mask = previous, None

  def _add(self, zeroed, nonzero) -> None:
    self.zeroed += int(zeroed)
    self.nonzero += int(nonzero)

  def read(self) -> tuple[int, int]:
    jax.effects_barrier()  # every callback of the calls so far has run
    out = (self.zeroed, self.nonzero)
    self.zeroed = self.nonzero = 0
    return out


def _count_underflow(x: jax.Array, values: jax.Array) -> None:
  counter = UnderflowCounter._active
  if counter is None:
    return
  nonzero = x != 0
  m = counter.mask
  if m is not None:
    if x.shape[: m.ndim] == m.shape:
      nonzero = nonzero & m.reshape(m.shape + (1,) * (x.ndim - m.ndim))
    elif x.shape[0] == m.size:
      nonzero = nonzero & m.reshape((m.size,) + (1,) * (x.ndim - 1))
  zeroed = jnp.sum(nonzero & (values == 0), dtype=jnp.int32)
  jax.debug.callback(counter._add, zeroed, jnp.sum(nonzero, dtype=jnp.int32))


def _parse(eq: str) -> tuple[str, str, str, str, str]:
  """(x spec, w spec, out spec, contracted, kept) of a two-operand projection einsum."""
  ins, out = eq.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  contracted = "".join(c for c in ws if c in xs)
  kept = "".join(c for c in ws if c not in xs)
  lead = "".join(c for c in xs if c not in ws)
  if ws != contracted + kept or out != lead + kept:
    raise ValueError(
      "quantized_einsum wants 'x,W->out' with W = [*contracted, *kept] and out = "
      f"[*x lead, *kept], got {eq!r}"
    )
  return xs, ws, out, contracted, kept


def quantized_einsum(
  eq: str,
  x: jax.Array,
  q: QArray | BlockQArray,
  *,
  impl: str = "reference",
  interpret: bool = False,
  w_axes: tuple[str | None, ...] | None = None,
) -> jax.Array:
  """W8A8 `einsum(eq, x, W)`: x quantized like W (per row for a per-channel W, in groups of
  the block's K edge for a `BlockQArray`), the dot in the quantized dtype (int8 -> int32
  accumulation, fp8 -> float32), then rescaled. Returns x.dtype.

  `impl` picks the per-channel product: "reference" (the einsum below) or a Pallas kernel of
  `jaxrl.kernels.quant_matmul` ("auto", "pallas_tpu", "pallas_gpu"; `interpret` runs it
  through the Pallas interpreter), which takes x as [M, K] codes and W as [K, N]. Block-scaled
  weights have no kernel yet: "auto" runs their reference, a named kernel is an error. On a
  mesh of several devices the kernel runs per shard of W (`jaxrl.kernels.partition`), split as
  the active rules place W's logical axes `w_axes` (whole when None).

  eq is one of project()'s einsums ("BTD,DNH->BTNH", "BTNH,NHD->BTD", "BTD,DF->BTF", ...).
  On CPU XLA lowers the int8 einsum to an integer dot that is ~1.8x the speed of the float32
  one at decode shapes, whereas converting int8 weights to float inside jit materialises them
  (slower than float32): hence both operands quantized, never weight-only dequantization.
  """
  xs, _, _, contracted, kept = _parse(eq)
  if len(contracted) != q.in_ndim:
    raise ValueError(
      f"{eq!r} contracts {len(contracted)} axes but the weight has {q.in_ndim} input axes"
    )
  if isinstance(q, BlockQArray):
    if impl not in ("reference", "auto"):
      raise ValueError(
        f"block-scaled weights ({q.values.dtype}, blocks {q.block}) have no quantized-matmul "
        f"kernel; matmul kernel {impl!r} needs a per-channel mode (int8, fp8, fp8_e5m2)"
      )
    return _block_einsum(xs, contracted, x, q)
  dtype = q.values.dtype
  acc_type = jnp.int32 if dtype == jnp.int8 else jnp.float32
  xq, x_scale = quantize_activations(x, tuple(xs.index(c) for c in contracted), dtype)
  if impl != "reference":
    n_in = len(contracted)
    if xs[len(xs) - n_in :] != contracted:
      raise ValueError(f"the quantized-matmul kernel needs x's contracted axes last, got {eq!r}")
    lead_shape, k = x.shape[: x.ndim - n_in], math.prod(q.shape[:n_in])
    mm = functools.partial(quant_matmul, impl=impl, interpret=interpret)
    args = (xq.reshape(-1, k), q.values.reshape(k, -1), q.scale.reshape(-1), x_scale.reshape(-1))
    mesh = kernel_mesh() if resolve_impl(impl) != "reference" else None  # "auto" on a CPU
    if mesh is None:
      y = mm(*args)
    else:
      y = sharded_matmul(mm, mesh, *matmul_split(mesh, w_axes, q.shape, n_in), *args)
    return y.reshape(*lead_shape, *q.shape[n_in:]).astype(x.dtype)
  acc = contract(eq, xq, q.values, preferred_element_type=acc_type)  # out = [*lead, *kept]
  x_scale = x_scale.reshape(x_scale.shape + (1,) * len(kept))
  # Unlike a float dot's output, this elementwise rescale fuses into its consumer (XLA CPU may
  # contract it with a residual add into an FMA), so its last-ulp rounding can depend on the
  # surrounding program.
  return (acc.astype(jnp.float32) * x_scale * q.scale).astype(x.dtype)


def int8_einsum(eq: str, x: jax.Array, q: QArray) -> jax.Array:
  """`quantized_einsum` of an int8 weight (int8 x int8 -> int32)."""
  if q.values.dtype != jnp.int8:
    raise ValueError(f"int8_einsum got a {q.values.dtype} weight; use quantized_einsum")
  return quantized_einsum(eq, x, q)


def _block_einsum(xs: str, contracted: str, x: jax.Array, q: BlockQArray) -> jax.Array:
  """The blockwise W8A8 product, the jnp reference a grouped fp8 kernel tiles: x's K axis in
  groups of bk, each group's partial dot [M, N] scaled by its activation scale and its row of
  weight-block scales, summed over the groups."""
  n_in = len(contracted)
  if xs[len(xs) - n_in :] != contracted:
    raise ValueError(f"a block-quantized weight needs x's contracted axes last, got {xs!r}")
  bk, bn = q.block
  lead = x.shape[: x.ndim - n_in]
  k, n = math.prod(q.shape[:n_in]), math.prod(q.shape[n_in:])
  gk, gn = q.scale.shape
  scale_dtype = None if q.tensor_scale is None else q.scale.dtype
  xq, x_scale = quantize_activation_groups(x.reshape(-1, k), bk, q.values.dtype, scale_dtype)
  xq = _pad_to(xq, 1, bk).reshape(-1, gk, bk)
  wq = _pad_to(_pad_to(q.values.reshape(k, n), 0, bk), 1, bn).reshape(gk, bk, gn * bn)
  acc_type = jnp.int32 if q.values.dtype == jnp.int8 else jnp.float32
  if q.values.dtype in FP4_DTYPES:  # no fp4 dot on these backends: upcast (exactly) first
    xq, wq = xq.astype(jnp.float32), wq.astype(jnp.float32)
  part = jnp.einsum("mgk,gkn->mgn", xq, wq, preferred_element_type=acc_type)  # [M, gk, N']
  w_scale = jnp.repeat(q.block_scales(), bn, axis=1)  # [gk, N']
  y = jnp.sum(part.astype(jnp.float32) * x_scale[:, :, None] * w_scale[None], axis=1)
  return y[:, :n].reshape(*lead, *q.shape[n_in:]).astype(x.dtype)


def _map_projections(params: nnx.State, fn) -> nnx.State:
  """params with each leaf `_quantized_leaves` picks replaced by fn(weight, in_ndim)."""
  flat = nnx.to_flat_state(params)
  todo = _quantized_leaves(flat)
  out = {}
  for path, v in flat:
    out[path] = v.replace(fn(v.get_value(), todo[path])) if path in todo else v
  return nnx.from_flat_state(out)


def _quantized_leaves(flat) -> dict:
  """{path: in_ndim} of the leaves `quantize_params` quantizes."""
  # MoE layers keep a router beside their gate/up/down expert stacks: those stay float.
  moe = {path[:-1] for path, _ in flat if path[-1] == "router"}
  out = {}
  for path, v in flat:
    in_ndim = _PROJECTIONS.get(tuple(path[-2:]))
    if (
      in_ndim is not None
      and type(v) is nnx.Param
      and path[:-1] not in moe
      # a plain array: not one already quantized or wrapped (`jaxrl.fake_quant.FakeQuant`)
      and isinstance(v.get_value(), jax.Array | np.ndarray | jax.ShapeDtypeStruct)
    ):
      out[path] = in_ndim
  return out


def quantize_weight(w: jax.Array, in_ndim: int, mode: str) -> QArray | BlockQArray:
  """One projection weight quantized as `mode` (see the module docstring)."""
  if mode not in QUANT_MODES:
    raise ValueError(f"unknown quantization mode {mode!r}; allowed modes: {QUANT_MODES}")
  dtype, block = _MODES[mode]
  if block is None:
    return quantize(w, in_ndim, dtype)
  return quantize_blocks(w, in_ndim, dtype, block, _SCALE_DTYPES.get(mode))


def quantize_params(params: nnx.State, mode: str = "int8") -> nnx.State:
  """Quantize-on-sync: the param State with each dense projection weight quantized as `mode`
  (a `QArray`, or a `BlockQArray` for fp8_block).

  Quantized: attention q, k, v, o and the dense MLP's gate, up, down, which
  `jaxrl.models.linear.project` then runs as W8A8 (`quantized_einsum`). Left as they are: the
  embedding and head, norms, q/k/v biases, LoRA adapters (nnx.LoRAParam: project applies them in
  float, so for a LoRA policy only the frozen base is quantized) and MoE router and expert
  weights (they go through ragged_dot, which has no quantized path here). Pure and jittable; but a
  jitted call returns fresh copies of the leaves it leaves alone, so the RL loop uses
  `Quantizer`, which passes those through as the very same arrays. Use with the same graphdef:
  `nnx.merge(graphdef, quantize_params(params))`.
  """
  if mode not in QUANT_MODES:
    raise ValueError(f"quantize_params: unknown mode {mode!r}; allowed modes: {QUANT_MODES}")
  return _map_projections(params, lambda w, in_ndim: quantize_weight(w, in_ndim, mode))


class Quantizer:
  """`quantize_params` for the sampler's sync: one jitted call over the projection weights only.

  Every other leaf (embedding, head, norms, biases, LoRA adapters, MoE weights) is the learner's
  own array in the result, not a copy, so a sync moves only the 8-bit values and scales: about
  a quarter of the projection weights' float32 bytes, nothing for the rest. No full-precision
  copy is made: the learner's weights are read once, inside the one compiled call.
  """

  def __init__(self, mode: str = "int8"):
    if mode not in QUANT_MODES:
      raise ValueError(f"Quantizer: unknown mode {mode!r}; allowed modes: {QUANT_MODES}")
    self.mode = mode
    self._jitted = {}  # ((path, in_ndim) pairs, out shardings) -> the jitted quantizer

  def __call__(self, params: nnx.State) -> nnx.State:
    flat = nnx.to_flat_state(params)
    todo = _quantized_leaves(flat)
    by_path = dict(flat)
    ws = [by_path[path].get_value() for path in todo]
    dims = list(todo.values())
    shardings = tuple(quantized_sharding(w, d, self.mode) for w, d in zip(ws, dims, strict=True))
    key = (tuple(todo.items()), shardings)
    if key not in self._jitted:
      mode = self.mode

      def quantize_all(ws):
        return [quantize_weight(w, d, mode) for w, d in zip(ws, dims, strict=True)]

      out_shardings = None if None in shardings else list(shardings)
      self._jitted[key] = jax.jit(quantize_all, out_shardings=out_shardings)
    qs = self._jitted[key](ws)
    out = dict(flat)
    for path, q in zip(todo, qs, strict=True):
      out[path] = by_path[path].replace(q)
    return nnx.from_flat_state(out)


def quantized_sharding(w, in_ndim: int, mode: str):
  """The sharding of `quantize_weight(w, in_ndim, mode)` when `w` is laid out by a
  NamedSharding (else None): the values exactly as `w`; a per-channel scale as `w`'s output
  axes; a block scale (fp8_block: a [K / 128, N / 128] grid, a few hundred floats)
  replicated. So a quantized copy sits on the devices of the weight it replaces, as the rules
  laid that out. (fp4's [K / 16, N] grid, 1/16 of the weight's elements, is replicated too: a
  research mode, not sized for large models.)"""
  sharding = getattr(w, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
  if _MODES[mode][1] is None:
    scale = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[in_ndim:]))
    return QArray(sharding, scale)
  replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  bk, bn = _MODES[mode][1]
  k, n = math.prod(w.shape[:in_ndim]), math.prod(w.shape[in_ndim:])
  tensor_scale = replicated if mode in _SCALE_DTYPES else None
  return BlockQArray(sharding, replicated, (min(bk, k), min(bn, n)), in_ndim, tensor_scale)
