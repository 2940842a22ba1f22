"""The Pallas TPU kernels and the engine's programs compiled by libtpu for real TPU generations,
on this CPU-only machine (ahead-of-time, for a described topology; nothing runs).

`lowering_test.py` stops where Pallas hands a Mosaic kernel to the backend. Here libtpu's XLA:TPU
compiler (the `libtpu` wheel that `jax[tpu]` pins, installed beside the venv by launch/test.sh)
takes every program the whole way: each kernel is compiled for the generation's VMEM budget,
tiling and layouts. The generations: v4, v5e, v5p and v6e (the engine's programs: v5e, v5p,
v6e). Each case must compile and hold exactly its Mosaic kernel calls; the control case (blocks
of 2048^3, which lower fine) must be refused for VMEM on every generation, or the compile checks
nothing.

The kernels for every topology compile in one child process (`tpu_aot.py`), the engine's programs
in another, each with libtpu on its path and JAX_PLATFORMS=cpu: libtpu stays out of this
session's jax, which runs on CPU devices.
"""

import functools
import json
import os
import sys
from pathlib import Path

import pytest
from helpers import child_env, run_child

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIBTPU_DIR = Path(os.environ.get("JAXRL_LIBTPU_DIR", ROOT / ".venv" / "libtpu"))
KERNEL_TOPOLOGIES = ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"]
# (v4's topology lists each chip's two TensorCores apart, and jax.make_mesh builds TPU meshes of
# whole chips only: its kernels are compiled above, its engine programs not.)
ENGINE_TOPOLOGIES = ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"]


def _libtpu_dir() -> Path:
  """Where libtpu is; a missing one fails the test with how to install it (never a skip)."""
  if (LIBTPU_DIR / "libtpu").is_dir():
    return LIBTPU_DIR
  pytest.fail(
    f"libtpu is not installed at {LIBTPU_DIR}: run the suite with launch/test.sh, which installs "
    "the version jax[tpu] pins there (pip install --target), or point JAXRL_LIBTPU_DIR at one"
  )


