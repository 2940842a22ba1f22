"""Advantage estimators on grouped rewards: registered pure functions with masks."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl.rl.registry import Registry

ESTIMATORS = Registry("advantage estimator")


@ESTIMATORS.register("grpo")
def grpo(rewards, mask=None, *, eps: float = 1e-6, scale_by_std: bool = True):
  """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 3 / §4.1.2):
  A_i = (r_i - mean(r_group)) / (std(r_group) + eps), std with Bessel's correction as in TRL/verl.

  rewards, mask: [num_groups, G] (mask marks real samples; groups may be ragged). Returns [.., G];
  groups with a single sample or all-equal rewards get zero advantage.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  mask = jnp.ones_like(rewards, bool) if mask is None else jnp.asarray(mask, bool)
  m = mask.astype(jnp.float32)
  n = jnp.sum(m, axis=-1, keepdims=True)
  mean = jnp.sum(rewards * m, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
  centred = (rewards - mean) * m
  adv = centred
  if scale_by_std:
    var = jnp.sum(centred**2, axis=-1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
    adv = centred / (jnp.sqrt(var) + eps)
  return jnp.where(mask & (n > 1), adv, 0.0)
