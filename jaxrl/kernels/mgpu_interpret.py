"""Transposed wgmma operands for Pallas's GPU interpreter (jax 0.10), so that the Mosaic GPU
quantized matmul runs in interpret mode on a CPU.

The interpreter multiplies `plgpu.wgmma` operands only as they are stored: an operand seen
through `plgpu.transpose_ref` makes its wgmma callback fail ("'TransposeTransform' object has
no attribute 'indices'"). Hopper's 8-bit wgmma reads both operands K-major and nothing else, so
`jaxrl.kernels.quant_matmul`'s Mosaic GPU kernel multiplies x [bm, bk] by the transpose of a
[bn, bk] weight tile. `install()` wraps the interpreter's wgmma callback once per process: an
operand whose last view is a transpose is read with its other views (as the interpreter reads
it) and permuted as the view says before the product; wgmmas without one take the
interpreter's own path unchanged. Compiled kernels never see it.
"""

from __future__ import annotations

import jax
import numpy as np

_INSTALLED = False


def install() -> None:
  """Wrap the GPU interpreter's wgmma callback (idempotent)."""
  global _INSTALLED
  if _INSTALLED:
    return
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

  cb.wgmma = _wrap(cb.wgmma)
  _INSTALLED = True


def _split_view(transforms):
  """(the views before a trailing transpose, its permutation or None)."""
  from jax._src.pallas.mosaic_gpu import core as mgpu_core
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

  transforms = cb._remove_noop_transforms(transforms)
  is_t = [isinstance(t, mgpu_core.TransposeTransform) for t in transforms]
  if is_t and is_t[-1] and not any(is_t[:-1]):
    return transforms[:-1], tuple(transforms[-1].permutation)
  if any(is_t):
    raise NotImplementedError(f"a wgmma operand transposed before its other views: {transforms}")
  return transforms, None


def _wrap(original):
  from jax._src.pallas.mosaic.interpret import utils as iutils
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

  def wgmma(**kw):
    a_view, a_perm = _split_view(kw["a_transforms"])
    b_view, b_perm = _split_view(kw["b_transforms"])
    if a_perm is None and b_perm is None:
      return original(**kw)
    memory = cb._get_shared_memory()
    device, thread = int(kw["device_id"]), int(kw["thread_id"])
    tid = memory.get_global_thread_id(device, thread)
    info = iutils.GPULoggingInfo(
      device_id=device,
      grid_point_coords=tuple(int(c) for c in kw["grid_point_coords"]),
      thread_id=thread,
      source_info=kw.get("source_info"),
    )

    def read(key, views, perm=None):
      where = iutils.to_range(jax.tree.map(int, views))
      key = cb.HostAllocationKey.from_array(key)
      value, _, _ = memory.get_buffer_content(key, where, tid, logging_info=info)
      return (value if perm is None else np.transpose(value, perm)), key, where

    a, _, _ = read(kw["a_allocation_key_as_array"], a_view, a_perm)
    b, _, _ = read(kw["b_allocation_key_as_array"], b_view, b_perm)
    acc, acc_key, acc_where = read(
      kw["acc_allocation_key_as_array"], _split_view(kw["acc_transforms"])[0]
    )
    out = acc + np.matmul(a, b, dtype=kw["acc_dtype"])
    memory.store_buffer_content(acc_key, acc_where, out, tid, logging_info=info)
    return kw["token"]

  return wgmma
