"""Mixed precision: master weights in `param_dtype`, compute in `dtype`, and the views between.

The learner keeps its weights (and so AdamW's moments) in `ModelConfig.param_dtype`, float32 by
default: an AdamW step of 1e-6 on a bfloat16 weight of 0.02 rounds to nothing (bfloat16 spaces
its values 2^-7 of a weight apart), so bfloat16 storage leaves the model where it was at RL
learning rates. Every forward casts each matrix to the compute dtype `ModelConfig.dtype` right
before it is used (`jaxrl.models.linear`, the embedding and the head); norms, biases and RoPE
stay in float32 inside the layers.

So a copy of the weights with every matrix already in the compute dtype gives the same forward
as the masters, bit for bit, in half the bytes. `ComputeCast` makes that copy for the readers that
never update the weights: the sampler, once per policy version (one compiled function per step;
decoding is bound by the bytes of weights it reads), evaluation, and the frozen KL reference.
Where storage and compute agree there is nothing to cast and the sampler reads the learner's own
arrays (zero-copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig


class ComputeCast:
  """`view(params)`: `params` with every floating matrix (ndim >= 2) of the storage dtype cast
  to the compute dtype, in one jitted call; 1-D leaves (norm scales, biases) and leaves of any
  other dtype (a quantized sampler's 8-bit weights and scales) are passed through as the very
  same arrays. `copy(params)` is the same with every leaf a fresh array (a frozen copy that
  outlives the learner's donated buffers).

  Counted: `calls` (casts made) and `last_bytes` (the bytes the last cast wrote).
  """

  def __init__(self, cfg: ModelConfig):
    self.source, self.target = cfg.weight_dtype, cfg.compute_dtype
    self.calls, self.last_bytes = 0, 0
    self._jitted = {}  # (paths, copy) -> the jitted cast

  @property
  def active(self) -> bool:
    """Whether storage and compute differ (else the view is the params themselves)."""
    return self.source != self.target

  def _picked(self, flat) -> tuple:
    def pick(value) -> bool:
      return isinstance(value, jax.Array) and value.dtype == self.source and value.ndim >= 2

    return tuple(path for path, var in flat if pick(var.get_value()))

  def _run(self, params: nnx.State, copy: bool) -> nnx.State:
    flat = nnx.to_flat_state(params)
    picked = self._picked(flat)
    by_path = dict(flat)
    chosen = set(picked)
    rest = tuple(path for path, _ in flat if path not in chosen) if copy else ()
    key = (picked, rest)
    if key not in self._jitted:
      target = self.target
      self._jitted[key] = jax.jit(
        lambda ws, others: ([w.astype(target) for w in ws], [jnp.copy(x) for x in others])
      )
    ws = [by_path[p].get_value() for p in picked]
    others = [by_path[p].get_value() for p in rest]
    cast, copied = self._jitted[key](ws, others)
    self.calls += 1
    self.last_bytes = int(sum(np.prod(w.shape) * self.target.itemsize for w in ws))
    out = dict(flat)
    for path, value in zip((*picked, *rest), (*cast, *copied), strict=True):
      out[path] = by_path[path].replace(value)
    return nnx.from_flat_state(out)

  def view(self, params: nnx.State) -> nnx.State:
    """What a reader of the weights sees: the params themselves when nothing differs."""
    return self._run(params, copy=False) if self.active else params

  def copy(self, params: nnx.State) -> nnx.State:
    """A fresh copy of every leaf, matrices in the compute dtype."""
    if not self.active:
      return jax.tree.map(jnp.copy, params)
    return self._run(params, copy=True)

  def _cache_size(self) -> int:
    return sum(f._cache_size() for f in self._jitted.values())
