"""How fast can one decode step's weight matmuls run on this CPU? A floor under every sampler.

A decode step at batch 16 multiplies 16 rows by every projection weight once: for the Qwen3-shaped
benchmark models (decode_throughput.py) these are, per layer, q/k/v [D, (N + 2K) H], o [N H, D],
gate/up [D, 2F] and down [F, D]. This script times exactly that chain of matmuls, layer after
layer with fresh weights (so, as in decoding, a layer's weights are not in cache when it runs),
and nothing else: no attention, norms, cache writes or sampling. It runs the chain with

  xla-f32     jnp.dot in float32 (what jaxrl, Tunix and any JAX sampler run)
  xla-f32-model  the same float32 chain over the weights as jaxrl's models store them: q, k, v,
              gate and up apart (the learner's own arrays, which the sampler reads without a
              copy), plus the output head: the floor of a sampler that does not fuse weights
  xla-int8    W8A8: int8 x int8 -> int32 dot with per-row / per-channel scales (jaxrl.quant)
  xla-int8-model  the same W8A8 chain over the model's own projections (q, k, v, gate, up
              apart, as `rl.rollout.quantize="int8"` quantizes them) and the float32 head it
              leaves unquantized: the floor of jaxrl's int8 sampler
  numpy-f32   numpy's BLAS (OpenBLAS in the numpy wheel)
  torch-f32   torch CPU (what HF generate runs), all cores

and reports ms per step and GFLOP/s. Any sampler's decode step costs at least the f32 chain's
time; a peer's measured step time divided by it bounds the speed-up any float32 sampler can show.

  .venv/bin/python bench/matmul_ceiling.py                 # both models
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import MODELS, machine, num_cores, versions  # noqa: E402

from jaxrl.quant import int8_einsum, quantize_int8  # noqa: E402

ROWS = 16


def shapes(cfg) -> list[tuple[int, int]]:
  """(in, out) of one layer's fused projection matmuls."""
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  return [(d, (n + 2 * k) * h), (n * h, d), (d, 2 * f), (f, d)]


def model_shapes(cfg) -> list[tuple[int, int]]:
  """(in, out) of one layer's projections as the model stores them: q, k, v, o, gate, up, down."""
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  return [(d, n * h), (d, k * h), (d, k * h), (n * h, d), (d, f), (d, f), (f, d)]


def _chain(x, layers, mm):
  # Each matmul's input is made from the previous output so nothing can run ahead or be skipped.
  for ws in layers:
    for w in ws:
      d_in = w.shape[0]  # a QArray has its weight's shape too
      y = mm(jnp.tile(x, (1, -(-d_in // x.shape[1])))[:, :d_in], w)
      y = jnp.tile(y, (1, -(-x.shape[1] // y.shape[1])))  # k/v outputs are narrower than x
      x = x + 1e-3 * y[:, : x.shape[1]]
  return x


def _time(fn, reps: int) -> float:
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run(model: str, reps: int) -> list[dict]:
  cfg = MODELS[model]()
  rng = np.random.default_rng(0)
  layer_shapes = shapes(cfg)
  weights = [
    [(0.02 * rng.standard_normal(s)).astype(np.float32) for s in layer_shapes]
    for _ in range(cfg.num_layers)
  ]
  flops = 2 * ROWS * cfg.num_layers * sum(a * b for a, b in layer_shapes)
  x = np.ones((ROWS, cfg.embed_dim), np.float32)
  out = []

  f32 = [[jnp.asarray(w) for w in ws] for ws in weights]
  chain = jax.jit(lambda x, ws: _chain(x, ws, jnp.dot))
  out.append(("xla-f32", _time(lambda: chain(x, f32).block_until_ready(), reps)))

  # The same FLOPs in the model's own weight layout, and its output head.
  head = (cfg.embed_dim, cfg.vocab_size)
  stored = [model_shapes(cfg)] * cfg.num_layers + [[head]]
  stored = [
    [jnp.asarray((0.02 * rng.standard_normal(s)).astype(np.float32)) for s in ws] for ws in stored
  ]
  model_flops = 2 * ROWS * sum(w.shape[0] * w.shape[1] for ws in stored for w in ws)
  t = _time(lambda: chain(x, stored).block_until_ready(), reps)
  model_row = {"model": model, "impl": "xla-f32-model", "ms_per_step": 1e3 * t}
  model_row["gflops"] = model_flops / t / 1e9

  q8 = [[quantize_int8(jnp.asarray(w), 1) for w in ws] for ws in weights]
  int8 = jax.jit(lambda x, ws: _chain(x, ws, lambda a, w: int8_einsum("BD,DF->BF", a, w)))
  out.append(("xla-int8", _time(lambda: int8(x, q8).block_until_ready(), reps)))

  # int8 projections in the model's layout; the head stays float32 (quantize_params skips it).
  q8_model = [[quantize_int8(w, 1) for w in ws] for ws in stored[:-1]] + [stored[-1]]
  mixed = lambda a, w: jnp.dot(a, w) if isinstance(w, jax.Array) else int8_einsum("BD,DF->BF", a, w)  # noqa: E731
  int8_model = jax.jit(lambda x, ws: _chain(x, ws, mixed))
  t = _time(lambda: int8_model(x, q8_model).block_until_ready(), reps)
  int8_model_row = {"model": model, "impl": "xla-int8-model", "ms_per_step": 1e3 * t}
  int8_model_row["gflops"] = model_flops / t / 1e9

  def numpy_chain():
    _chain_np(x, weights, np.dot)

  out.append(("numpy-f32", _time(numpy_chain, reps)))

  import torch

  torch.set_num_threads(num_cores())
  tw = [[torch.from_numpy(w.copy()) for w in ws] for ws in weights]
  tx = torch.from_numpy(x.copy())
  with torch.inference_mode():
    out.append(("torch-f32", _time(lambda: _chain_np(tx, tw, torch.matmul, torch.tile), reps)))
  rows = [
    {"model": model, "impl": name, "ms_per_step": 1e3 * t, "gflops": flops / t / 1e9}
    for name, t in out
  ]
  return rows[:1] + [model_row] + rows[1:2] + [int8_model_row] + rows[2:]


def _chain_np(x, layers, mm, tile=np.tile):
  for ws in layers:
    for w in ws:
      y = mm(tile(x, (1, -(-w.shape[0] // x.shape[1])))[:, : w.shape[0]], w)
      x = x + 1e-3 * y[:, : x.shape[1]]
  return x


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--models", default="small,medium")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "matmul_ceiling.json")
  args = ap.parse_args(argv)
  models = [m for m in args.models.split(",") if m]
  bad = [m for m in models if m not in MODELS]
  if bad or not models:
    raise SystemExit(f"--models={args.models!r}: unknown {bad or 'empty'}; allowed: {list(MODELS)}")
  if args.reps <= 0:
    raise SystemExit(f"--reps must be positive, got {args.reps}")
  results = [r for m in models for r in run(m, args.reps)]
  print(f"\n{'model':8} {'impl':14} {'ms/step':>9} {'GFLOP/s':>9}")
  for r in results:
    print(f"{r['model']:8} {r['impl']:14} {r['ms_per_step']:9.2f} {r['gflops']:9.1f}")
  report = {
    "benchmark": "matmul_ceiling",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": {**versions(), "numpy": np.__version__, "python": platform.python_version()},
    "settings": {"rows": ROWS, "reps": args.reps, "models": models},
    "results": results,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
