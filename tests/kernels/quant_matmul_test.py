"""The quantized matmul (jaxrl.kernels.quant_matmul): its jnp reference against numpy, the Pallas
variants (Mosaic TPU, Triton; the Hopper-native Mosaic GPU one for W8A8) through the Pallas
interpreters against the reference, for W8A8 int8 and fp8 and W8A16, on shapes that do not
divide the blocks; its custom VJP; its errors."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.quant_matmul import (
  auto_split_k,
  mgpu_blocks,
  mgpu_split_k,
  quant_matmul,
  reference,
  resolve_impl,
)
from jaxrl.quant import quantize, quantize_activations, quantized_einsum

M, K, N = 10, 40, 24  # blocks (8, 16, 16): short edge blocks on every axis
BLOCK = (8, 16, 16)
CASES = {
  "w8a8_int8": (jnp.int8, jnp.int8),
  "w8a8_e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
  "w8a8_e5m2": (jnp.float8_e5m2, jnp.float8_e5m2),
  "w8a16_f32_int8": (jnp.float32, jnp.int8),
  "w8a16_bf16_e4m3": (jnp.bfloat16, jnp.float8_e4m3fn),
}


def _operands(case, seed=0):
  x_dtype, w_dtype = CASES[case]
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(M, K)).astype(np.float32))
  q = quantize(jnp.asarray(rng.normal(size=(K, N)).astype(np.float32)), 1, w_dtype)
  if jnp.dtype(x_dtype).itemsize == 1:
    xq, xs = quantize_activations(x, (1,), x_dtype)
    return xq, q.values, q.scale, xs
  return x.astype(x_dtype), q.values, q.scale, None


@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_the_exact_product_then_the_rescale(case):
  x, w, ws, xs = _operands(case)
  got = np.asarray(quant_matmul(x, w, ws, xs, impl="reference"))
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  wf = np.asarray(w.astype(jnp.float32), np.float64)
  scale = (np.ones((M, 1)) if xs is None else np.asarray(xs)[:, None]) * np.asarray(ws)[None]
  # 8-bit x 8-bit products and their int32 / float32 sums are exact here (fp8 codes have at
  # most 4 significant bits, K = 40 terms); W8A16 rounds its float32 sums. Then one float32
  # rescale.
  want = (xf @ wf) * scale
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_pallas_kernels_match_the_reference_in_interpret_mode(case, impl):
  x, w, ws, xs = _operands(case, seed=1)
  want = np.asarray(
    reference(x, w, ws.reshape(1, N), (jnp.ones((M, 1)) if xs is None else xs.reshape(M, 1)))
  )
  got = np.asarray(quant_matmul(x, w, ws, xs, impl=impl, block=BLOCK, interpret=True))
  assert got.shape == (M, N) and got.dtype == np.float32
  if x.dtype == jnp.int8:  # integer accumulation in blocks: the same integers
    np.testing.assert_array_equal(got, want)
  else:  # float32 partial sums in another order
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_einsum_path_and_the_kernel_agree():
  # quant.quantized_einsum (the model's projection) is this kernel's contract on [B*T, D].
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 5, K)).astype(np.float32))
  q = quantize(jnp.asarray(rng.normal(size=(K, N)).astype(np.float32)), 1, jnp.float8_e4m3fn)
  via_einsum = np.asarray(quantized_einsum("BTD,DF->BTF", x, q)).reshape(10, N)
  xq, xs = quantize_activations(x.reshape(10, K), (1,), jnp.float8_e4m3fn)
  kernel = quant_matmul(xq, q.values, q.scale, xs, impl="pallas_gpu", block=BLOCK, interpret=True)
  np.testing.assert_allclose(np.asarray(kernel), via_einsum, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu"])
def test_w8a16_gradient_is_that_of_the_dequantized_weight(impl):
  x, w, ws, _ = _operands("w8a16_f32_int8", seed=2)
  dy = jnp.asarray(np.random.default_rng(4).normal(size=(M, N)).astype(np.float32))

  def f(x):
    return jnp.sum(quant_matmul(x, w, ws, impl=impl, block=BLOCK, interpret=True) * dy)

  def g(x):
    return jnp.sum((x @ (w.astype(jnp.float32) * ws[None])) * dy)

  np.testing.assert_allclose(
    np.asarray(jax.grad(f)(x)), np.asarray(jax.grad(g)(x)), rtol=1e-5, atol=1e-5
  )
  # 8-bit codes are constants: their cotangent is float0 (int8) or zero (fp8).
  xq, wq, wsq, xsq = _operands("w8a8_e4m3")
  dx = jax.grad(
    lambda x: jnp.sum(
      quant_matmul(
        x.astype(jnp.float8_e4m3fn), wq, wsq, xsq, impl=impl, block=BLOCK, interpret=True
      )
    )
  )(xq.astype(jnp.float32))
  assert np.all(np.asarray(dx) == 0)


def test_auto_is_the_reference_on_cpu_and_bad_inputs_are_named():
  assert resolve_impl("auto") == "reference" and jax.default_backend() == "cpu"
  x, w, ws, xs = _operands("w8a8_int8")
  with pytest.raises(ValueError, match="impl must be one of"):
    quant_matmul(x, w, ws, xs, impl="cuda")
  with pytest.raises(ValueError, match=r"x \[M, K\] and w \[K, N\]"):
    quant_matmul(x[:, :5], w, ws, xs)
  with pytest.raises(ValueError, match="8-bit x needs its x_scale"):
    quant_matmul(x, w, ws)
  with pytest.raises(ValueError, match="both int8 or both fp8"):
    quant_matmul(x.astype(jnp.float8_e4m3fn), w, ws, xs)
  with pytest.raises(ValueError, match="8-bit weight"):
    quant_matmul(x.astype(jnp.float32), w.astype(jnp.float32), ws)
  with pytest.raises(ValueError, match="split_k=2 needs a GPU kernel"):
    quant_matmul(x, w, ws, xs, impl="pallas_tpu", split_k=2)
  with pytest.raises(ValueError, match="split_k must be a power of two"):
    quant_matmul(x, w, ws, xs, impl="pallas_gpu", split_k=3)


def _pallas_params(fn, *args) -> dict:
  """The params of the one pallas_call in fn's jaxpr (the custom VJP's forward inlined)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append(eqn.params)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  assert len(found) == 1, found
  return found[0]


