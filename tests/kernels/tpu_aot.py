"""Compile the Pallas TPU kernels and the engine's programs for a Cloud TPU topology, on a CPU.

Run by `tpu_compile_test.py` in a process of its own, with libtpu importable and JAX_PLATFORMS=cpu:
`jax.experimental.topologies.get_topology_desc` describes a TPU slice (no chip needed) and
`jit(...).lower(args sharded on its devices).compile()` hands the program to libtpu's XLA:TPU
compiler, which compiles each Mosaic kernel for that generation (its VMEM budget, its tiling and
layouts) as it would on the device. Nothing runs. One JSON line per case on stdout:
{"case", "ok", "calls" (the compiled program's Mosaic kernel calls), "error"}.

  python tests/kernels/tpu_aot.py kernels v5e:2x2     # every kernel variant at its test shapes
  python tests/kernels/tpu_aot.py engine v5e:2x2      # the engine's programs, dense and MoE
  python tests/kernels/tpu_aot.py engine v5e:2x2,v6e:2x2   # each topology in turn, one process

Each topology's lines follow its head line {"topology", "device_kind"}.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lowering_test as lt  # noqa: E402  (the kernels' cases, shared with the lowering test)
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'


def _report(case: str, lower) -> None:
  """Compile `lower()` (a jax Lowered) and print the case's JSON line."""
  try:
    text = lower().compile().as_text()
    out = {"case": case, "ok": True, "calls": text.count(MOSAIC_CALL), "error": ""}
  except Exception as e:  # reported, not raised: the test decides what each case must do
    out = {"case": case, "ok": False, "calls": 0, "error": f"{type(e).__name__}: {e}"[:2000]}
  print(json.dumps(out), flush=True)


def _under(mesh, lower):
  from jaxrl.mesh import use_mesh

  with use_mesh(mesh, "fsdp_tp"):
    return lower()


def _lower_on(device, fn, args):
  """jit(fn) lowered for `device`, under a one-device mesh of it: the kernels read the chip
  they compile for from the mesh in context (`pltpu.get_tpu_info`), as on a TPU host they read
  the default device."""
  put = SingleDeviceSharding(device)
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=put) for a in args]
  with jax.set_mesh(Mesh(np.array([device]), ("chip",))):
    return jax.jit(fn).lower(*specs)


def kernels(topo) -> None:
  """Each kernel variant of lowering_test at its shapes, plus 8B-model shapes and one block too
  large for any generation's VMEM (must fail)."""
  dev = topo.devices[0]

  def one(case, fn, args):
    _report(case, lambda: _lower_on(dev, fn, args))

  from jaxrl.kernels.quant_matmul import _tpu_mxu_dtype

  with jax.set_mesh(Mesh(np.array([dev]), ("chip",))):
    pairs = {str(jnp.dtype(d)): _tpu_mxu_dtype(d, d) for d in (lt.I8, lt.E4M3, lt.E5M2)}
  print(json.dumps({"mxu_upcast": {k: v and jnp.dtype(v).name for k, v in pairs.items()}}))
  qmm = functools.partial(lt.quant_matmul, impl="pallas_tpu")
  for case in lt.QMM_CASES:
    for shape in lt.QMM_SHAPES:
      one(f"quant_matmul {case} {shape}", qmm, lt._qmm_args(case, *shape))
  one(
    "quant_matmul w8a8_e4m3 8B up (64, 4096, 14336)",
    qmm,
    lt._qmm_args("w8a8_e4m3", 64, 4096, 14336),
  )
  one(
    "quant_matmul w8a8_int8 8B down (256, 14336, 4096)",
    qmm,
    lt._qmm_args("w8a8_int8", 256, 14336, 4096),
  )

  def qmm_loss(x, w, ws):
    return lt.quant_matmul(x, w, ws, impl="pallas_tpu").sum()

  one("quant_matmul value_and_grad", jax.value_and_grad(qmm_loss),
      [lt.S((16, 256), lt.F32), lt.S((256, 384), lt.E4M3), lt.S((384,), lt.F32)])  # fmt: skip
  gmm = functools.partial(lt.grouped_matmul, impl="pallas_tpu")
  for m, k, n, e, dtype in lt.GMM_SHAPES + [(2048, 4096, 14336, 8, lt.BF16)]:
    args = [lt.S((m, k), dtype), lt.S((e, k, n), dtype), lt.S((e,), lt.I32)]
    one(f"grouped_matmul {(m, k, n, e)} {dtype.__name__}", gmm, args)

  def gmm_loss(lhs, rhs, sizes):
    return lt.grouped_matmul(lhs, rhs, sizes, impl="pallas_tpu").sum()

  one("grouped_matmul value_and_grad", jax.value_and_grad(gmm_loss, (0, 1)),
      [lt.S((96, 64), lt.F32), lt.S((4, 64, 128), lt.F32), lt.S((4,), lt.I32)])  # fmt: skip
  for name, shape, pages in (
    ("bf16 pages", lt.DECODE, lt.BF16),
    ("e4m3 pages", lt.DECODE, lt.E4M3),
    ("odd f32", lt.ODD, lt.F32),
    ("8B, 2048 keys", (64, 1, 32, 8, 128, 8192, 16, 128), lt.BF16),
  ):
    fn = lt._paged("pallas_tpu", scaled=pages == lt.E4M3)
    one(f"paged_attention {name}", fn, lt._paged_args(*shape, pages))
  fn = lt._paged("pallas_tpu", scaled=False, window=7, soft_cap=30.0)
  one(
    "paged_attention prefill window soft-cap", fn, lt._paged_args(3, 5, 4, 2, 16, 9, 4, 3, lt.F32)
  )
  # The control: blocks of 2048 x 2048 (x, w and the f32 accumulator: ~28 MiB) lower fine but
  # exceed every generation's scoped VMEM, so libtpu must refuse them.
  big = functools.partial(lt.quant_matmul, impl="pallas_tpu", block=(2048, 2048, 2048))
  one("CONTROL quant_matmul 2048^3 block", big, lt._qmm_args("w8a16_bf16_e4m3", 2048, 2048, 2048))


