"""Every Pallas kernel lowered for its accelerator on this CPU-only machine, through `jax.export`
with `platforms=("tpu",)` / `("cuda",)`: Pallas's Mosaic TPU, Triton and Mosaic GPU lowerings run
in Python, so their checks (block shapes against Mosaic's (8, 128) tiling, the dtypes and ops each
backend takes, the Mosaic dialect's verifier, wgmma's operand layouts, a Mosaic GPU kernel's
shared memory) hold or fail here, where the interpret-mode tests (which run the kernels' math)
never reach them. What this does not cover is the backend compiler behind the custom call:
libtpu's (Mosaic's layout passes and XLA:TPU, run on this CPU by `tpu_compile_test.py`) and the
GPU's PTX (the device's part, `bench/device_kernels.py`).

Each case asserts that the lowered module holds exactly the expected number of that backend's
kernel calls: the dispatch took the kernel, not a reference fallback. The last tests lower the
rollout engine's own programs with every kernel switched on at its call site in a whole model,
dense and MoE."""

import collections
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import perturbed_model, small_engine
from jax import export

from jaxrl.kernels import PagedKV, grouped_matmul, paged_attention, quant_matmul
from jaxrl.mesh import make_mesh, use_mesh
from jaxrl.models import ModelConfig
from jaxrl.quant import quantize_params
from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

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


_MOSAIC_GPU = "@mosaic_gpu_v2("


def _mosaic_gpu_lowered(case, m, k, n, **kw) -> str:
  x_dtype, w_dtype, _ = QMM_CASES[case]
  args = [S((m, k), x_dtype), S((n, k), w_dtype), S((n,), F32), S((m,), F32)]
  fn = functools.partial(quant_matmul, impl="pallas_mgpu", w_kmajor=True, **kw)
  return export.export(jax.jit(fn), platforms=("cuda",))(*args).mlir_module()


