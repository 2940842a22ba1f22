"""The Pallas kernels compiled for real on an accelerator: checked against their jnp references,
then timed against the float path they replace. Prepared for the device machine (an NVIDIA H200
when one is lent); on a CPU it refuses rather than report interpret-mode timings as kernel speed.

  python bench/device_kernels.py --out=$OUT/device_kernels.json     # on the GPU / TPU machine

For each quantized-matmul case (W8A8 int8, W8A8 fp8 e4m3, W8A16 bf16 x e4m3) at decode (M = 64)
and prefill (M = 4096) shapes with K = N = 4096, it compiles `quant_matmul` with the backend's
kernel (pallas_gpu / pallas_tpu), compares it with the reference on the same backend (int8:
equal; fp8 / bf16: relative error), and times both against `jnp.dot` of bf16 operands. Then one
decode step of paged attention (64 sequences of up to 2,048 keys in 16-token pages, 32 query and
8 kv heads of 128, bf16 and fp8 pages) through the backend's kernel (`paged_attention`,
pallas_gpu / pallas_tpu) against the jnp reference that gathers the pages. Then the MoE experts'
grouped matmul (`grouped_matmul`, pallas_gpu / pallas_tpu) in bf16 at a Qwen-MoE-like shape
(8,192 routed rows over 8 or 64 experts of uneven sizes, K = 2,048, N = 1,408) against
`jax.lax.ragged_dot`. A case whose kernel fails to compile is recorded with its error and the
script goes on to the next (the exit status says so). The JSON records the device, jax version,
date and per-case medians; docs/benchmarks.md takes them.
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
from _common import median_seconds as _time  # noqa: E402

from jaxrl.kernels.grouped_matmul import grouped_matmul  # noqa: E402
from jaxrl.kernels.paged_attention import PagedKV, paged_attention  # noqa: E402
from jaxrl.kernels.quant_matmul import quant_matmul, resolve_impl  # noqa: E402
from jaxrl.quant import quantize, quantize_activations  # noqa: E402

CASES = {
  "w8a8_int8": (jnp.int8, jnp.int8),
  "w8a8_e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
  "w8a16_bf16_e4m3": (jnp.bfloat16, jnp.float8_e4m3fn),
}


def paged_rows(impl: str, reps: int) -> list[dict]:
  """One decode step of paged attention through `impl` vs the reference, bf16 and fp8 pages."""
  b, n, kh, h, ps, m = 64, 32, 8, 128, 16, 128
  rng = np.random.default_rng(1)
  pages = b * m
  lengths = rng.integers(1, m * ps + 1, size=b).astype(np.int32)
  table = rng.permutation(pages).reshape(b, m).astype(np.int32)
  q = jnp.asarray(rng.normal(size=(b, 1, n, h)), jnp.bfloat16)
  pos = jnp.asarray(lengths[:, None] - 1)
  rows = []
  for kind in ("bf16", "fp8"):
    k32, v32 = (rng.normal(size=(kh, pages, ps, h)).astype(np.float32) for _ in range(2))
    if kind == "bf16":
      kp, vp, ks, vs = jnp.asarray(k32, jnp.bfloat16), jnp.asarray(v32, jnp.bfloat16), None, None
    else:
      ks = vs = jnp.full((kh,), 8.0 / 448.0, jnp.float32)
      kp = jnp.asarray(np.clip(k32 / (8.0 / 448.0), -448, 448), jnp.float8_e4m3fn)
      vp = jnp.asarray(np.clip(v32 / (8.0 / 448.0), -448, 448), jnp.float8_e4m3fn)
    cache = PagedKV(kp, vp, jnp.asarray(table), jnp.asarray(lengths), ks, vs)
    kern = jax.jit(lambda q, c: paged_attention(q, c, pos, impl=impl))
    ref = jax.jit(lambda q, c: paged_attention(q, c, pos, impl="reference"))
    got = np.asarray(kern(q, cache).astype(jnp.float32))
    want = np.asarray(ref(q, cache).astype(jnp.float32))
    row = {
      "case": f"paged_attention_{kind}",
      "max_rel_err_vs_reference": float(np.abs(got - want).max() / np.abs(want).max()),
      "kernel_s": _time(kern, q, cache, reps=reps),
      "reference_s": _time(ref, q, cache, reps=reps),
    }
    row["kernel_vs_reference"] = row["reference_s"] / row["kernel_s"]
    print(
      f"{row['case']:24s} err {row['max_rel_err_vs_reference']:.2e}  kernel "
      f"{row['kernel_s'] * 1e6:9.1f} us  reference {row['reference_s'] * 1e6:9.1f} us  "
      f"({row['kernel_vs_reference']:.2f}x)",
      flush=True,
    )
    rows.append(row)
  return rows


def moe_rows(impl: str, reps: int) -> list[dict]:
  """The experts' grouped matmul through `impl` vs ragged_dot, bf16, uneven group sizes."""
  m, k, n = 8192, 2048, 1408
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  rows = []
  for e in (8, 64):
    share = rng.dirichlet(np.full(e, 0.5))  # skewed, some groups near empty
    sizes = np.floor(share * m).astype(np.int32)
    sizes[-1] += m - sizes.sum()
    rhs = jnp.asarray(rng.normal(size=(e, k, n)) / np.sqrt(k), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    row = {"case": f"grouped_matmul_e{e}", "m": m, "k": k, "n": n}
    try:
      kern = jax.jit(lambda a, b, g: grouped_matmul(a, b, g, impl=impl))
      ref = jax.jit(lambda a, b, g: grouped_matmul(a, b, g, impl="reference"))
      got = np.asarray(kern(lhs, rhs, gs).astype(jnp.float32))
      want = np.asarray(ref(lhs, rhs, gs).astype(jnp.float32))
      row["max_rel_err_vs_reference"] = float(np.abs(got - want).max() / np.abs(want).max())
      row["kernel_s"] = _time(kern, lhs, rhs, gs, reps=reps)
      row["reference_s"] = _time(ref, lhs, rhs, gs, reps=reps)
      row["kernel_vs_reference"] = row["reference_s"] / row["kernel_s"]
      print(
        f"{row['case']:24s} err {row['max_rel_err_vs_reference']:.2e}  kernel "
        f"{row['kernel_s'] * 1e6:9.1f} us  ragged_dot {row['reference_s'] * 1e6:9.1f} us  "
        f"({row['kernel_vs_reference']:.2f}x)",
        flush=True,
      )
    except Exception as err:  # noqa: BLE001  (a device run records what failed, then goes on)
      row["error"] = f"{type(err).__name__}: {err}"[:2000]
      print(f"{row['case']:24s} FAILED: {row['error'][:300]}", flush=True)
    rows.append(row)
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="bench/results/device_kernels.json")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", type=int, default=4096)
  ap.add_argument("--block", default="128,128,128", help="bm,bn,bk")
  args = ap.parse_args(argv)
  impl = resolve_impl("auto")
  if impl == "reference":
    print(f"no kernel backend here ({jax.default_backend()}): run this on a GPU or TPU machine")
    return 2
  block = tuple(int(b) for b in args.block.split(","))
  rng = np.random.default_rng(0)
  w32 = jnp.asarray(rng.normal(size=(args.k, args.n)).astype(np.float32))
  rows = []
  for m in (64, 4096):
    x32 = jnp.asarray(rng.normal(size=(m, args.k)).astype(np.float32))
    xb, wb = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    t_bf16 = _time(bf16, xb, wb, reps=args.reps)
    for case, (x_dtype, w_dtype) in CASES.items():
      q = quantize(w32, 1, w_dtype)
      if jnp.dtype(x_dtype).itemsize == 1:
        xq, xs = quantize_activations(x32, (1,), x_dtype)
      else:
        xq, xs = x32.astype(x_dtype), None
      kern = jax.jit(lambda a, b, c, d: quant_matmul(a, b, c, d, impl=impl, block=block))
      ref = jax.jit(lambda a, b, c, d: quant_matmul(a, b, c, d, impl="reference"))
      got, want = (
        np.asarray(kern(xq, q.values, q.scale, xs)),
        np.asarray(ref(xq, q.values, q.scale, xs)),
      )
      err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
      row = {
        "case": case,
        "m": m,
        "k": args.k,
        "n": args.n,
        "max_rel_err_vs_reference": err,
        "kernel_s": _time(kern, xq, q.values, q.scale, xs, reps=args.reps),
        "reference_s": _time(ref, xq, q.values, q.scale, xs, reps=args.reps),
        "bf16_dot_s": t_bf16,
      }
      row["kernel_vs_bf16"] = row["bf16_dot_s"] / row["kernel_s"]
      rows.append(row)
      print(
        f"{case:18s} M={m:5d}  err {err:.2e}  kernel {row['kernel_s'] * 1e6:9.1f} us  "
        f"reference {row['reference_s'] * 1e6:9.1f} us  bf16 dot {t_bf16 * 1e6:9.1f} us  "
        f"(bf16 / kernel {row['kernel_vs_bf16']:.2f}x)",
        flush=True,
      )
  paged_impl = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}[jax.default_backend()]
  rows += paged_rows(paged_impl, args.reps)
  rows += moe_rows(paged_impl, args.reps)
  record = {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "device": str(jax.devices()[0].device_kind),
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "impl": impl,
    "block": block,
    "rows": rows,
  }
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
  # bf16 attention outputs: the kernel and the reference round differently (2**-8 relative).
  tol = {"w8a8_int8": 0.0, "paged_attention_bf16": 1e-2, "paged_attention_fp8": 1e-2}
  tol |= {"grouped_matmul_e8": 1e-2, "grouped_matmul_e64": 1e-2}  # bf16 outputs
  bad = [
    r for r in rows if "error" in r or r["max_rel_err_vs_reference"] > tol.get(r["case"], 1e-3)
  ]
  if bad:
    print(f"FAILED or MISMATCH against the reference: {[(r['case'], r.get('m')) for r in bad]}")
    return 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
