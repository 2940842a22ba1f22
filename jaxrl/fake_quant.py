"""Learner-side fake quantization: the learner's forward through the sampler's quantized path.

`fake_quant_params` wraps each weight `jaxrl.quant.quantize_params` would quantize as a
`FakeQuant`; the model's projections (`jaxrl.models.linear`) then run `fake_quant_einsum`: the
sampler's quant-dequant of the weight and the activations forward, the float einsum's gradient
backward (straight-through). The learner so scores tokens with the numerics that drew them,
quantization-aware RL ("QaRL"/"QUADS"-style); `part` rounds only the weights (QUADS's
asymmetric QAT) or only the activations.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.kernels.contract import contract
from jaxrl.quant import (
  _MODES,
  _SCALE_DTYPES,
  QUANT_MODES,
  _map_projections,
  _parse,
  dequantize,
  quantize_activation_groups,
  quantize_activations,
  quantize_weight,
  quantized_einsum,
)

FAKE_QUANT_PARTS = ("both", "weights", "activations")


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=("w",), meta_fields=("mode", "in_ndim", "part")
)
@dataclasses.dataclass(frozen=True)
class FakeQuant:
  """A float weight the learner's forward runs through the sampler's quantized path: the same
  `quantize_weight` and `quantized_einsum` (weight and activation quant-dequant), with
  straight-through gradients to the float weight and activation (the rounding is treated as the
  identity). Learner-side fake quantization, so the learner scores tokens with the numerics that
  drew them ("QaRL"/"QUADS"-style quantization-aware RL).

  `part` picks what is rounded: "both" (the sampler's W8A8 path), "weights" (the weight's
  quant-dequant with float activations: QUADS's asymmetric QAT, "QUADS", for W4A4 rollouts with
  a BF16 trainer) or "activations" (the activations' quant-dequant, as the sampler groups them,
  with the float weight): the last two split the sampler's error into its two sources.
  """

  w: jax.Array
  mode: str
  in_ndim: int
  part: str = "both"

  @property
  def shape(self) -> tuple[int, ...]:
    return self.w.shape


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def _fake_quant_einsum(eq, x, w, mode, in_ndim, part="both"):
  if part == "weights":
    w_hat = dequantize(quantize_weight(w, in_ndim, mode), x.dtype)
    return contract(eq, x, w_hat)
  if part == "activations":
    return contract(eq, dequantize_activations(eq, x, mode), w.astype(x.dtype))
  return quantized_einsum(eq, x, quantize_weight(w, in_ndim, mode))


def _fq_fwd(eq, x, w, mode, in_ndim, part="both"):
  return _fake_quant_einsum(eq, x, w, mode, in_ndim, part), (x, w)


def _fq_bwd(eq, mode, in_ndim, part, res, dy):
  del part
  x, w = res
  _, vjp = jax.vjp(lambda x, w: contract(eq, x, w.astype(x.dtype)), x, w)
  return vjp(dy.astype(x.dtype))


_fake_quant_einsum.defvjp(_fq_fwd, _fq_bwd)


def fake_quant_einsum(eq: str, x: jax.Array, fq: FakeQuant) -> jax.Array:
  """`quantized_einsum(eq, x, quantize_weight(fq.w))` forward (or only one operand rounded,
  `FakeQuant.part`); the float einsum's gradient."""
  return _fake_quant_einsum(eq, x, fq.w, fq.mode, fq.in_ndim, fq.part)


def dequantize_activations(eq: str, x: jax.Array, mode: str) -> jax.Array:
  """x quantized and dequantized as `quantized_einsum` quantizes it for a weight of `mode` (per
  row over the contracted axes, or in the block's groups along K): the activation error alone."""
  xs, _, _, contracted, _ = _parse(eq)
  dtype, block = _MODES[mode]
  if block is None:
    values, scale = quantize_activations(x, tuple(xs.index(c) for c in contracted), dtype)
    shape = [1 if c in contracted else n for c, n in zip(xs, x.shape, strict=True)]
    return (values.astype(jnp.float32) * scale.reshape(shape)).astype(x.dtype)
  n_in = len(contracted)
  if xs[len(xs) - n_in :] != contracted:
    raise ValueError(f"a block-quantized weight needs x's contracted axes last, got {xs!r}")
  k = math.prod(x.shape[x.ndim - n_in :])
  group = min(block[0], k)
  values, scale = quantize_activation_groups(
    x.reshape(-1, k), group, dtype, _SCALE_DTYPES.get(mode)
  )
  scale = jnp.repeat(scale, group, axis=-1)[:, :k]
  return (values.astype(jnp.float32) * scale).reshape(x.shape).astype(x.dtype)


def fake_quant_params(params: nnx.State, mode: str, part: str = "both") -> nnx.State:
  """The param State with each weight `quantize_params` would quantize wrapped as a `FakeQuant`
  of `mode` (rounding `part`: both operands, the weights or the activations), inside a
  differentiated function (the wrapping moves no data)."""
  if mode not in QUANT_MODES:
    raise ValueError(f"fake_quant_params: unknown mode {mode!r}; allowed modes: {QUANT_MODES}")
  if part not in FAKE_QUANT_PARTS:
    raise ValueError(f"fake_quant_params: unknown part {part!r}; allowed: {FAKE_QUANT_PARTS}")
  return _map_projections(params, lambda w, in_ndim: FakeQuant(w, mode, in_ndim, part))