@functools.cache  # once per worker, however often pytest-xdist tears the module fixture down
def _compile(what: str, topologies: tuple[str, ...]) -> dict[str, tuple[dict, dict[str, dict]]]:
  """Compile `what` for each topology in turn, in one child process (the engine's programs are
  recorded once for all): per topology, its head line and its cases by name."""
  # ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu otherwise takes a machine-wide lock, and the pytest workers
  # compile for several topologies at once.
  env = child_env(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_libtpu_dir()), env.get("PYTHONPATH")]))
  # Uncached, and XLA's flags as a user's (the suite's CPU-only ones could reach XLA:TPU).
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.pop("XLA_FLAGS", None)
  run = run_child([sys.executable, str(HERE / "tpu_aot.py"), what, ",".join(topologies)], env=env)
  lines = [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
  assert run.returncode == 0 and lines, run.stderr[-4000:]
  out = {}
  for line in lines:
    if "topology" in line:
      head, cases = out[line["topology"]] = (line, {})
    elif "case" in line:
      cases[line["case"]] = line
    else:
      head.update(line)
  assert tuple(out) == topologies, list(out)
  return out


# One child process per kind of program, each a module fixture in an xdist group of its own: the
# two run side by side on the suite's two workers.
@pytest.fixture(scope="module")
def kernel_compiles():
  return _compile("kernels", tuple(KERNEL_TOPOLOGIES))


@pytest.fixture(scope="module")
def engine_compiles():
  return _compile("engine", tuple(ENGINE_TOPOLOGIES))


# The 8-bit codes each generation's MXU does not take (upcast to bf16 in VMEM by the quantized
# matmul): the table the kernel reads from the chip it compiles for.
MXU_UPCAST = {
  "v4": {"int8": "bfloat16", "float8_e4m3fn": "bfloat16", "float8_e5m2": "bfloat16"},
  "v5e": {"int8": None, "float8_e4m3fn": "bfloat16", "float8_e5m2": None},
  "v5p": {"int8": None, "float8_e4m3fn": "bfloat16", "float8_e5m2": None},
  "v6e": {"int8": None, "float8_e4m3fn": "bfloat16", "float8_e5m2": None},
}


@pytest.mark.e2e
@pytest.mark.xdist_group("tpu_kernels")
@pytest.mark.parametrize("topology", KERNEL_TOPOLOGIES)
def test_every_tpu_kernel_compiles_with_libtpu(topology, kernel_compiles):
  head, cases = kernel_compiles[topology]
  cases = dict(cases)
  assert head["device_kind"].startswith("TPU v" + topology[1])
  # On v4 the W8A8 kernels compile only through the upcast (without it libtpu refuses them:
  # "CompileTimeMosaicUnsupportedRhsType"); elsewhere int8 stays on the MXU as int8.
  assert head["mxu_upcast"] == MXU_UPCAST[topology.split(":")[0]]
  control = cases.pop("CONTROL quant_matmul 2048^3 block")
  assert not control["ok"] and "vmem" in control["error"].lower(), control
  failed = {c: r["error"][:400] for c, r in cases.items() if not r["ok"]}
  assert not failed, failed
  # 12 quantized-matmul variants, 2 at an 8B model's shapes, a gradient; 3 grouped matmuls and a
  # gradient; 5 paged attentions: each compiled program holds exactly one Mosaic kernel, ours,
  # but the grouped matmul's gradient: its backward is ragged_dot's (the custom VJP's reference),
  # and XLA:TPU compiles each of the two ragged_dots of that backward to a Mosaic kernel of its own.
  assert len(cases) == 24
  calls = {c: r["calls"] for c, r in cases.items()}
  assert calls.pop("grouped_matmul value_and_grad") == 3
  assert {c: n for c, n in calls.items() if n != 1} == {}


@pytest.mark.e2e
@pytest.mark.xdist_group("tpu_engine")
@pytest.mark.parametrize("topology", ENGINE_TOPOLOGIES)
def test_the_engines_programs_compile_with_every_tpu_kernel(topology, engine_compiles):
  # Two layers: 7 quantized projections each (or 4 and 3 expert matmuls), one paged attention per
  # layer in decode; the insert has none. On the mesh (the topology's 4 chips, fsdp 2 x tensor 2)
  # each kernel runs in its shard_map.
  _, cases = engine_compiles[topology]
  failed = {c: r["error"][:600] for c, r in cases.items() if not r["ok"]}
  assert not failed, failed
  want = {"_prefill_jit": 14, "_insert_jit": 0, "_generate_steps_jit": 16}
  expected = {
    f"{model} {where} {name}": calls
    for model in ("dense", "moe")
    for where in ("one chip", "mesh")
    for name, calls in want.items()
  }
  assert {c: r["calls"] for c, r in cases.items()} == expected


@pytest.mark.e2e
def test_a_grpo_train_step_and_the_engines_decode_compile_for_a_tpu_slice(tmp_path):
  # bench/tpu_aot.py, which compiles a preset's whole GRPO update (loss, backward, AdamW over
  # fsdp-sharded params and moments) and its fp8 decode for a pod slice, on the tiny model and a
  # v5e 2 x 2 slice (fsdp 2 x tensor 2): both build, and the memory report adds up.
  _libtpu_dir()
  out = tmp_path / "aot.json"
  cmd = [sys.executable, str(ROOT / "bench" / "tpu_aot.py"), "--preset=tiny", "--topology=v5e:2x2"]
  cmd += ["--fsdp=2", "--tensor=2", "--batch=8", "--seq=32", "--slots=4", f"--out={out}"]
  env = child_env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # as for the other TPU compiles
  env.pop("XLA_FLAGS", None)
  run = run_child(cmd, env=env)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
  (report,) = json.loads(out.read_text())["runs"]
  result = report["result"]
  assert result["chips"] == 4 and result["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
  assert result["decode"]["mosaic_kernels"] == 2 * 8  # 7 quantized projections + paged attention
  for program in ("train", "decode"):
    mem = result[program]["memory_gib"]
    assert 0 < mem["argument"] and 0 <= mem["alias"] <= mem["output"]
    assert mem["peak_estimate"] == pytest.approx(
      mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    )
    assert mem["peak_estimate"] < mem["hbm"] == pytest.approx(16, abs=0.1)  # a v5e chip's 16 GiB
