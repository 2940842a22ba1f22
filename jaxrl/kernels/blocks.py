"""Block sizes for the Triton (Pallas GPU) kernels.

Triton's tensors have power-of-two sizes and its `tl.dot` takes operands of at least 16 along
each axis, so a GPU kernel's block is never the operand's own odd size (as a TPU block clipped
to a small operand may be): `gpu_block` rounds it to a power of two in [16, want], and the
caller zero-pads the operand to whole blocks.
"""

from __future__ import annotations

GPU_MIN_BLOCK = 16


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def gpu_block(want: int, dim: int) -> int:
  """The block along an axis of size `dim` for a requested block `want`: the smallest power of
  two covering `dim`, capped at `want` (itself rounded up to a power of two), never below 16."""
  return max(GPU_MIN_BLOCK, min(next_pow2(want), next_pow2(dim)))


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple
