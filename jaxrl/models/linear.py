"""Weights and projections: initialised params, LoRA adapters, and the projection einsum that
runs a weight (float or int8) with its adapter. Shared by the dense layers and the MoE experts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.fake_quant import FakeQuant, fake_quant_einsum
from jaxrl.kernels.contract import contract
from jaxrl.models.config import ModelConfig
from jaxrl.quant import BlockQArray, QArray, quantized_einsum


def param(rngs: nnx.Rngs, shape, fan_in: int, axes, dtype, scale: float = 1.0) -> nnx.Param:
  std = scale / fan_in**0.5
  value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
  return nnx.Param(value.astype(dtype), axes=axes)


# Salt of the LoRA random stream, so adapters never reuse a key of the base params.
_LORA_SALT = 0x10A4


def lora_key(rngs: nnx.Rngs) -> jax.Array:
  """A key for a module's LoRA adapters that leaves the `params` stream where it was.

  Derived from the stream's key and its current count (unique per module), but not drawn from it,
  so enabling LoRA does not shift a single base weight for the same seed.
  """
  stream = rngs.params
  return jax.random.fold_in(jax.random.fold_in(stream.key[...], _LORA_SALT), stream.count[...])


class LoRA(nnx.Module):
  """Low-rank adapter of one projection W [*in, *out]: adds scale * (x A) B, scale = alpha / r.

  A [*in, r] is Kaiming-uniform as in PEFT (bound 1 / sqrt(fan_in)); B [r, *out] starts at zero,
  so a fresh adapter changes nothing. Both are `nnx.LoRAParam`s, so filters can pick them out.
  """

  def __init__(self, key, in_shape, in_axes, out_shape, out_axes, cfg: ModelConfig):
    r, dt = cfg.lora_rank, cfg.weight_dtype
    bound = math.prod(in_shape) ** -0.5
    a = jax.random.uniform(key, (*in_shape, r), jnp.float32, -bound, bound)
    self.a = nnx.LoRAParam(a.astype(dt), axes=(*in_axes, "lora"))
    self.b = nnx.LoRAParam(jnp.zeros((r, *out_shape), dt), axes=("lora", *out_axes))
    self.scale = cfg.lora_alpha / r


def make_adapters(cfg: ModelConfig, rngs: nnx.Rngs, shapes: dict) -> dict[str, LoRA | None]:
  """{name: LoRA or None} for the projections `shapes` = {name: (in, in_axes, out, out_axes)}."""
  targets = set(cfg.lora_targets) if cfg.lora_rank else set()
  keys = jax.random.split(lora_key(rngs), len(shapes)) if targets & set(shapes) else None
  return {
    name: LoRA(keys[i], *shape, cfg) if name in targets else None
    for i, (name, shape) in enumerate(shapes.items())
  }


def project(
  eq: str,
  x: jax.Array,
  w: nnx.Param,
  adapter: LoRA | None = None,
  kernel: tuple[str, bool] = ("reference", False),
) -> jax.Array:
  """x through the projection `w` (einsum `eq`, e.g. "BTD,DNH->BTNH"), plus its adapter if any.

  The adapter goes through the rank R bottleneck, (x A) B, so the merged weight W + A B is never
  built on the forward: that would cost a full weight's memory and FLOPs every step.
  A `jaxrl.quant.QArray` or `BlockQArray` weight (quantized rollouts) runs as a W8A8 einsum
  (int8 or fp8), a `FakeQuant` one (the learner's fake quantization) as the same einsum with
  straight-through gradients; the adapter stays float. `kernel` = (ModelConfig.matmul_kernel,
  kernel_interpret): how a per-channel quantized weight's product runs (`quantized_einsum`).
  """
  dt = x.dtype
  value = w.get_value()
  if isinstance(value, QArray | BlockQArray):
    axes = w.get_metadata().get("axes")
    y = quantized_einsum(eq, x, value, impl=kernel[0], interpret=kernel[1], w_axes=axes)
  elif isinstance(value, FakeQuant):
    y = fake_quant_einsum(eq, x, value)
  else:
    y = contract(eq, x, value.astype(dt))
  if adapter is None:
    return y
  ins, out = eq.split("->")
  xs, ws = ins.split(",")
  contracted = "".join(c for c in ws if c in xs)
  kept = "".join(c for c in ws if c not in xs)
  lead = "".join(c for c in xs if c not in ws)
  xa = contract(f"{xs},{contracted}R->{lead}R", x, adapter.a[...].astype(dt))
  return y + adapter.scale * contract(f"{lead}R,R{kept}->{out}", xa, adapter.b[...].astype(dt))
