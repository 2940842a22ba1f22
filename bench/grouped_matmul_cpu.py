"""The MoE experts' grouped matmul on a CPU: XLA's `jax.lax.ragged_dot` against the plain-jnp
tiled walk (`grouped_matmul(impl="tiled")`, what `moe_kernel="auto"` picks on a CPU), forward and
forward + gradients, in one run so the ratios compare like with like.

  .venv/bin/python bench/grouped_matmul_cpu.py --json=bench/results/grouped_matmul_cpu.json

Shapes: `arith_small` MoE's training step (the RL batch's 512 sequences x ~20 tokens x top 2 =
20,480 routed rows, D = 128, expert width 96, 8 experts) and a larger layer (4,096 rows,
D = 512, width 384, 32 experts); group sizes drawn unevenly (Dirichlet(0.5) shares). Each row
of the JSON: median milliseconds of `--reps` calls after a compile call, and the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine, median_seconds, versions  # noqa: E402

from jaxrl.kernels.grouped_matmul import grouped_matmul  # noqa: E402

SHAPES = {"arith_small_moe": (20480, 128, 96, 8), "larger": (4096, 512, 384, 32)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  rng = np.random.default_rng(0)
  rows = []
  for name, (m, k, n, e) in SHAPES.items():
    sizes = np.floor(rng.dirichlet(np.full(e, 0.5)) * m).astype(np.int32)
    sizes[-1] += m - sizes.sum()
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(e, k, n)) / np.sqrt(k), jnp.float32)
    gs = jnp.asarray(sizes)
    row = {"shape": name, "m": m, "k": k, "n": n, "experts": e}
    outs = {}
    for impl in ("reference", "tiled"):
      fwd = jax.jit(lambda a, b, impl=impl, gs=gs: grouped_matmul(a, b, gs, impl=impl))
      grad = jax.jit(
        jax.grad(
          lambda a, b, impl=impl, gs=gs: jnp.sum(grouped_matmul(a, b, gs, impl=impl) ** 2),
          argnums=(0, 1),
        )
      )
      outs[impl] = np.asarray(fwd(lhs, rhs))
      row[f"{impl}_fwd_ms"] = median_seconds(fwd, lhs, rhs, reps=args.reps) * 1e3
      row[f"{impl}_grad_ms"] = median_seconds(grad, lhs, rhs, reps=args.reps) * 1e3
    row["max_abs_diff"] = float(np.abs(outs["tiled"] - outs["reference"]).max())
    row["fwd_speedup"] = row["reference_fwd_ms"] / row["tiled_fwd_ms"]
    row["grad_speedup"] = row["reference_grad_ms"] / row["tiled_grad_ms"]
    rows.append(row)
    print(
      f"{name:16s} ragged_dot fwd {row['reference_fwd_ms']:8.1f} ms  grad "
      f"{row['reference_grad_ms']:8.1f} ms | tiled fwd {row['tiled_fwd_ms']:8.1f} ms  grad "
      f"{row['tiled_grad_ms']:8.1f} ms | {row['fwd_speedup']:.1f}x / {row['grad_speedup']:.1f}x  "
      f"(max |diff| {row['max_abs_diff']:.1e})",
      flush=True,
    )
  if args.json:
    record = {
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "machine": machine(),
      "versions": versions(("jax", "jaxlib")),
      "rows": rows,
    }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
