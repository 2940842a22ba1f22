"""The Pallas kernels compiled for real on an accelerator: checked against their jnp references,
then timed against the float path they replace, on an NVIDIA GPU or a TPU; on a CPU it refuses
rather than report interpret-mode timings as kernel speed.

  python bench/device_kernels.py --out=$OUT/device_kernels.json     # on the GPU / TPU machine

For each quantized-matmul case (W8A8 int8, W8A8 fp8 e4m3, W8A16 bf16 x e4m3; `--cases`) at decode
(M = 64) and prefill (M = 4096) shapes with K = 4096 and each N of `--n` (4096), it compiles
`quant_matmul` with the backend's kernel (pallas_gpu / pallas_tpu) in each `--block` config
(blocks, Triton launch, K split), compares it with the reference on the same backend (int8:
equal unless split; fp8 / bf16: relative error), and times both against `jnp.dot` of bf16
operands. `--matmul-impl=pallas_gpu,pallas_mgpu` runs these sections for the Triton kernel and
then the Hopper-native Mosaic GPU one (TMA pipeline, wgmma; W8A8 only, weights K-major; of a
`--block` entry's launch it takes the stages, its num_warps being one warpgroup's). Then one
decode step of paged attention (64 sequences of up to 2,048 keys in 16-token pages, 32 query and
8 kv heads of 128, bf16 and fp8 pages) through the backend's kernel (`paged_attention`,
pallas_gpu / pallas_tpu) against the jnp reference that gathers the pages. Then the MoE experts'
grouped matmul (`grouped_matmul`, pallas_gpu / pallas_tpu) in bf16 at a Qwen-MoE-like shape
(8,192 routed rows over 8 or 64 experts of uneven sizes, K = 2,048, N = 1,408) against
`jax.lax.ragged_dot`. A case whose kernel fails to compile is recorded with its error and the
script goes on to the next (the exit status says so). The JSON records the device, jax version,
date and per-case medians; docs/benchmarks.md takes them.

Around the kernels: the device's copy bandwidth (a bf16 array read and written once; the roofline
the decode rows are set against) and whole-model decode at a Llama-3.2-1B shape in bf16 (random
weights, 64 rows): the v0 sampler's time per decode step against the bytes one step must read
(weights + the KV cache), and the continuous-batching engine with the reference and the Pallas
paged attention. Every case runs on its own: one that fails is recorded with its error and the
rest go on; the JSON is rewritten after every case, so a run cut short keeps what it measured.

  python bench/device_kernels.py --smoke     # here, on a CPU: every case through the Pallas
                                             # interpreter at toy shapes (checks the script, not
                                             # the kernels' speed; writes no results file)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import median_seconds as _time  # noqa: E402

from jaxrl.kernels.grouped_matmul import grouped_matmul  # noqa: E402
from jaxrl.kernels.paged_attention import PagedKV, paged_attention  # noqa: E402
from jaxrl.kernels.quant_matmul import (  # noqa: E402
  auto_split_k,
  mgpu_split_k,
  quant_matmul,
  resolve_impl,
)
from jaxrl.models.config import ModelConfig  # noqa: E402
from jaxrl.quant import quantize, quantize_activations, quantize_params  # noqa: E402

CASES = {
  "w8a8_int8": (jnp.int8, jnp.int8),
  "w8a8_e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
  "w8a16_bf16_e4m3": (jnp.bfloat16, jnp.float8_e4m3fn),
}
# Largest relative error against the reference, by case (prefix): int8 accumulates exactly; bf16
# outputs (attention, grouped matmul) round differently from the reference (2**-8 relative).
COPIES = 16  # distinct operand sets per timing (_device_seconds): 8 x 16 MiB > the 60 MB L2
# (--copies sets it: more calls per program average out more of the noise at decode shapes)
TOL = {"w8a8_int8": 0.0, "paged_attention": 1e-2, "grouped_matmul": 1e-2}
SPLIT_TOL = 1e-6  # a K split sums float32 partials in any order: int8 is then not bit-exact


class Run:
  """The rows measured so far, rewritten to `out` after each case; `case` isolates failures."""

  def __init__(self, out: Path | None, meta: dict):
    self.out, self.meta, self.rows = out, meta, []

  def save(self) -> None:
    if self.out is not None:
      self.out.parent.mkdir(parents=True, exist_ok=True)
      self.out.write_text(json.dumps(self.meta | {"rows": self.rows}, indent=1) + "\n")

  def case(self, name: str, fn, **fields) -> dict:
    row = {"case": name, **fields}
    t0 = time.perf_counter()
    try:
      row |= fn()
    except Exception as err:  # noqa: BLE001  (a device run records what failed, then goes on)
      row["error"] = f"{type(err).__name__}: {err}"[:3000]
      print(f"{name:26s} FAILED: {row['error'][:600]}", flush=True)
    row["case_wall_s"] = round(time.perf_counter() - t0, 2)
    self.rows.append(row)
    self.save()
    return row

  def bad(self) -> list[dict]:
    def tol(r):
      return next((v for k, v in TOL.items() if r["case"].startswith(k)), 1e-3)

    def limit(r):
      return SPLIT_TOL if r.get("split_k", 1) > 1 else tol(r)

    return [
      r
      for r in self.rows
      if "error" in r
      or r.get("max_rel_err_vs_reference", 0) > limit(r)
      or r.get("rel_err_vs_f32", 0) > ODD_TOL
    ]


def _device_seconds(f, arg_sets, reps: int) -> tuple[float, float]:
  """Device seconds per call of f, host dispatch excluded: one jitted program calls f on each of
  the first half of `arg_sets`, another on all of them (distinct operands, so no call is merged
  with another, and together larger than the L2, so no call finds its weights cached); the
  difference of their median times over the extra calls. A decode-shape kernel takes a few
  microseconds; timing it call by call from the host measures the dispatch (~50 us here).
  Returns (that difference, the whole program's median over its calls): the difference of two
  noisy medians can be off (on the H200 it once put a bf16 dot below the bytes' time); the
  second is an upper bound (one dispatch shared by all calls) that cannot be."""
  half = len(arg_sets) // 2

  def program(sets):
    return jax.jit(
      lambda *flat: [f(*flat[i : i + len(sets[0])]) for i in range(0, len(flat), len(sets[0]))]
    )

  small, big = program(arg_sets[:half]), program(arg_sets)
  flat_small = [a for args in arg_sets[:half] for a in args]
  flat_big = [a for args in arg_sets for a in args]
  t_small = _time(small, *flat_small, reps=reps)
  t_big = _time(big, *flat_big, reps=reps)
  diff = max(t_big - t_small, 1e-9) / (len(arg_sets) - half)  # noise can make it <= 0 on a CPU
  return diff, t_big / len(arg_sets)


def _rel_err(got, want) -> float:
  got, want = (np.asarray(jnp.asarray(a).astype(jnp.float32)) for a in (got, want))
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _compare(kern, ref, arg_sets, reps: int) -> dict:
  """Error of kern against ref on the first argument set, then both timed over all of them."""
  row = {"max_rel_err_vs_reference": _rel_err(kern(*arg_sets[0]), ref(*arg_sets[0]))}
  row["kernel_s"], row["kernel_amortized_s"] = _device_seconds(kern, arg_sets, reps)
  row["reference_s"], row["reference_amortized_s"] = _device_seconds(ref, arg_sets, reps)
  row["kernel_vs_reference"] = row["reference_s"] / row["kernel_s"]
  return row


def _show(row: dict, extra: str = "") -> None:
  if "error" not in row and "kernel_s" in row:
    print(
      f"{row['case']:26s} err {row['max_rel_err_vs_reference']:.2e}  kernel "
      f"{row['kernel_s'] * 1e6:9.1f} us  reference {row['reference_s'] * 1e6:9.1f} us  "
      f"({row['kernel_vs_reference']:.2f}x){extra}",
      flush=True,
    )


def _activations(x32, x_dtype):
  """(x as the kernel takes it, its per-row scales or None, the float32 values it stands for):
  8-bit codes with scales (W8A8) or the float x itself (W8A16)."""
  if jnp.dtype(x_dtype).itemsize == 1:
    xq, xs = quantize_activations(x32, (1,), x_dtype)
    return xq, xs, xq.astype(jnp.float32) * xs.reshape(-1, 1)
  xq = x32.astype(x_dtype)
  return xq, None, xq.astype(jnp.float32)


def matmul_cases(
  run: Run, impl: str, k: int, n: int, ms, configs, reps: int, interpret: bool, cases=CASES
):
  """quant_matmul (each `cases` format, each (block, launch, split_k) config) vs its reference
  and a bf16
  jnp.dot, per M; both also against the float32 product of the dequantized operands (which of
  the two accumulates less precisely). Each timing cycles over `COPIES` weights (L2 misses).
  The Mosaic GPU kernel (pallas_mgpu) takes its weights K-major ([N, K], transposed once
  before the timings, as a K-major quantize-on-sync would store them)."""
  kmajor = impl == "pallas_mgpu"
  rng = np.random.default_rng(0)
  copies = 2 if interpret else COPIES
  keys = jax.random.split(jax.random.key(n), copies)  # drawn on the device: 32 x 4096 x 14336
  w32s = [jax.random.normal(key, (k, n), jnp.float32) for key in keys]
  bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  exact = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest"))
  for m in ms:
    x32 = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
    xb = x32.astype(jnp.bfloat16)
    t_bf16, a_bf16 = _device_seconds(bf16, [(xb, w.astype(jnp.bfloat16)) for w in w32s], reps)
    for case in cases:
      x_dtype, w_dtype = CASES[case]
      qs = [quantize(w, 1, w_dtype) for w in w32s]
      xq, xs, x_deq = _activations(x32, x_dtype)
      want = exact(x_deq, qs[0].values.astype(jnp.float32) * qs[0].scale.reshape(1, n))
      if kmajor and xs is None:
        continue  # W8A16: the Mosaic GPU kernel multiplies 8-bit pairs only
      sets = [(xq, _weight(q.values, kmajor), q.scale, xs) for q in qs]
      for block, launch, split in configs:
        if impl == "pallas_tpu" and split is not None:
          continue  # the K split is the GPU kernels'
        if kmajor and launch is not None:
          launch = (None, launch[1])  # one warpgroup; (num_warps, stages) -> (None, stages)
        if kmajor and any(v % 64 for v in block):
          print(f"  {case} block {block}: not a pallas_mgpu block (multiples of 64), skipped")
          continue

        def one(block=block, launch=launch, split=split, sets=sets, want=want, bf=(t_bf16, a_bf16)):
          kern = jax.jit(
            lambda a, b, c, d: quant_matmul(
              a, b, c, d, impl=impl, block=block, interpret=interpret, launch=launch,
              split_k=split, w_kmajor=kmajor,
            )
          )  # fmt: skip
          ref = jax.jit(
            lambda a, b, c, d: quant_matmul(a, b, c, d, impl="reference", w_kmajor=kmajor)
          )
          row = _compare(kern, ref, sets, reps)
          row["kernel_rel_err_vs_f32"] = _rel_err(kern(*sets[0]), want)
          row["reference_rel_err_vs_f32"] = _rel_err(ref(*sets[0]), want)
          return row | {
            "bf16_dot_s": bf[0],
            "kernel_vs_bf16": bf[0] / row["kernel_s"],
            "bf16_dot_amortized_s": bf[1],
            "kernel_vs_bf16_amortized": bf[1] / row["kernel_amortized_s"],
          }

        if impl in _SPLITS:
          split = _SPLITS[impl](m, n, k, block) if split is None else split
        cfg = {"block": list(block), "launch": None if launch is None else list(launch)}
        row = run.case(case, one, impl=impl, m=m, k=k, n=n, split_k=split or 1, **cfg)
        _show(
          row,
          f"  bf16 dot {t_bf16 * 1e6:.1f} us (bf16 / kernel {row.get('kernel_vs_bf16', 0):.2f}x;"
          f" amortized {a_bf16 * 1e6:.1f} / {row.get('kernel_amortized_s', 0) * 1e6:.1f} us ="
          f" {row.get('kernel_vs_bf16_amortized', 0):.2f}x)"
          f"  block {block} launch {launch} split {split}  vs f32: kernel "
          f"{row.get('kernel_rel_err_vs_f32', -1):.1e} "
          f"reference {row.get('reference_rel_err_vs_f32', -1):.1e}",
        )


_SPLITS = {"pallas_gpu": auto_split_k, "pallas_mgpu": mgpu_split_k}  # the kernels' K-split rules


def _weight(values, kmajor: bool):
  """The [K, N] codes, or a K-major [N, K] copy made now (outside any timing)."""
  return jnp.asarray(values.T).block_until_ready() if kmajor else values


ODD_SHAPES = ((10, 200, 24), (5, 1000, 300), (33, 520, 130), (64, 4096, 1000))
ODD_TOL = 1e-5  # relative to the largest output, against float32 products of the same codes


def odd_shape_cases(run: Run, impl: str, interpret: bool, shapes=ODD_SHAPES):
  """Correctness only: `quant_matmul` compiled for `impl` on shapes that fit no block, every
  format, without and with K splits, against the float32 product of the dequantized operands
  (not the backend's own 8-bit dot, which on Hopper accumulates fp8 less precisely)."""
  exact = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest"))
  for m, k, n in shapes:
    rng = np.random.default_rng(m * k + n)
    x32 = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
    w32 = jnp.asarray(rng.normal(size=(k, n)).astype(np.float32))
    for case, (x_dtype, w_dtype) in CASES.items():
      q = quantize(w32, 1, w_dtype)
      xq, xs, x_deq = _activations(x32, x_dtype)
      want = exact(x_deq, q.values.astype(jnp.float32) * q.scale.reshape(1, n))
      kmajor = impl == "pallas_mgpu"
      if kmajor and xs is None:
        continue  # W8A16: not the Mosaic GPU kernel's
      for split in (1, 2, 4, None) if impl in _SPLITS else (None,):

        def one(split=split, xq=xq, q=q, xs=xs, want=want, kmajor=kmajor):
          got = quant_matmul(
            xq, _weight(q.values, kmajor), q.scale, xs, impl=impl, interpret=interpret,
            split_k=split, w_kmajor=kmajor,
          )  # fmt: skip
          return {"rel_err_vs_f32": _rel_err(got, want)}

        auto = _SPLITS.get(impl)
        resolved = split or (auto(m, n, k, (128, 128, 128)) if auto else 1)
        row = run.case(f"odd_{case}", one, impl=impl, m=m, k=k, n=n, split_k=resolved)
        print(f"{row['case']:26s} {(m, k, n)} split {resolved}: {row.get('rel_err_vs_f32')}")


def paged_cases(run: Run, impl: str, shape: dict, reps: int, interpret: bool):
  """One decode step of paged attention through `impl` vs the reference, bf16 and fp8 pages."""
  b, n, kh, h, ps, m = (shape[key] for key in ("b", "n", "kh", "h", "ps", "m"))
  rng = np.random.default_rng(1)
  pages = b * m
  lengths = rng.integers(1, m * ps + 1, size=b).astype(np.int32)
  table = rng.permutation(pages).reshape(b, m).astype(np.int32)
  copies = 2 if interpret else COPIES
  qs = [jnp.asarray(rng.normal(size=(b, 1, n, h)), jnp.bfloat16) for _ in range(copies)]
  pos = jnp.asarray(lengths[:, None] - 1)
  for kind in ("bf16", "fp8"):

    def one(kind=kind):
      k32, v32 = (rng.normal(size=(kh, pages, ps, h)).astype(np.float32) for _ in range(2))
      if kind == "bf16":
        kp, vp, ks, vs = jnp.asarray(k32, jnp.bfloat16), jnp.asarray(v32, jnp.bfloat16), None, None
      else:
        ks = vs = jnp.full((kh,), 8.0 / 448.0, jnp.float32)
        kp, vp = (
          jnp.asarray(np.clip(a / (8.0 / 448.0), -448, 448), jnp.float8_e4m3fn) for a in (k32, v32)
        )
      cache = PagedKV(kp, vp, jnp.asarray(table), jnp.asarray(lengths), ks, vs)
      kern = jax.jit(lambda q, c: paged_attention(q, c, pos, impl=impl, interpret=interpret))
      ref = jax.jit(lambda q, c: paged_attention(q, c, pos, impl="reference"))
      return _compare(kern, ref, [(q, cache) for q in qs], reps)

    _show(run.case(f"paged_attention_{kind}", one, **shape))


def moe_cases(run: Run, impl: str, m: int, k: int, n: int, experts, reps: int, interpret: bool):
  """The experts' grouped matmul through `impl` vs ragged_dot, bf16, uneven group sizes."""
  rng = np.random.default_rng(2)
  copies = 2 if interpret else COPIES
  lhss = [jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16) for _ in range(copies)]
  for e in experts:

    def one(e=e):
      share = rng.dirichlet(np.full(e, 0.5))  # skewed, some groups near empty
      sizes = np.floor(share * m).astype(np.int32)
      sizes[-1] += m - sizes.sum()
      rhs = jnp.asarray(rng.normal(size=(e, k, n)) / np.sqrt(k), jnp.bfloat16)
      kern = jax.jit(lambda a, b, g: grouped_matmul(a, b, g, impl=impl, interpret=interpret))
      ref = jax.jit(lambda a, b, g: grouped_matmul(a, b, g, impl="reference"))
      gs = jnp.asarray(sizes)
      return _compare(kern, ref, [(lhs, rhs, gs) for lhs in lhss], reps)

    _show(run.case(f"grouped_matmul_e{e}", one, m=m, k=k, n=n))


def bandwidth_case(run: Run, mib: int, reps: int) -> float | None:
  """Copy bandwidth, bytes read + written per second, the best of: a bf16 and a float32 array of
  `mib` MiB scaled (x * 2), and a float32 x + y (two reads, one write)."""

  def one():
    out = {}
    for name, dtype, fn, reads in (
      ("bf16_scale", jnp.bfloat16, lambda a, b: a * 2, 1),
      ("f32_scale", jnp.float32, lambda a, b: a * 2, 1),
      ("f32_add", jnp.float32, lambda a, b: a + b, 2),
    ):
      x = jnp.ones((mib * 2**20 // jnp.dtype(dtype).itemsize,), dtype)
      t = _time(jax.jit(fn), x, x + 1, reps=reps)
      out[name] = (reads + 1) * x.nbytes / t
    return {"variants_bytes_per_s": out, "bytes_per_s": max(out.values())}

  row = run.case("copy_bandwidth", one, mib=mib)
  if "error" in row:
    return None
  print(f"{'copy_bandwidth':26s} {row['variants_bytes_per_s']}", flush=True)
  return row["bytes_per_s"]


def decode_cases(
  run: Run, cfg, b: int, p: int, ns, bandwidth, kernels, interpret: bool, reps, quant=(), skip=()
):
  """Whole-model decode, greedy, random weights: the v0 sampler's seconds per decode step (the
  difference of two generation lengths, so prefill cancels) against the bytes a step reads, and
  the same with the projections quantized (`quant`: (quantize_params mode, matmul_kernel)
  pairs), and the engine (all rows to the longer length) with each attention kernel in
  `kernels`."""
  from jaxrl.models.transformer import make_model
  from jaxrl.rollout.driver import Driver, Request
  from jaxrl.rollout.engine import Engine
  from jaxrl.rollout.reference import make_sampler, row_keys
  from jaxrl.rollout.sampling import SamplingParams

  greedy = SamplingParams(temperature=0.0)
  graphdef, params = make_model(cfg, seed=0)
  weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
  prompts = np.random.default_rng(3).integers(3, cfg.vocab_size, (b, p), dtype=np.int32)
  shape = {
    "b": b,
    "prompt": p,
    "layers": cfg.num_layers,
    "d": cfg.embed_dim,
    "weight_bytes": weight_bytes,
  }

  def sampler(params=params, cfg=cfg):
    times = {}
    for n in ns:
      sample = make_sampler(
        graphdef, cfg, prompt_len=p, max_new_tokens=n, eos_id=-1, pad_id=0, sampling=greedy
      )
      args = (
        jnp.asarray(prompts),
        jnp.ones((b, p), bool),
        row_keys(jax.random.key(0), np.arange(b)),
      )
      times[n] = _time(lambda *a, s=sample: s(params, *a).tokens, *args, reps=reps)
    lo, hi = min(ns), max(ns)
    step = (times[hi] - times[lo]) / (hi - lo)
    # The v0 cache holds p + hi positions for every row; a step reads all of them (upper bound).
    kv = 2 * b * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (p + hi) * 2
    wb = sum(int(x.nbytes) for x in jax.tree.leaves(params))
    row = {"seconds": times, "s_per_step": step, "tokens_per_s": b / step, "kv_bytes": kv}
    row["step_weight_bytes"] = wb
    if bandwidth:
      row["roofline_s_per_step"] = (wb + kv) / bandwidth
      row["fraction_of_roofline"] = row["roofline_s_per_step"] / step
    return row

  base = None
  for mode, kernel in [(None, "reference"), *quant]:
    name = "sampler_decode" + ("" if mode is None else f"_{mode}_{kernel}")

    def one(mode=mode, kernel=kernel):
      if mode is None:
        return sampler()
      qparams = jax.block_until_ready(jax.jit(lambda t: quantize_params(t, mode))(params))
      kcfg = cfg.replace(matmul_kernel=kernel, kernel_interpret=interpret and kernel != "reference")
      return sampler(qparams, kcfg)

    row = run.case(name, one, **shape)
    if "error" in row:
      continue
    if mode is None:
      base = row["s_per_step"]
    elif base:
      row["bf16_step_over_this"] = base / row["s_per_step"]
      run.save()
    frac = row.get("fraction_of_roofline")
    print(
      f"{name:26s} {row['s_per_step'] * 1e3:.3f} ms/step  "
      f"{row['tokens_per_s']:.0f} tok/s  roofline fraction {frac}",
      flush=True,
    )
  if "engine" in skip:
    return
  n = max(ns)
  tokens = {}
  for kernel in kernels:

    def engine(kernel=kernel):
      kcfg = cfg.replace(
        attention_kernel=kernel, kernel_interpret=interpret and kernel != "reference"
      )
      pages = -(-(p + n) // 16)
      eng = Engine(kcfg, graphdef, max_concurrent_decodes=b, num_pages=b * pages,
                   max_prefill_length=p, max_target_length=p + n)  # fmt: skip
      driver = Driver(eng, steps_per_call=8, eos_id=None)
      reqs = [Request(prompt=r.tolist(), request_id=i, sampling=greedy, max_new_tokens=n)
              for i, r in enumerate(prompts)]  # fmt: skip
      driver.run(params, reqs, seed=0)  # compile + warm-up
      t0 = time.perf_counter()
      out = driver.run(params, reqs, seed=0)
      sec = time.perf_counter() - t0
      toks = np.stack([c.tokens for c in sorted(out.finished, key=lambda c: c.request_id)])
      tokens[kernel] = toks
      row = {"seconds": sec, "tokens_per_s": b * n / sec}
      if kernel != "reference" and "reference" in tokens:  # greedy; bf16 rounding may fork rows
        row["token_agreement_vs_reference"] = float((toks == tokens["reference"]).mean())
      return row

    row = run.case(f"engine_decode_{kernel}", engine, new_tokens=n, **shape)
    if "error" not in row:
      print(
        f"{row['case']:26s} {row['seconds']:.3f} s  {row['tokens_per_s']:.0f} tok/s", flush=True
      )


def main(argv=None) -> int:
  global COPIES
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="bench/results/device_kernels.json")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", default="4096", help="quant_matmul N values, comma-separated")
  ap.add_argument(
    "--block",
    default="128,128,128",
    help="quant_matmul configs, ';'-separated: bm,bn,bk[,num_warps,num_stages][@split_k] "
    "(Triton launch; K split, none: auto_split_k)",
  )
  ap.add_argument("--cases", default=",".join(CASES), help=f"quant_matmul formats of {list(CASES)}")
  ap.add_argument(
    "--skip",
    default="",
    help="comma list of sections: odd,matmul,paged,moe,bandwidth,decode,engine",
  )
  ap.add_argument("--ms", default="64,4096", help="quant_matmul M (rows) values")
  ap.add_argument(
    "--matmul-impl",
    default="",
    help="the quantized matmul's kernels for the odd and matmul sections, a comma list run in "
    "turn (default: the backend's, as `auto` picks it; pallas_mgpu: the Hopper-native Mosaic "
    "GPU kernel, W8A8 only, K-major weights; a --block launch gives it its stages)",
  )
  ap.add_argument(
    "--decode-quant",
    default="int8:reference,fp8:reference,fp8:pallas_gpu",
    help="quantized decode rows, mode:matmul_kernel (a jaxrl.quant mode; reference|pallas_gpu)",
  )
  ap.add_argument("--copies", type=int, default=COPIES, help="operand sets per timing (even)")
  ap.add_argument("--smoke", action="store_true", help="CPU check of the script (see above)")
  args = ap.parse_args(argv)
  if args.copies < 2 or args.copies % 2:
    ap.error(f"--copies must be an even number >= 2, got {args.copies}")
  COPIES = args.copies
  skip = set(filter(None, args.skip.split(",")))
  backend = jax.default_backend()
  impl = resolve_impl("auto")
  if impl == "reference" and not args.smoke:
    print(f"no kernel backend here ({backend}): run this on a GPU or TPU machine (or --smoke)")
    return 2
  if args.smoke:
    impl, interpret, reps, out = "pallas_gpu", True, 1, None
  else:
    interpret, reps, out = False, args.reps, Path(args.out)
  configs = []
  for spec in args.block.split(";"):
    shape, _, split = spec.partition("@")
    nums = tuple(int(v) for v in shape.split(","))
    if len(nums) not in (3, 5) or (split and not split.isdigit()):
      ap.error(f"--block entry {spec!r}: bm,bn,bk[,num_warps,num_stages][@split_k]")
    configs.append((nums[:3], nums[3:] or None, int(split) if split else None))
  cases = [c for c in args.cases.split(",") if c]
  if not cases or set(cases) - set(CASES):
    ap.error(f"--cases {args.cases!r}: a comma list of {list(CASES)}")
  run = Run(out, {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "device": str(jax.devices()[0].device_kind),
    "backend": backend,
    "jax": jax.__version__,
    "impl": impl,
    "configs": configs,
  })  # fmt: skip
  mm_impls = [v for v in (args.matmul_impl or impl).split(",") if v]
  if not mm_impls or set(mm_impls) - {"pallas_tpu", "pallas_gpu", "pallas_mgpu"}:
    ap.error(
      f"--matmul-impl {args.matmul_impl!r}: a comma list of pallas_tpu, pallas_gpu, pallas_mgpu"
    )
  run.meta["matmul_impls"] = mm_impls
  print(
    f"{run.meta['device']} ({backend}), jax {jax.__version__}, kernels {impl}, quantized "
    f"matmul {', '.join(mm_impls)}",
    flush=True,
  )
  smoke = args.smoke
  if "odd" not in skip:
    for mm_impl in mm_impls:
      odd_shape_cases(run, mm_impl, interpret, ((5, 48, 40),) if smoke else ODD_SHAPES)
  if "matmul" not in skip:
    k, ns = (48, (40,)) if smoke else (args.k, tuple(int(v) for v in args.n.split(",")))
    ms = (5,) if smoke else tuple(int(v) for v in args.ms.split(","))
    for mm_impl in mm_impls:
      more = []
      if smoke:  # a split, through the interpreter (the Mosaic GPU kernel's blocks are >= 64)
        more = [((64,) * 3 if mm_impl == "pallas_mgpu" else (16,) * 3, None, 2)]
      for n in ns:  # one process, so the kernels' ratios to the bf16 dot compare
        matmul_cases(run, mm_impl, k, n, ms, [*configs, *more], reps, interpret, cases)
  if "paged" not in skip:
    shape = (
      dict(b=2, n=4, kh=2, h=16, ps=4, m=4)
      if smoke
      else dict(b=64, n=32, kh=8, h=128, ps=16, m=128)
    )
    paged_cases(run, impl, shape, reps, interpret)
  if "moe" not in skip:
    m, k, n, ex = (40, 32, 24, (3,)) if smoke else (8192, 2048, 1408, (8, 64))
    moe_cases(run, impl, m, k, n, ex, reps, interpret)
  bw = None if "bandwidth" in skip else bandwidth_case(run, 1 if smoke else 4096, reps)
  if "decode" not in skip:
    if smoke:
      cfg, b, p, ns = ModelConfig.arith_small(32).replace(max_seq_len=64), 2, 8, (2, 4)
    else:
      cfg, b, p, ns = ModelConfig.llama3p2_1b().replace(max_seq_len=1024), 64, 128, (32, 160)
    quant = [tuple(q.split(":")) for q in args.decode_quant.split(",") if q]
    if smoke:
      quant = [("int8", "reference"), ("fp8", impl)]
    kernels = ("reference", impl)
    decode_cases(run, cfg, b, p, ns, bw, kernels, interpret, max(1, reps // 5), quant, skip)
  bad = run.bad()
  if bad:
    print(f"FAILED or MISMATCH against the reference: {[(r['case'], r.get('m')) for r in bad]}")
    return 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
