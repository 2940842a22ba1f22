"""Quantized matmul: y [M, N] = (x [M, K] @ w [K, N]) * x_scale [M, 1] * w_scale [1, N], with
8-bit weights and either 8-bit activations (W8A8: int8 x int8 -> int32, fp8 x fp8 -> float32)
or float activations (W8A16: the weight upcast to the activation dtype inside the kernel, never
materialised as a float copy in memory).

Four implementations of the one contract, chosen by `impl`:
  reference   pure jnp (`jax.lax.dot` with the accumulator type, then the rescale): the
              definition the kernels are tested against, and what every backend without a
              kernel (CPUs) runs
  pallas_tpu  Mosaic TPU (`pltpu`): a (M / bm, N / bn, K / bk) grid whose K axis is
              "arbitrary", the partial products accumulated in a VMEM scratch block and rescaled
              once at the last K step; on a chip whose MXU does not take the 8-bit pair (v4:
              none; v5e-v6e: not e4m3fn) the blocks are upcast to bfloat16 in VMEM
              (`_tpu_mxu_dtype`)
  pallas_gpu  Triton: a (M / bm, N / bn, split_k) grid, each program looping over its K / split_k
              in bk slices with the accumulator in registers; blocks are powers of two of at
              least 16 (`tl.dot`'s minimum: a decode step's few rows are padded to 16),
              `jaxrl.kernels.blocks`. With split_k > 1 (split-K) each program adds its rescaled
              partial product into a zeroed float32 output with an atomic add: at decode shapes
              (M <= 64) the (M / bm, N / bn) grid alone can have far fewer programs than the
              GPU has SMs, leaving most of the weight bandwidth unused; `split_k=None` picks
              the split that brings the grid up to about one program per SM (`auto_split_k`)
  pallas_mgpu Mosaic GPU, Hopper-native (W8A8 int8 / fp8 only): each program of a (M / bm,
              N / bn, split_k) grid streams its x and w tiles into shared memory through a
              TMA pipeline `stages` deep (`plgpu.emit_pipeline`) and multiplies them with
              warpgroup MMAs (`wgmma`: int8 -> int32, fp8 -> float32, bm a multiple of 64 rows);
              its raw [split_k, M, N] partial sums are added and rescaled by XLA in one fusion.
              Hopper's 8-bit wgmma reads both operands K-major, so the weight must be stored
              [N, K] (`w_kmajor=True`); a [K, N] weight is transposed by XLA first (a copy per
              call: right, but not fast). Not picked by `auto` and not a model config choice:
              its speed has not been measured on a device yet (bench/device_kernels.py)
`auto` picks pallas_tpu on a TPU, pallas_gpu on a GPU and the reference elsewhere; `interpret`
runs a Pallas variant through the Pallas interpreter on any backend (tests on CPU; about 0.1 ms a
grid step, so keep grids small). Operands are zero-padded to whole blocks and the result cropped.

`quant_matmul` has a custom VJP (Pallas calls have no automatic one) so a training path
(learner-side fake-quant) can differentiate it: for W8A16 the gradient of the float x is that of
x @ dequantize(w); 8-bit codes, the weight and the scales are constants (a quantized copy of the
learner's weights), so a W8A8 caller differentiates its float activation straight through its
own quantization.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrl.kernels.blocks import gpu_block, round_up

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")  # the model's `matmul_kernel` choices
ALL_IMPLS = IMPLS + ("pallas_mgpu",)
_INT8 = jnp.dtype(jnp.int8)
# Split-K's target grid: about one program per SM of an H100 / H200 (132). Measured on an H200
# (docs/benchmarks.md) at M = 64, K = 4096: N = 4096 (32 tiles of 128) gains 1.5-2.0x from a
# split of 4-8; N = 14336 (112 tiles) loses 1.4-2.6x from any split.
_GPU_SMS = 132
_MAX_SPLIT = 16
_MGPU_STAGES = 4  # the Mosaic GPU kernel's default TMA pipeline depth (`launch=(None, stages)`)


def _acc_dtype(x_dtype, w_dtype):
  """int32 for int8 x int8; float32 otherwise (fp8 x fp8, float x 8-bit)."""
  return jnp.int32 if jnp.dtype(x_dtype) == _INT8 and jnp.dtype(w_dtype) == _INT8 else jnp.float32


def reference(x: jax.Array, w: jax.Array, w_scale: jax.Array, x_scale: jax.Array) -> jax.Array:
  """float32 [M, N]: (x @ w) * x_scale * w_scale, accumulated in int32 (int8 x int8) or float32.
  x [M, K] is int8 / fp8 (W8A8) or float (W8A16, x_scale ones); w [K, N] int8 / fp8; x_scale
  [M, 1]; w_scale [1, N]."""
  y = _block_dot(x, w, _acc_dtype(x.dtype, w.dtype))
  return y.astype(jnp.float32) * x_scale.astype(jnp.float32) * w_scale.astype(jnp.float32)


def _block_dot(x, w, acc):
  """x @ w accumulated as `acc`; a float x (W8A16) takes the 8-bit w converted to its dtype."""
  if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 1:
    w = w.astype(x.dtype)
  return jax.lax.dot(x, w, preferred_element_type=acc)


def _tpu_kernel(x_ref, w_ref, xs_ref, ws_ref, o_ref, acc_ref, *, mxu_dtype):
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  x, w = x_ref[...], w_ref[...]
  if mxu_dtype is not None:  # 8-bit codes this chip's MXU does not take: exact in bf16
    x, w = x.astype(mxu_dtype), w.astype(mxu_dtype)
  acc_ref[...] += _block_dot(x, w, acc_ref.dtype)

  @pl.when(k == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(jnp.float32) * xs_ref[...] * ws_ref[...]


def _gpu_kernel(x_ref, w_ref, xs_ref, ws_ref, o_ref, *, bk: int, acc):
  steps = x_ref.shape[1] // bk

  def body(i, total):
    xb = x_ref[:, pl.ds(i * bk, bk)]
    wb = w_ref[pl.ds(i * bk, bk), :]
    return total + _block_dot(xb, wb, acc)

  total = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, acc))
  o_ref[...] = total.astype(jnp.float32) * xs_ref[...] * ws_ref[...]


def _gpu_split_kernel(x_ref, w_ref, xs_ref, ws_ref, zero_ref, o_ref, *, bk: int, acc):
  """One K / split_k slice of the product, rescaled, added atomically into the zeroed output
  (`zero_ref` is the output's aliased input: the same buffer)."""
  from jax.experimental.pallas import triton as pltriton

  del zero_ref
  steps = x_ref.shape[1] // bk

  def body(i, total):
    return total + _block_dot(x_ref[:, pl.ds(i * bk, bk)], w_ref[pl.ds(i * bk, bk), :], acc)

  total = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, acc))
  part = total.astype(jnp.float32) * xs_ref[...] * ws_ref[...]
  pltriton.atomic_add(o_ref, (slice(None), slice(None)), part)