@pytest.mark.parametrize("shape", QMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", [c for c in QMM_CASES if c.startswith("w8a8")])
def test_quant_matmul_mosaic_gpu_lowers_to_one_kernel(case, shape):
  # The Hopper-native kernel (TMA pipeline, wgmma on K-major 8-bit tiles): Mosaic GPU's Python
  # lowering infers the tiles' layouts and shared-memory transforms and checks wgmma's operand
  # rules (8-bit: both K-major) here; PTX is the device's part. The automatic split included.
  text = _mosaic_gpu_lowered(case, *shape)
  assert text.count(_MOSAIC_GPU) == 1 and "xla.gpu.triton" not in text


def test_a_mosaic_gpu_pipeline_larger_than_shared_memory_fails_to_lower():
  # The control: 4 stages of a 128 x 512 x-tile and a 256 x 512 weight tile (768 KiB) cannot
  # fit Hopper's 227 KiB of shared memory; the default pipeline (4 x 32 KiB) lowers.
  with pytest.raises(ValueError, match="shared memory"):
    _mosaic_gpu_lowered("w8a8_e4m3", 128, 4096, 4096, block=(128, 256, 512), launch=(None, 4))
  assert _mosaic_gpu_lowered("w8a8_e4m3", 128, 4096, 4096).count(_MOSAIC_GPU) == 1


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
# 48 pages per sequence (256 + 512 positions in 16-token pages): Triton's blocks must be powers
# of two, and 48 / 16 splits would leave blocks of 3 pages.
RL_768 = (8, 1, 16, 8, 128, 384, 16, 48)


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
  "shape,page_dtype",
  [(DECODE, BF16), (DECODE, E4M3), (ODD, F32), (RL_768, BF16)],
  ids=["bf16", "fp8", "odd", "48pages"],
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


# ------------------------------------------------------------------ the engine's programs

_PROGRAMS = ("_prefill_jit", "_insert_jit", "_generate_steps_jit")


def _program_args(cfg, params, kv_dtype) -> dict:
  """The abstract arguments of each engine program's first call in a short run on this CPU,
  with the reference kernels (the kernels change no program's signature)."""
  eng, got = small_engine(cfg, kv_dtype=kv_dtype), {}
  spec = lambda x: S(x.shape, x.dtype) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x  # noqa: E731
  for name in _PROGRAMS:
    real = getattr(eng, name)

    def record(*a, _real=real, _name=name, **kw):
      got.setdefault(_name, jax.tree.map(spec, (a, kw)))
      return _real(*a, **kw)

    record._cache_size = real._cache_size  # Engine.program_count reads it
    setattr(eng, name, record)
  request = Request(
    [1, 5, 9, 17, 30], 0, sampling=SamplingParams(temperature=1.0), max_new_tokens=8
  )
  Driver(eng, steps_per_call=3, eos_id=None).run(params, [request], seed=0)
  assert set(got) == set(_PROGRAMS)
  return got


def _kernel_names(text: str, platform: str) -> dict:
  # Mosaic's custom-call config names its kernel; a Triton call's config lists its kernel's name
  # just before num_stages (a bare `name = ` would also match the mesh's axes).
  pattern = r'kernel_name = "(\w+)"' if platform == "tpu" else r'\bname = "(\w+)", num_stages'
  return dict(collections.Counter(re.findall(pattern, text)))


# The recorded arguments are abstract and unsharded, so on the mesh the KV pool a program returns
# (pinned to the engine's sharding) cannot take the donated one's buffer in this export; run on
# the mesh, the engine does donate it (tests/rollout/engine_test.py, the mesh-placed test).
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("where", ["one_device", "mesh", "mesh_no_context"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_the_engines_programs_lower_with_every_kernel_at_its_call_site(platform, moe, where):
  # On 8 devices (fsdp 4 x tensor 2) every kernel runs inside a shard_map: JAX refuses to lower
  # a Mosaic kernel in a program partitioned over several devices (jaxrl.kernels.partition).
  # `mesh_no_context`: the engine on the mesh, its caller in no `use_mesh`: the engine's programs
  # trace under its own mesh and rules.
  on_mesh = where != "one_device"
  cfg = ModelConfig.tiny().replace(head_dim=16)  # Triton's paged attention: a power of two
  if moe:
    cfg = cfg.replace(num_experts=5, experts_per_token=2, moe_mlp_dim=22)
  _, params = perturbed_model(cfg)
  # The TPU run samples with fp8 weights and fp8 pages, the GPU run with int8 weights.
  quant, kv_dtype = ("fp8", "fp8") if platform == "tpu" else ("int8", "auto")
  qparams = quantize_params(params, quant)
  impl, _ = PLATFORMS[platform]
  kcfg = cfg.replace(attention_kernel=impl, matmul_kernel=impl, moe_kernel=impl)
  mesh = make_mesh(fsdp=4, tensor=2) if on_mesh else None
  engine = small_engine(kcfg, kv_dtype=kv_dtype, mesh=mesh)
  lowered = {}
  for name, (args, kwargs) in _program_args(cfg, qparams, kv_dtype).items():
    exp = export.export(getattr(engine, name), platforms=(platform,), disabled_checks=[_TRITON_OK])
    with use_mesh(mesh, "fsdp_tp") if where == "mesh" else contextlib.nullcontext():
      lowered[name] = _kernel_names(exp(*args, **kwargs).mlir_module(), platform)
  layers = cfg.num_layers
  # Quantized projections: q, k, v, o, and gate, up, down unless the experts take those.
  qmm = {"tpu": "_tpu_kernel", "cuda": "_gpu_kernel"}[platform]
  want = {qmm: (4 if moe else 7) * layers}
  if moe:  # the experts' gate, up and down projections
    want[{"tpu": "_gmm_tpu_kernel", "cuda": "_gmm_gpu_kernel"}[platform]] = 3 * layers
  assert lowered["_prefill_jit"] == want  # a contiguous cache: no paged attention
  assert lowered["_insert_jit"] == {}
  decode = dict(lowered["_generate_steps_jit"])
  if platform == "tpu":
    assert decode.pop("_paged_kernel") == layers
  else:  # JAX's Triton kernel is one jitted function, lowered once and called per layer
    (paged,) = [k for k in decode if k.startswith("paged_attention")]
    assert decode.pop(paged) >= 1
  assert decode == want
