"""The 2-D projections against the dot_general they replaced, on the default job's own shapes.

`jaxrl/kernels/contract.py` emits each projection as one 2-D dot since d4e2a65 (the reason is in
its docstring and `docs/benchmarks.md`). This script keeps the previous form (`dot_general` over
the contracted axes in the weight's order, then a transpose to the output order) and times the
default model's (`arith_small`, float32) forward + backward with each, interleaved call by call
in one process, at the SFT warm-start's batch (128 problems x 16 tokens) and at the RL update's
(512 rows x 24 tokens). A result is the ratio 2-D / previous per call; the VM's speed drifts
between runs, so compare within one.

  .venv/bin/python bench/contract_ab.py [--reps 15] [--out bench/results/contract_ab.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine, versions  # noqa: E402

import jaxrl.models.linear as linear  # noqa: E402
from jaxrl.kernels.contract import contract  # noqa: E402
from jaxrl.models.config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import make_model, token_logprobs  # noqa: E402

SHAPES = {"sft": (128, 16), "rl": (512, 24)}


def previous_contract(eq, x, w, *, preferred_element_type=None):
  """contract before d4e2a65: one dot_general in w's axis order, then the output transpose."""
  ins, out = eq.split("->")
  xs, ws = ins.split(",")
  contracted = [c for c in ws if c in xs]
  dims = (([xs.index(c) for c in contracted], [ws.index(c) for c in contracted]), ((), ()))
  y = jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)
  got = [c for c in xs if c not in contracted] + [c for c in ws if c not in contracted]
  return y if got == list(out) else jnp.transpose(y, [got.index(c) for c in out])


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "contract_ab.json")
  args = ap.parse_args(argv)
  if args.reps <= 0:
    raise SystemExit(f"--reps must be positive, got {args.reps}")
  graphdef, params = make_model(ModelConfig.arith_small(), seed=0)

  def grad_fn(fn):
    linear.contract = fn  # read when the model is traced, i.e. by the first call below
    return jax.jit(jax.value_and_grad(lambda p, t, v: -jnp.mean(token_logprobs(graphdef, p, t, v))))

  results = {}
  try:
    for name, (b, t) in SHAPES.items():
      tokens = jnp.asarray(np.random.default_rng(0).integers(3, 250, (b, t)), jnp.int32)
      valid = jnp.ones((b, t), bool)
      fns = {}
      for kind, fn in (("previous", previous_contract), ("2d", contract)):
        fns[kind] = grad_fn(fn)
        jax.block_until_ready(fns[kind](params, tokens, valid))  # compile with this contract
      times = {k: [] for k in fns}
      for _ in range(args.reps):
        for kind, f in fns.items():
          t0 = time.perf_counter()
          jax.block_until_ready(f(params, tokens, valid))
          times[kind].append(time.perf_counter() - t0)
      by_call = [a / p for a, p in zip(times["2d"], times["previous"], strict=True)]
      results[name] = {
        "batch": [b, t],
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "times_s": times,
        "ratio_2d_over_previous_by_call": {
          "median": statistics.median(by_call),
          "min": min(by_call),
          "max": max(by_call),
        },
      }
      r = results[name]["ratio_2d_over_previous_by_call"]
      print(
        f"{name} [{b}, {t}]: previous {results[name]['median_ms']['previous']:.1f} ms, 2-D "
        f"{results[name]['median_ms']['2d']:.1f} ms; 2-D / previous by call {r['median']:.3f} "
        f"({r['min']:.3f} - {r['max']:.3f})",
        flush=True,
      )
  finally:
    linear.contract = contract
  record = {
    "benchmark": "contract_ab",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax")),
    "settings": {"model": "arith_small float32", "reps": args.reps, "what": "value_and_grad"},
    "results": results,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=1))
  print(f"wrote {args.out}")
  return record


if __name__ == "__main__":
  main()