def auto_split_k(m: int, n: int, k: int, block: tuple[int, int, int]) -> int:
  """The Triton kernel's K split for an [M, K] x [K, N] product with `block` = (bm, bn, bk): the
  largest power of two (at most `_MAX_SPLIT`) that keeps the (M / bm, N / bn, split) grid
  within `_GPU_SMS` programs and leaves every program at least two bk slices of K; 1 when the
  tiles alone fill half the SMs (prefill, wide decode projections)."""
  bm, bn, bk = (gpu_block(b, d) for b, d in zip(block, (m, n, k), strict=True))
  return _split_for(-(-m // bm) * -(-n // bn), k, bk)


def _split_for(programs: int, k: int, bk: int) -> int:
  split = 1
  while split < _MAX_SPLIT and programs * split * 2 <= _GPU_SMS and k >= 4 * bk * split:
    split *= 2
  return split


_MGPU_UNIT = 64  # a warpgroup's wgmma takes 64 rows; 64-byte 8-bit tiles swizzle


def mgpu_blocks(block: tuple[int, int, int], m: int, n: int, k: int) -> tuple[int, int, int]:
  """The Mosaic GPU kernel's (bm, bn, bk) for an [M, K] x [K, N] product: each requested block
  (a multiple of 64) clipped to its axis rounded up to 64; bn at most 256 (wgmma's widest N)."""
  if any(b <= 0 or b % _MGPU_UNIT for b in block) or block[1] > 256:
    raise ValueError(
      f"pallas_mgpu blocks must be positive multiples of {_MGPU_UNIT} with bn <= 256 (wgmma's "
      f"64-row warpgroup tile, its widest N), got {tuple(block)}"
    )
  return tuple(min(b, round_up(d, _MGPU_UNIT)) for b, d in zip(block, (m, n, k), strict=True))


def mgpu_split_k(m: int, n: int, k: int, block: tuple[int, int, int]) -> int:
  """`auto_split_k`'s rule for the Mosaic GPU kernel's blocks (`mgpu_blocks`)."""
  bm, bn, bk = mgpu_blocks(block, m, n, k)
  return _split_for(-(-m // bm) * -(-n // bn), k, bk)


def _mgpu(x, w_nk, *, block, split_k, stages, interpret):
  """Raw partial sums [split_k, M', N'] (int32 / float32) of x [M', K'] @ w_nk [N', K'].T on
  operands already padded to whole blocks (`_pallas`)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  bm, bn, bk = block
  (mp, kp), np_ = x.shape, w_nk.shape[0]
  steps = kp // (bk * split_k)  # K slices per program
  acc = _acc_dtype(x.dtype, w_nk.dtype)

  def body(x_gmem, w_gmem, o_gmem):
    mi, ni, si = jax.lax.axis_index("m"), jax.lax.axis_index("n"), jax.lax.axis_index("s")

    def mma(acc_ref):
      def step(_, xs, ws):
        plgpu.wgmma(acc_ref, xs, plgpu.transpose_ref(ws, (1, 0)))
        # One MMA left in flight: the one before it is done, so the slot its tiles held (one
        # step longer, delay_release) can take the next TMA load.
        plgpu.wgmma_wait(1)

      plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[
          plgpu.BlockSpec((bm, bk), lambda q: (mi, si * steps + q), delay_release=1),
          plgpu.BlockSpec((bn, bk), lambda q: (ni, si * steps + q), delay_release=1),
        ],
        max_concurrent_steps=stages,
      )(x_gmem, w_gmem)
      return acc_ref[...]

    total = pl.run_scoped(mma, plgpu.ACC((bm, bn), acc))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), acc))
    def _(o_smem):
      o_smem[...] = total
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  extra = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    from jaxrl.kernels import mgpu_interpret

    mgpu_interpret.install()  # the interpreter's wgmma learns the weight tile's transposed view
    extra["interpret"] = InterpretGPUParams()
  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((split_k, mp, np_), acc),
    grid=(mp // bm, np_ // bn, split_k),
    grid_names=("m", "n", "s"),
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    **extra,
  )(x, w_nk)


def _tpu_mxu_dtype(x_dtype, w_dtype):
  """None where the TPU being compiled for multiplies (x_dtype, w_dtype) blocks natively, else
  bfloat16, which holds every int8 and fp8 code exactly: TPU v4's MXU takes no 8-bit
  activations and no fp8 (libtpu refuses the kernel, "CompileTimeMosaicUnsupportedRhsType"), and
  v5e / v5p / v6e take no e4m3fn. Then the blocks are upcast in VMEM, the weights still read from
  HBM as 8 bits, and an int8 x int8 product accumulates in float32 (exact while a row's partial
  sums stay below 2**24). None also where no TPU is in view (interpret mode on a CPU)."""
  from jax.experimental.pallas import tpu as pltpu

  if jnp.issubdtype(x_dtype, jnp.floating) and jnp.dtype(x_dtype).itemsize > 1:
    return None  # W8A16: _block_dot already multiplies in the activations' float dtype
  try:
    info = pltpu.get_tpu_info()
  except ValueError:  # not a TPU (the Pallas interpreter on a CPU)
    return None
  return None if info.is_matmul_supported(x_dtype, w_dtype) else jnp.bfloat16


def _pad(a, rows: int, cols: int):
  r, c = -a.shape[0] % rows, -a.shape[1] % cols
  return a if not (r or c) else jnp.pad(a, ((0, r), (0, c)))


def _pallas(x, w, w_scale, x_scale, *, impl, block, interpret, launch=None, split_k=1):
  m, k = x.shape
  if impl == "pallas_mgpu":  # w is [N, K] (K-major)
    n = w.shape[0]
    bm, bn, bk = mgpu_blocks(block, m, n, k)
    x, w = _pad(x, bm, bk * split_k), _pad(w, bn, bk * split_k)
    stages = (launch or (None, None))[1] or _MGPU_STAGES  # >= 2 (quant_matmul checks)
    parts = _mgpu(x, w, block=(bm, bn, bk), split_k=split_k, stages=stages, interpret=interpret)
    y = parts[0] if split_k == 1 else parts.sum(0)
    return y[:m, :n].astype(jnp.float32) * x_scale.astype(jnp.float32) * w_scale
  n = w.shape[1]
  if impl == "pallas_gpu":  # Triton: power-of-two blocks, >= 16 for tl.dot
    bm, bn, bk = (gpu_block(b, d) for b, d in zip(block, (m, n, k), strict=True))
  else:
    bm, bn, bk = (min(b, d) for b, d in zip(block, (m, n, k), strict=True))
  x, w = _pad(x, bm, bk * split_k), _pad(w, bk * split_k, bn)
  x_scale, w_scale = (
    _pad(x_scale.astype(jnp.float32), bm, 1),
    _pad(w_scale.astype(jnp.float32), 1, bn),
  )
  mp, kp = x.shape
  np_ = w.shape[1]
  acc = _acc_dtype(x.dtype, w.dtype)
  out_shape = jax.ShapeDtypeStruct((mp, np_), jnp.float32)
  if impl == "pallas_tpu":
    from jax.experimental.pallas import tpu as pltpu

    mxu_dtype = _tpu_mxu_dtype(x.dtype, w.dtype)
    if mxu_dtype is not None:
      acc = jnp.float32
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0,
      grid=(mp // bm, np_ // bn, kp // bk),
      in_specs=[
        pl.BlockSpec((bm, bk), lambda i, j, q: (i, q)),
        pl.BlockSpec((bk, bn), lambda i, j, q: (q, j)),
        pl.BlockSpec((bm, 1), lambda i, j, q: (i, 0)),
        pl.BlockSpec((1, bn), lambda i, j, q: (0, j)),
      ],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, q: (i, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), acc)],
    )
    y = pl.pallas_call(
      functools.partial(_tpu_kernel, mxu_dtype=mxu_dtype),
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
    )(x, w, x_scale, w_scale)
  else:
    from jax.experimental.pallas import triton as pltriton

    warps, stages = launch or (None, None)
    params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    if split_k > 1:
      ks = kp // split_k
      y = pl.pallas_call(
        functools.partial(_gpu_split_kernel, bk=bk, acc=acc),
        grid=(mp // bm, np_ // bn, split_k),
        in_specs=[
          pl.BlockSpec((bm, ks), lambda i, j, s: (i, s)),
          pl.BlockSpec((ks, bn), lambda i, j, s: (s, j)),
          pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)),
          pl.BlockSpec((1, bn), lambda i, j, s: (0, j)),
          pl.BlockSpec((bm, bn), lambda i, j, s: (i, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, s: (i, j)),
        out_shape=out_shape,
        input_output_aliases={4: 0},
        compiler_params=params,
        interpret=interpret,
      )(x, w, x_scale, w_scale, jnp.zeros((mp, np_), jnp.float32))
      return y[:m, :n]
    y = pl.pallas_call(
      functools.partial(_gpu_kernel, bk=bk, acc=acc),
      grid=(mp // bm, np_ // bn),
      in_specs=[
        pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
        pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
        pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
        pl.BlockSpec((1, bn), lambda i, j: (0, j)),
      ],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=out_shape,
      compiler_params=params,
      interpret=interpret,
    )(x, w, x_scale, w_scale)
  return y[:m, :n]


def resolve_impl(impl: str) -> str:
  """`auto` -> the backend's kernel (pallas_tpu / pallas_gpu) or the reference (CPU)."""
  if impl not in ALL_IMPLS:
    raise ValueError(f"quant_matmul impl must be one of {ALL_IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  backend = jax.default_backend()
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "reference")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _quant_matmul(x, w, w_scale, x_scale, impl, block, interpret, launch, split_k):
  if impl == "reference":
    return reference(x, w, w_scale, x_scale)
  return _pallas(
    x, w, w_scale, x_scale, impl=impl, block=block, interpret=interpret, launch=launch,
    split_k=split_k,
  )  # fmt: skip


def _fwd(x, w, w_scale, x_scale, impl, block, interpret, launch, split_k):
  y = _quant_matmul(x, w, w_scale, x_scale, impl, block, interpret, launch, split_k)
  return y, (x, w, w_scale, x_scale)


def _no_grad(a):
  """The zero cotangent of a constant operand: float0 for integer arrays, zeros otherwise."""
  if jnp.issubdtype(a.dtype, jnp.integer):
    return np.zeros(a.shape, jax.dtypes.float0)
  return jnp.zeros_like(a)


def _bwd(impl, block, interpret, launch, split_k, res, dy):
  x, w, w_scale, x_scale = res
  if jnp.dtype(x.dtype).itemsize > 1:  # W8A16: d/dx of (x @ w) * w_scale
    dx = ((dy * w_scale) @ w.astype(jnp.float32).T).astype(x.dtype)
  else:  # 8-bit codes are constants; a straight-through caller differentiates its float x
    dx = _no_grad(x)
  return dx, _no_grad(w), _no_grad(w_scale), _no_grad(x_scale)


_quant_matmul.defvjp(_fwd, _bwd)


def quant_matmul(
  x: jax.Array,
  w: jax.Array,
  w_scale: jax.Array,
  x_scale: jax.Array | None = None,
  *,
  impl: str = "auto",
  block: tuple[int, int, int] = (128, 128, 128),
  interpret: bool = False,
  launch: tuple[int | None, int | None] | None = None,
  split_k: int | None = None,
  w_kmajor: bool = False,
) -> jax.Array:
  """float32 [M, N] = (x @ w) * x_scale * w_scale (see the module docstring).

  x [M, K]: int8 / fp8 codes with x_scale [M] or [M, 1] (W8A8), or float with x_scale None
  (W8A16). w [K, N] int8 / fp8, or [N, K] with `w_kmajor` (the layout pallas_mgpu reads; the
  other implementations transpose it back), w_scale [N] or [1, N]. block = (bm, bn, bk),
  clipped to the operands' sizes. launch = (num_warps, num_stages) of the Triton kernel
  (pallas_gpu; None: Triton's defaults), or (None, pipeline stages) of the Mosaic GPU kernel.
  split_k: the GPU kernels' K split (None: `auto_split_k` / `mgpu_split_k`; the TPU kernel and
  the reference take 1). A split sums float32 partials in an unspecified order, so int8 results
  of the Triton kernel are no longer bit-exact (the Mosaic GPU kernel adds int32 partials).
  """
  k_axis = 1 if w_kmajor else 0
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[k_axis]:
    layout = "[N, K] (w_kmajor)" if w_kmajor else "[K, N]"
    raise ValueError(f"quant_matmul needs x [M, K] and w {layout}, got {x.shape} and {w.shape}")
  if jnp.dtype(w.dtype).itemsize != 1:
    raise ValueError(f"quant_matmul needs an 8-bit weight (int8 / fp8), got {w.dtype}")
  eight_bit_x = jnp.dtype(x.dtype).itemsize == 1
  if eight_bit_x != (x_scale is not None):
    raise ValueError("quant_matmul: 8-bit x needs its x_scale (W8A8); float x takes none (W8A16)")
  if eight_bit_x and (jnp.dtype(x.dtype) == _INT8) != (jnp.dtype(w.dtype) == _INT8):
    raise ValueError(f"W8A8 needs x and w both int8 or both fp8, got {x.dtype} and {w.dtype}")
  m, n = x.shape[0], w.shape[1 - k_axis]
  x_scale = jnp.ones((m, 1), jnp.float32) if x_scale is None else x_scale.reshape(m, 1)
  w_scale = w_scale.reshape(1, n)
  launch = None if launch is None else tuple(launch)
  impl = resolve_impl(impl)
  mgpu = impl == "pallas_mgpu"
  if mgpu and not eight_bit_x:
    raise ValueError(
      f"pallas_mgpu multiplies 8-bit pairs only (W8A8: wgmma takes one dtype for both "
      f"operands), got a {x.dtype} x: use pallas_gpu or the reference for W8A16"
    )
  if mgpu and launch is not None and (launch[0] is not None or (launch[1] or 2) < 2):
    raise ValueError(
      f"pallas_mgpu runs one warpgroup: launch is (None, stages) with stages >= 2 (one MMA "
      f"stays in flight while the next tiles load), got {launch}"
    )
  if w_kmajor != mgpu:  # XLA transposes the weight to the layout the implementation reads
    w = w.T
  if impl not in ("pallas_gpu", "pallas_mgpu"):
    if split_k not in (None, 1):
      raise ValueError(
        f"split_k={split_k} needs a GPU kernel (pallas_gpu / pallas_mgpu), not {impl!r}"
      )
    split_k = 1
  elif split_k is None:
    auto = mgpu_split_k if mgpu else auto_split_k
    split_k = auto(m, n, x.shape[1], tuple(block))
  elif not (isinstance(split_k, int) and split_k >= 1 and split_k & (split_k - 1) == 0):
    raise ValueError(f"split_k must be a power of two >= 1, got {split_k!r}")
  return _quant_matmul(x, w, w_scale, x_scale, impl, tuple(block), interpret, launch, split_k)
