"""Every Pallas kernel lowered for its accelerator on this CPU-only machine, through `jax.export`
with `platforms=("tpu",)` / `("cuda",)`: Pallas's Mosaic TPU and Triton lowerings run in Python,
so their checks (block shapes against Mosaic's (8, 128) tiling, the dtypes and ops each backend
takes, the Mosaic dialect's verifier, a Mosaic GPU kernel's shared memory) hold or fail here,
where the interpret-mode tests (which run the kernels' math) never reach them. What this does not
cover is the backend compiler behind the custom call (Mosaic's layout passes in libtpu, Triton's
PTX): that needs the device (`bench/device_kernels.py`).

Each case asserts that the lowered module holds exactly the expected number of that backend's
kernel calls: the dispatch took the kernel, not a reference fallback."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxrl.kernels import PagedKV, grouped_matmul, paged_attention, quant_matmul

S = jax.ShapeDtypeStruct
F32, BF16, E4M3, E5M2, I8, I32 = (
  jnp.float32,
  jnp.bfloat16,
  jnp.float8_e4m3fn,
  jnp.float8_e5m2,
  jnp.int8,
  jnp.int32,
)
# platform -> (the kernel impl, the custom-call target its kernels lower to)
PLATFORMS = {"tpu": ("pallas_tpu", "@tpu_custom_call("), "cuda": ("pallas_gpu", "xla.gpu.triton")}
# Triton calls carry no serialization guarantee; the module is only inspected, never run.
_TRITON_OK = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _lowered(fn, args, platform: str) -> str:
  exp = export.export(jax.jit(fn), platforms=(platform,), disabled_checks=[_TRITON_OK])(*args)
  return exp.mlir_module()


def _kernel_calls(text: str, platform: str) -> int:
  """How many of `platform`'s kernel calls the module holds; none of the other's, nor Mosaic
  GPU's (jax 0.10's default GPU lowering when no Triton params are given)."""
  other = next(t for p, (_, t) in PLATFORMS.items() if p != platform)
  assert text.count(other) == 0 and "mosaic_gpu" not in text
  return text.count(PLATFORMS[platform][1])


# ------------------------------------------------------------------ the quantized matmul

QMM_CASES = {  # (x dtype, w dtype, with x_scale)
  "w8a8_int8": (I8, I8, True),
  "w8a8_e4m3": (E4M3, E4M3, True),
  "w8a8_e5m2": (E5M2, E5M2, True),
  "w8a16_bf16_e4m3": (BF16, E4M3, False),
}
# A decode shape of a 1B model's projection, and shapes no block divides.
QMM_SHAPES = [(64, 2048, 8192), (10, 200, 24), (33, 520, 130)]


def _qmm_args(case, m, k, n):
  x_dtype, w_dtype, scaled = QMM_CASES[case]
  args = [S((m, k), x_dtype), S((k, n), w_dtype), S((n,), F32)]
  return args + [S((m,), F32)] if scaled else args


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("shape", QMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", list(QMM_CASES))
def test_quant_matmul_lowers_to_one_kernel(case, shape, platform):
  impl, _ = PLATFORMS[platform]
  fn = functools.partial(quant_matmul, impl=impl)
  assert _kernel_calls(_lowered(fn, _qmm_args(case, *shape), platform), platform) == 1


def test_quant_matmul_triton_split_k_lowers():
  # The split-K variant: a third grid axis whose programs add into an aliased, zeroed output.
  fn = functools.partial(quant_matmul, impl="pallas_gpu", split_k=4)
  assert _kernel_calls(_lowered(fn, _qmm_args("w8a8_e4m3", 64, 4096, 4096), "cuda"), "cuda") == 1


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_quant_matmul_value_and_gradient_lower_with_the_kernel_forward(platform):
  impl, _ = PLATFORMS[platform]

  def loss(x, w, ws):  # W8A16: the training path differentiates x through the custom VJP
    return quant_matmul(x, w, ws, impl=impl).sum()

  args = [S((16, 256), F32), S((256, 384), E4M3), S((384,), F32)]
  assert _kernel_calls(_lowered(jax.value_and_grad(loss), args, platform), platform) == 1


def test_a_block_that_breaks_mosaic_tiling_fails_to_lower():
  # The check has teeth: Mosaic TPU needs a block's last two dims divisible by (8, 128) (or
  # whole), and (8, 64, 64) on K = 256 is neither.
  fn = functools.partial(quant_matmul, impl="pallas_tpu", block=(8, 64, 64))
  with pytest.raises(ValueError, match="divisible by 8 and 128"):
    _lowered(fn, _qmm_args("w8a8_int8", 64, 256, 512), "tpu")


# ------------------------------------------------------------------ the MoE grouped matmul

# (M, K, N, experts): an MoE layer's dispatch in bf16, and a shape no block divides.
GMM_SHAPES = [(512, 1024, 1408, 8, BF16), (37, 24, 40, 3, F32)]


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("shape", GMM_SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_grouped_matmul_lowers_to_one_kernel(shape, platform):
  # On the GPU this failed before the Triton params were named: Mosaic GPU staged rhs's whole
  # expert column block in shared memory (8 x 1024 x 128 bf16 = 2 MiB against 227 KiB).
  m, k, n, e, dtype = shape
  impl, _ = PLATFORMS[platform]
  fn = functools.partial(grouped_matmul, impl=impl)
  args = [S((m, k), dtype), S((e, k, n), dtype), S((e,), I32)]
  assert _kernel_calls(_lowered(fn, args, platform), platform) == 1


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_grouped_matmul_value_and_gradient_lower_with_the_kernel_forward(platform):
  impl, _ = PLATFORMS[platform]

  def loss(lhs, rhs, sizes):  # the backward is ragged_dot's (the custom VJP's reference)
    return grouped_matmul(lhs, rhs, sizes, impl=impl).sum()

  args = [S((96, 64), F32), S((4, 64, 128), F32), S((4,), I32)]
  assert _kernel_calls(_lowered(jax.value_and_grad(loss, (0, 1)), args, platform), platform) == 1


# ------------------------------------------------------------------ paged attention

# (B, T, query heads, kv heads, head dim, pages, page size, pages per sequence)
DECODE = (64, 1, 32, 8, 128, 1024, 16, 16)  # 64 slots of up to 256 keys, Llama-3.2-1B's heads
ODD = (3, 1, 4, 2, 16, 9, 4, 3)


def _paged_args(b, t, n, kh, h, p, ps, mp, page_dtype):
  pages = S((kh, p, ps, h), page_dtype)
  return [S((b, t, n, h), BF16 if page_dtype != F32 else F32), pages, pages] + [
    S((b, mp), I32),
    S((b,), I32),
    S((b, t), I32),
  ]


def _paged(impl, scaled, **kw):
  def fn(q, kp, vp, table, lengths, pos):
    scales = (jnp.ones((kp.shape[0],), F32),) * 2 if scaled else (None, None)
    return paged_attention(q, PagedKV(kp, vp, table, lengths, *scales), pos, impl=impl, **kw)

  return fn


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize(
  "shape,page_dtype", [(DECODE, BF16), (DECODE, E4M3), (ODD, F32)], ids=["bf16", "fp8", "odd"]
)
def test_paged_decode_attention_lowers_to_one_kernel(shape, page_dtype, platform):
  impl, _ = PLATFORMS[platform]
  fn = _paged(impl, scaled=page_dtype == E4M3)
  args = _paged_args(*shape, page_dtype)
  assert _kernel_calls(_lowered(fn, args, platform), platform) == 1


def test_paged_attention_tpu_kernel_lowers_for_prefill_windows_and_soft_caps():
  # The Mosaic TPU kernel also takes several queries per sequence, a sliding window and
  # Gemma's soft-cap (the Triton path hands those to the reference).
  fn = _paged("pallas_tpu", scaled=False, window=7, soft_cap=30.0)
  args = _paged_args(3, 5, 4, 2, 16, 9, 4, 3, F32)
  assert _kernel_calls(_lowered(fn, args, "tpu"), "tpu") == 1
