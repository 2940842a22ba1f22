"""LoRA adapter state: split from the base, count, merge into the base, or switch off."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig

# The nnx filter of adapter params (A and B of every `jaxrl.models.linear.LoRA`).
lora_filter = nnx.LoRAParam
_DEFAULTS = {
  f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora")
}


def split_lora(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapter_state, base_state); `nnx.merge_state(adapter, base)` gives `params` back."""
  return nnx.split_state(params, lora_filter, ...)


def adapter_param_count(params: nnx.State) -> int:
  """Number of scalars in the adapters (0 for a model without LoRA)."""
  return sum(x.size for x in jax.tree.leaves(split_lora(params)[0]))


def without_adapter(params: nnx.State) -> nnx.State:
  """The base model inside a LoRA model: every B replaced by zeros, so each adapter adds 0.

  Every other leaf is the very same array (no copy of the base weights), so this is the RL
  reference policy at the cost of the adapters' B alone. Use it with the LoRA model's graphdef.
  """

  def zero_b(path, x):
    return jnp.zeros_like(x) if path[-1] == "b" and path[-2].endswith("_lora") else x

  adapter, base = split_lora(params)
  adapter = nnx.from_flat_state(
    {path: v.replace(zero_b(path, v.get_value())) for path, v in nnx.to_flat_state(adapter)}
  )
  return nnx.merge_state(adapter, base)


@jax.jit
def _merged(w, a, b, scale):
  # W [*in, *out] + scale * A [*in, R] B [R, *out], accumulated in float32 at full precision.
  ab = jnp.tensordot(
    a.astype(jnp.float32), b.astype(jnp.float32), axes=1, precision=jax.lax.Precision.HIGHEST
  )
  return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)


def merge_lora(cfg: ModelConfig, params: nnx.State) -> tuple[ModelConfig, nnx.State]:
  """Folds each adapter into its weight: W <- W + (alpha / r) A B (float32, cast back).

  Returns (the config with LoRA off, params of that plain model): what export and any consumer
  of a dense checkpoint want. A config without LoRA comes back unchanged.
  """
  if not cfg.lora_rank:
    return cfg, params
  scale = cfg.lora_alpha / cfg.lora_rank
  adapter, base = split_lora(params)
  flat = dict(nnx.to_flat_state(adapter))
  merged = {}
  for path, w in nnx.to_flat_state(base):
    name = path[-1]
    a, b = flat.get((*path[:-1], f"{name}_lora", "a")), flat.get((*path[:-1], f"{name}_lora", "b"))
    if a is not None:
      w = w.replace(_merged(w.get_value(), a.get_value(), b.get_value(), scale))
    merged[path] = w
  used = {(*p[:-2], p[-2].removesuffix("_lora")) for p in flat}
  if not used <= set(merged):
    raise ValueError(f"adapters without a base weight: {sorted(used - set(merged))}")
  return cfg.replace(**_DEFAULTS), nnx.from_flat_state(merged)