def _abstract(tree, shardings):
  """ShapeDtypeStructs of `tree`'s arrays, each with its sharding from the matching tree (or the
  one sharding given for every leaf)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )

  def one(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings) if hasattr(a, "dtype") else a

  return jax.tree.map(one, tree)


@functools.cache
def _engine_programs(moe: bool):
  """(cfg, params, fp8 params, the engine's programs and their arguments), recorded on this CPU
  once per process: the same for every topology."""
  from helpers import perturbed_model

  from jaxrl.models import ModelConfig
  from jaxrl.quant import quantize_params

  cfg = ModelConfig.tiny().replace(head_dim=16)
  if moe:
    cfg = cfg.replace(num_experts=5, experts_per_token=2, moe_mlp_dim=22)
  _, params = perturbed_model(cfg)
  qparams = quantize_params(params, "fp8")
  return cfg, params, qparams, lt._program_args(cfg, qparams, "fp8")


def engine(topo) -> None:
  """The engine's prefill, insert and multi-step decode with every kernel at its call site (fp8
  weights, fp8 pages), dense and MoE, on one chip and on a mesh of the topology's every device
  (fsdp x tensor 2)."""
  from helpers import small_engine

  from jaxrl.mesh import make_mesh, param_shardings
  from jaxrl.quant import _map_projections, quantized_sharding

  kernels_on = dict(
    attention_kernel="pallas_tpu", matmul_kernel="pallas_tpu", moe_kernel="pallas_tpu"
  )
  for moe in (False, True):
    cfg, params, qparams, programs = _engine_programs(moe)
    for where in ("one chip", "mesh"):
      if where == "one chip":
        mesh, rest = None, SingleDeviceSharding(topo.devices[0])
        param_specs = _abstract(qparams, rest)
      else:  # the params laid out by the rules, their quantized copies as quant.py places them
        mesh = make_mesh(fsdp=-1, tensor=2, devices=topo.devices)
        rest = NamedSharding(mesh, P())
        floats = _abstract(params, param_shardings(params, mesh, "fsdp_tp"))
        placed = _map_projections(floats, lambda w, d: quantized_sharding(w, d, "fp8"))
        param_specs = _abstract(qparams, jax.tree.map(lambda a: getattr(a, "sharding", a), placed))
      eng = small_engine(cfg.replace(**kernels_on), kv_dtype="fp8", mesh=mesh)
      for name, (args, kwargs) in programs.items():
        # The params argument gets theirs; the decode state, caches and tokens are replicated.
        specs = [
          param_specs
          if jax.tree.structure(a) == jax.tree.structure(qparams)
          else _abstract(a, rest)
          for a in args
        ]
        case = f"{'moe' if moe else 'dense'} {where} {name}"
        lower = functools.partial(getattr(eng, name).lower, *specs, **kwargs)
        if mesh is None:  # the chip in context, as a TPU host's default device would be
          chip = make_mesh(fsdp=1, devices=topo.devices[:1])
          lower = functools.partial(_under, chip, lower)
        _report(case, lower)


def main() -> None:
  what, names = sys.argv[1], sys.argv[2].split(",")
  for topology in names:
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    head = {"topology": topology, "device_kind": topo.devices[0].device_kind}
    print(json.dumps(head), flush=True)
    try:
      {"kernels": kernels, "engine": engine}[what](topo)
    except Exception:
      traceback.print_exc()
      raise


if __name__ == "__main__":
  main()