def test_the_triton_launch_reaches_the_compiler_and_changes_nothing_else():
  # launch = (num_warps, num_stages), the knob bench/device_kernels.py sweeps on a GPU; the
  # interpreter ignores it, so the result is the same, but the call must carry it.
  x, w, ws, xs = _operands("w8a8_e4m3")

  def run(launch):
    return lambda *a: quant_matmul(
      *a, impl="pallas_gpu", block=BLOCK, interpret=True, launch=launch
    )

  params = _pallas_params(run((8, 3)), x, w, ws, xs).get("compiler_params")
  assert (params.num_warps, params.num_stages) == (8, 3)
  default = _pallas_params(run(None), x, w, ws, xs)["compiler_params"]
  assert (default.num_warps, default.num_stages) == (None, None)
  np.testing.assert_array_equal(
    np.asarray(run((8, 3))(x, w, ws, xs)), np.asarray(run(None)(x, w, ws, xs))
  )


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_the_split_k_kernel_matches_the_reference_in_interpret_mode(case, split):
  # Each program adds its rescaled partial product into the zeroed output atomically: float32
  # partials summed in any order, so int8 too is compared to float32 rounding (K = 40 padded to
  # split x 16; the padding's zero codes add nothing).
  x, w, ws, xs = _operands(case, seed=2)
  want = np.asarray(quant_matmul(x, w, ws, xs, impl="reference"))
  got = quant_matmul(x, w, ws, xs, impl="pallas_gpu", block=BLOCK, interpret=True, split_k=split)
  assert got.shape == (M, N) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_auto_split_k_fills_the_gpu_at_decode_shapes_and_leaves_prefill_alone():
  # Decode: one row block x 32 column blocks of 128 = 32 programs -> split 4 (128 programs, at
  # most one per SM of 132; each 4096 / 4 = 8 slices of 128). 112 tiles (N = 14336) or a
  # prefill's 32 x 32 fill the SMs already -> 1. A split only doubles while each part keeps at
  # least two bk slices: K = 256 (two slices of 128) -> 1.
  assert auto_split_k(64, 4096, 4096, (128, 128, 128)) == 4
  assert auto_split_k(64, 14336, 4096, (128, 128, 128)) == 1
  assert auto_split_k(4096, 4096, 4096, (128, 128, 128)) == 1
  assert auto_split_k(64, 2048, 2048, (128, 128, 128)) == 8  # 16 programs -> 128
  assert auto_split_k(64, 4096, 256, (128, 128, 128)) == 1
  assert auto_split_k(8, 16, 8192, (128, 128, 128)) == 16  # one program; capped at 16
  # With the default (split_k=None) the Triton call takes the auto split as its third grid axis.
  rng = np.random.default_rng(4)
  q = quantize(jnp.asarray(rng.normal(size=(256, 16)).astype(np.float32)), 1, jnp.float8_e4m3fn)
  x = jnp.asarray(rng.normal(size=(2, 256)), jnp.float32)
  xq, xs = quantize_activations(x, (1,), q.values.dtype)

  def run(*a):
    return quant_matmul(*a, impl="pallas_gpu", block=(16, 16, 16), interpret=True)

  assert auto_split_k(2, 16, 256, (16, 16, 16)) == 8
  assert _pallas_params(run, xq, q.values, q.scale, xs)["grid_mapping"].grid == (1, 1, 8)
  want = quant_matmul(xq, q.values, q.scale, xs, impl="reference")
  np.testing.assert_allclose(np.asarray(run(xq, q.values, q.scale, xs)), np.asarray(want),
                             rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))  # fmt: skip


