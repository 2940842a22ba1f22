"""Compile time vs depth, with and without `scan_layers`: the jitted forward and a train step.

For each depth L the model is the small benchmark shape (d256, 4/2 heads, head dim 64, MLP 1024,
byte vocab) with L layers. Two programs are built from abstract params (nothing is initialised):
  forward: `apply` -> logits [B, T, V];
  train:   value_and_grad of the masked mean token log-prob loss, then an SGD update.
Each is traced and lowered (`jax.jit(f).lower`), then compiled (`.compile()`); both times are
recorded, and their sum is what a first call pays before it runs. Variants: unrolled (the Python
loop over layers), scan (`scan_layers=True`), and for the train step scan with remat="full".
jax's in-memory caches are cleared before each measurement and no persistent cache is set, so
every compile is cold. Compile time is single-threaded CPU work: on a shared machine it is
approximate (other jobs' load moves it), so read the trend with depth, not the last digit.

  .venv/bin/python bench/compile_depth.py                  # depths 2,4,8,16,32
  .venv/bin/python bench/compile_depth.py --depths 2,4     # sanity run
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

from _common import machine, qwen3_shaped, versions  # noqa: E402

from jaxrl.models.transformer import (  # noqa: E402
  Transformer,
  apply,
  positions_from_mask,
  token_logprobs,
)

DEFAULT_OUT = BENCH_DIR / "results" / "compile_depth.json"
BATCH, LENGTH = 8, 128
VARIANTS = {  # name: (program, ModelConfig overrides)
  "forward/unrolled": ("forward", dict()),
  "forward/scan": ("forward", dict(scan_layers=True)),
  "train/unrolled": ("train", dict()),
  "train/scan": ("train", dict(scan_layers=True)),
  "train/scan+remat": ("train", dict(scan_layers=True, remat="full")),
}


def _program(kind: str, graphdef):
  if kind == "forward":
    return lambda params, tokens, valid: apply(
      graphdef, params, tokens, positions_from_mask(valid), valid
    )[0]

  def step(params, tokens, valid):
    def loss(p):
      logp = token_logprobs(graphdef, p, tokens, valid)
      return -jnp.sum(jnp.where(valid, logp, 0.0)) / jnp.sum(valid)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

  return step


def measure(depth: int, variant: str) -> dict:
  kind, overrides = VARIANTS[variant]
  cfg = qwen3_shaped(depth, 256, 4, 2, 1024).replace(**overrides)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
  valid = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.bool_)
  jax.clear_caches()
  t0 = time.perf_counter()
  lowered = jax.jit(_program(kind, graphdef)).lower(abstract, tokens, valid)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  hlo_lines = len(compiled.as_text().splitlines())
  return {
    "depth": depth,
    "variant": variant,
    "lower_s": round(t1 - t0, 3),
    "compile_s": round(t2 - t1, 3),
    "total_s": round(t2 - t0, 3),
    "compiled_hlo_lines": hlo_lines,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--depths", default="2,4,8,16,32")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = parser.parse_args()
  depths = [int(d) for d in args.depths.split(",")]
  variants = args.variants.split(",")
  rows = []
  print(
    f"{'variant':<18} {'L':>3} {'lower s':>8} {'compile s':>10} {'total s':>8} {'HLO lines':>10}"
  )
  for variant in variants:
    for depth in depths:
      row = measure(depth, variant)
      rows.append(row)
      print(
        f"{variant:<18} {depth:>3} {row['lower_s']:>8.2f} {row['compile_s']:>10.2f} "
        f"{row['total_s']:>8.2f} {row['compiled_hlo_lines']:>10}",
        flush=True,
      )
  result = {
    "benchmark": "compile_depth",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax")),
    "shape": {
      "embed_dim": 256,
      "heads": 4,
      "kv_heads": 2,
      "head_dim": 64,
      "mlp_dim": 1024,
      "vocab": 259,
      "batch": BATCH,
      "length": LENGTH,
    },  # fmt: skip
    "rows": rows,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
