"""Compile a preset's GRPO train step and its rollout engine's decode for a Cloud TPU slice, on a
CPU: does the program build for that slice, and does it fit each chip's HBM?

libtpu compiles ahead of time for a described topology (`jax.experimental.topologies`, no chip
needed), with the same XLA:TPU and Mosaic compilers a TPU VM runs. Nothing is executed and no
weight is materialised: params, optimizer state, batch and decode state are abstract arrays with
the shardings a run on that slice would give them (the model's logical-axis rules on an
(fsdp, tensor) mesh of the slice's chips). Reported per program: lowering and compile seconds,
and XLA's per-chip memory analysis (arguments, outputs, temporaries, what is aliased) against the
chip's HBM. Compile times are this CPU's, not a TPU host's.

  train    the GRPO train step (`jaxrl.rl.train_step`, the clipped policy loss, AdamW) on a
           [--batch, --seq] batch with --microbatches, params in the preset's dtype
  decode   the engine's multi-step decode (`Engine._generate_steps_jit`, 8 steps a call) with
           --slots sequences of up to --seq positions, fp8 weights and KV pages, and every Pallas
           TPU kernel at its call site (quantized matmul, paged attention)

Runs itself in a child with libtpu on its path (`.venv/libtpu`, which `launch/test.sh` installs;
or JAXRL_LIBTPU_DIR) and JAX_PLATFORMS=cpu.

  python bench/tpu_aot.py --preset=llama3p2_1b --topology=v5e:2x4 --fsdp=8 --what=train,decode
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
CHILD_ENV = "JAXRL_TPU_AOT_CHILD"


def _spec(a, sharding):
  import jax

  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def _memory(compiled, hbm: int) -> dict:
  m = compiled.memory_analysis()
  kinds = ("argument", "output", "temp", "alias")
  gib = {k: getattr(m, f"{k}_size_in_bytes") / 2**30 for k in kinds}
  # Donated arguments come back as outputs in the same buffers: count them once.
  gib["peak_estimate"] = gib["argument"] + gib["output"] - gib["alias"] + gib["temp"]
  gib["hbm"] = hbm / 2**30
  return gib


def _timed(lower) -> tuple[object, dict]:
  t0 = time.perf_counter()
  lowered = lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}


def child(args) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.experimental import topologies
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxrl.mesh import make_mesh, param_shardings, use_mesh
  from jaxrl.models import ModelConfig
  from jaxrl.models.transformer import Transformer

  topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
  mesh = make_mesh(fsdp=args.fsdp, tensor=args.tensor, devices=topo.devices)
  with use_mesh(mesh, "fsdp_tp"):
    info = pltpu.get_tpu_info()
  hbm = info.hbm_capacity_bytes * info.num_cores
  cfg = getattr(ModelConfig, args.preset)()
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  params = jax.tree.map(_spec, abstract, param_shardings(abstract, mesh, "fsdp_tp"))
  rep = NamedSharding(mesh, P())
  out = {
    "preset": args.preset,
    "topology": args.topology,
    "device_kind": topo.devices[0].device_kind,
    "chips": len(topo.devices),
    "mesh": dict(mesh.shape),
    "params": sum(int(a.size) for a in jax.tree.leaves(abstract)),
    "param_dtype": str(jax.tree.leaves(abstract)[0].dtype),
  }
  if "train" in args.what:
    from jaxrl.rl.batch import TrainBatch
    from jaxrl.rl.objectives import PolicyLoss
    from jaxrl.rl.train_step import TrainState, make_optimizer, make_train_step, state_shardings

    opt = make_optimizer(learning_rate=1e-6, warmup_steps=10, total_steps=100)
    # The Adam moments mirror their params' shardings (as init_state's propagation gives them).
    by_path = {
      jax.tree_util.keystr(k): v.sharding
      for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }

    def moment(path, a):
      key = jax.tree_util.keystr(path)
      found = [p for p in by_path if key.endswith(p)]
      return _spec(a, by_path[max(found, key=len)] if a.shape and found else rep)

    opt_state = jax.tree_util.tree_map_with_path(moment, jax.eval_shape(opt.init, params))
    state = TrainState(params, opt_state, _spec(jax.ShapeDtypeStruct((), jnp.int32), rep))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    col = lambda dt: _spec(jax.ShapeDtypeStruct((args.batch, args.seq), dt), rows)  # noqa: E731
    batch = TrainBatch(
      col(jnp.int32), col(jnp.bool_), *(col(jnp.float32) for _ in range(4)), col(jnp.int32)
    )
    step = make_train_step(opt, PolicyLoss(graphdef), num_microbatches=args.microbatches)
    jitted = jax.jit(step._fn, donate_argnums=0, out_shardings=(state_shardings(state), None))
    with use_mesh(mesh, "fsdp_tp"):
      compiled, times = _timed(lambda: jitted.lower(state, batch, None))
    out["train"] = {
      "batch": args.batch,
      "seq": args.seq,
      "microbatches": args.microbatches,
      **times,
      "memory_gib": _memory(compiled, hbm),
    }
    print(f"train: {json.dumps(out['train'])}", flush=True)
  if "decode" in args.what:
    from jaxrl.quant import _map_projections, quantize_params, quantized_sharding
    from jaxrl.rollout.engine import Engine

    kcfg = cfg.replace(
      attention_kernel="pallas_tpu", matmul_kernel="pallas_tpu", moe_kernel="pallas_tpu"
    )
    # The kernels are picked by the model's config, which its graphdef carries.
    kgraph = nnx.split(nnx.eval_shape(lambda: Transformer(kcfg, rngs=nnx.Rngs(0))))[0]
    page = 16
    pages_per_seq = -(-args.seq // page)
    engine = Engine(
      kcfg,
      kgraph,
      max_concurrent_decodes=args.slots,
      num_pages=args.slots * pages_per_seq,
      page_size=page,
      max_prefill_length=min(args.seq // 2, 1024),
      max_target_length=args.seq,
      kv_dtype="fp8",
      mesh=mesh,
      rules="fsdp_tp",
    )
    qabs = jax.eval_shape(lambda p: quantize_params(p, "fp8"), abstract)
    placed = _map_projections(params, lambda w, d: quantized_sharding(w, d, "fp8"))
    qparams = jax.tree.map(_spec, qabs, jax.tree.map(lambda a: getattr(a, "sharding", a), placed))
    state = jax.eval_shape(engine._zero_state)
    with use_mesh(mesh, "fsdp_tp"):
      compiled, times = _timed(lambda: engine._generate_steps_jit.lower(qparams, state, 8))
    text = compiled.as_text()
    out["decode"] = {
      "slots": args.slots,
      "max_positions": args.seq,
      "steps_per_call": 8,
      "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"'),
      **times,
      "memory_gib": _memory(compiled, hbm),
    }
    print(f"decode: {json.dumps(out['decode'])}", flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--preset", default="llama3p2_1b", help="a ModelConfig preset (classmethod)")
  ap.add_argument("--topology", default="v5e:2x4", help="e.g. v5e:2x4, v5p:2x2x1, v6e:2x2")
  ap.add_argument("--fsdp", type=int, default=-1)
  ap.add_argument("--tensor", type=int, default=1)
  ap.add_argument("--what", default="train,decode", help="train and/or decode")
  ap.add_argument("--batch", type=int, default=64, help="train step rows")
  ap.add_argument("--seq", type=int, default=512, help="train step columns; decode positions")
  ap.add_argument("--microbatches", type=int, default=1)
  ap.add_argument("--slots", type=int, default=64, help="decode slots")
  ap.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "tpu_aot.json")
  args = ap.parse_args(argv)
  what = set(args.what.split(","))
  if not what or what - {"train", "decode"}:
    raise SystemExit(f"--what={args.what!r}: allowed train, decode or both")
  args.what = what
  if os.environ.get(CHILD_ENV):
    print("RESULT " + json.dumps(child(args)), flush=True)
    return {}
  libtpu = Path(os.environ.get("JAXRL_LIBTPU_DIR", ROOT / ".venv" / "libtpu"))
  if not (libtpu / "libtpu").is_dir():
    raise SystemExit(f"libtpu not found in {libtpu}: run launch/test.sh once (it installs it)")
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", **{CHILD_ENV: "1"})
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(libtpu), str(ROOT), env.get("PYTHONPATH")]))
  run = subprocess.run(
    [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])],
    env=env,
    capture_output=True,
    text=True,
  )
  for line in run.stdout.splitlines():
    if not line.startswith("RESULT "):
      print(line)
  found = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
  if run.returncode or not found:
    raise SystemExit(f"the compile failed:\n{run.stderr[-4000:]}")
  sys.path.insert(0, str(BENCH_DIR))
  from _common import machine, versions

  result = json.loads(found[-1][len("RESULT ") :])
  dist = sorted(libtpu.glob("libtpu-*.dist-info"))
  report = {
    "benchmark": "tpu_aot",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": {
      **versions(("jax", "jaxlib", "flax")),
      "libtpu": dist[-1].name.removeprefix("libtpu-").removesuffix(".dist-info") if dist else "?",
    },
    "result": result,
  }
  runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
  runs.append(report)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({"benchmark": "tpu_aot", "runs": runs}, indent=2) + "\n")
  print(f"appended to {args.out}")
  return report


if __name__ == "__main__":
  main()