# ------------------------------------------------------------ the Mosaic GPU (Hopper) kernel

W8A8 = [c for c in CASES if c.startswith("w8a8")]


@pytest.mark.parametrize("kmajor", [True, False], ids=["w_nk", "w_kn"])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("case", W8A8)
def test_the_mosaic_gpu_kernel_matches_the_reference_in_interpret_mode(case, split, kmajor):
  # TMA pipeline into shared memory, wgmma on K-major 8-bit tiles (the interpreter reads the
  # weight tile's transposed view through jaxrl.kernels.mgpu_interpret). (M, K, N) = (70, 300,
  # 130) in blocks of 64: two row blocks (the second 6 rows and 58 of padding); K padded to 320
  # = 5 slices (split 1) or 384 = 2 splits x 3 slices, a pipeline 2 deep over either; three
  # column blocks. int8 partial sums are int32: equal. fp8: float32 sums in another order. A
  # [K, N] weight (w_kn) is transposed by XLA before the kernel: the same result.
  rng = np.random.default_rng(5)
  m, k, n = 70, 300, 130
  x_dtype, w_dtype = CASES[case]
  x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
  q = quantize(jnp.asarray(rng.normal(size=(k, n)).astype(np.float32)), 1, w_dtype)
  xq, xs = quantize_activations(x, (1,), x_dtype)
  want = np.asarray(quant_matmul(xq, q.values, q.scale, xs, impl="reference"))
  w = q.values.T if kmajor else q.values
  got = quant_matmul(
    xq, w, q.scale, xs, impl="pallas_mgpu", block=(64, 64, 64), interpret=True,
    launch=(None, 2), split_k=split, w_kmajor=kmajor,
  )  # fmt: skip
  assert got.shape == (m, n) and got.dtype == jnp.float32
  if x_dtype == jnp.int8:
    np.testing.assert_array_equal(np.asarray(got), want)
  else:
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_the_mosaic_gpu_kernels_blocks_splits_and_bad_inputs():
  # Blocks: multiples of 64 clipped to the axis rounded up to 64 (decode's few rows -> one
  # 64-row warpgroup tile); the split fills about one program per SM, as the Triton kernel's.
  assert mgpu_blocks((128, 128, 128), 16, 4096, 4096) == (64, 128, 128)
  assert mgpu_blocks((128, 256, 128), 4096, 130, 40) == (128, 192, 64)
  assert mgpu_split_k(64, 4096, 4096, (128, 128, 128)) == 4  # 32 programs -> 128
  assert mgpu_split_k(64, 14336, 4096, (128, 128, 128)) == 1  # 112 programs
  assert mgpu_split_k(4096, 4096, 4096, (128, 128, 128)) == 1
  assert resolve_impl("auto") == "reference"  # never picked by auto
  x, w, ws, xs = _operands("w8a8_e4m3")
  with pytest.raises(ValueError, match="positive multiples of 64 with bn <= 256"):
    quant_matmul(x, w, ws, xs, impl="pallas_mgpu", block=(64, 96, 64), interpret=True)
  with pytest.raises(ValueError, match="positive multiples of 64 with bn <= 256"):
    quant_matmul(x, w, ws, xs, impl="pallas_mgpu", block=(64, 320, 64), interpret=True)
  with pytest.raises(ValueError, match=r"launch is \(None, stages\)"):
    quant_matmul(x, w, ws, xs, impl="pallas_mgpu", launch=(8, 3), interpret=True)
  with pytest.raises(ValueError, match="stages >= 2"):  # one MMA stays in flight
    quant_matmul(x, w, ws, xs, impl="pallas_mgpu", launch=(None, 1), interpret=True)
  with pytest.raises(ValueError, match="pallas_mgpu multiplies 8-bit pairs only"):
    quant_matmul(x.astype(jnp.float32), w, ws, impl="pallas_mgpu", interpret=True)
  with pytest.raises(ValueError, match=r"w \[N, K\] \(w_kmajor\)"):
    quant_matmul(x, w, ws, xs, impl="pallas_mgpu", w_kmajor=True, interpret=True)
  with pytest.raises(ValueError, match="split_k must be a power of two"):
    quant_matmul(x, w, ws, xs, impl="pallas_mgpu", split_k=3, interpret=True)
  # K-major weights work with every implementation (the others transpose them back); the
  # Triton kernel's fp8 float32 sums run in another order, the tolerance of its other tests.
  want = np.asarray(quant_matmul(x, w, ws, xs, impl="reference"))
  got = quant_matmul(x, w.T, ws, xs, impl="pallas_gpu", block=BLOCK, interpret=True, w_kmajor=True)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(
    np.asarray(quant_matmul(x, w.T, ws, xs, impl="reference", w_kmajor=True)), want
  )
