"""Prefill cost of one GRPO group of G samples: one shared prefill vs G separate ones, vs G.

Group (what the Driver does): `prefill_multisampling(num_samples=G)` + `bulk_insert` into G slots
(the prompt's full KV pages are shared). Naive: G x (`prefill` + `insert`), each sample its own
prompt forward and pages. Every timed call starts from a fresh decode state (outside the timing),
blocks on the new decode state and first tokens, and excludes compilation (`--warmup` calls per G).
Reported: median seconds per group, time(G) / time(1) for both paths, and naive / group.

  .venv/bin/python bench/group_prefill.py            # G in 1,2,4,8,16, 128-token prompt
  .venv/bin/python bench/group_prefill.py --quick    # sanity run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

from _common import MODELS, machine, versions  # noqa: E402

from jaxrl.models.transformer import make_model  # noqa: E402
from jaxrl.rollout.engine import Engine, request_key  # noqa: E402
from jaxrl.rollout.sampling import SamplingParams  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "group_prefill.json"
SEED = 0
PAGE_SIZE = 16
SAMPLING = SamplingParams(temperature=1.0)


def group_path(engine: Engine, params, prompt: np.ndarray, g: int, max_new: int):
  """One prefill drawing G first tokens, one bulk_insert into slots 0..G-1."""
  keys = np.stack([request_key(SEED, j) for j in range(g)])

  def call(state):
    prefix, first = engine.prefill_multisampling(
      params=params,
      padded_tokens=prompt,
      true_length=len(prompt),
      sampler=SAMPLING,
      rng=keys,
      num_samples=g,
      max_new_tokens=max_new,
    )
    state = engine.bulk_insert(prefix, state, list(range(g)))
    return state, first.data

  return call


def naive_path(engine: Engine, params, prompt: np.ndarray, g: int, max_new: int):
  """G independent prefills (one sample each), each inserted into its own slot."""
  keys = [request_key(SEED, j)[None] for j in range(g)]

  def call(state):
    firsts = []
    for j in range(g):
      prefix, first = engine.prefill(
        params=params,
        padded_tokens=prompt,
        true_length=len(prompt),
        sampler=SAMPLING,
        rng=keys[j],
        max_new_tokens=max_new,
      )
      state = engine.insert(prefix, state, j)
      firsts.append(first.data)
    return state, firsts

  return call


PATHS: dict[str, Callable] = {"group": group_path, "naive": naive_path}


def time_path(engine: Engine, call, warmup: int, reps: int) -> tuple[list[float], np.ndarray]:
  """Timed calls of `call(fresh decode state)`, blocked on every output; returns the first tokens
  of the last call ([G])."""
  times = []
  for i in range(warmup + reps):
    state = jax.block_until_ready(engine.init_decode_state())  # resets the page allocator too
    t0 = time.perf_counter()
    state, firsts = jax.block_until_ready(call(state))
    dt = time.perf_counter() - t0
    if i >= warmup:
      times.append(dt)
  first = np.concatenate([np.asarray(f).reshape(-1, 5)[:, 0] for f in jax.tree.leaves(firsts)])
  return times, first


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small", help=f"from {', '.join(MODELS)}")
  ap.add_argument("--groups", default="1,2,4,8,16", help="group sizes G (comma-separated)")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument(
    "--max-new-tokens", type=int, default=64, help="completion budget (pages reserved per sample)"
  )
  ap.add_argument("--reps", type=int, default=10, help="timed calls per (path, G); median reported")
  ap.add_argument("--warmup", type=int, default=2, help="untimed calls per (path, G) (compilation)")
  ap.add_argument("--quick", action="store_true", help="sanity run: G in 1,4,16, 3 reps")
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = ap.parse_args(argv)
  if args.model not in MODELS:
    raise SystemExit(f"--model={args.model!r}: unknown; allowed: {', '.join(MODELS)}")
  try:
    groups = sorted({int(g) for g in args.groups.split(",") if g.strip()})
  except ValueError:
    raise SystemExit(f"--groups={args.groups!r}: expected comma-separated ints") from None
  if args.quick:
    groups, args.reps, args.warmup = [g for g in groups if g in (1, 4, 16)], min(args.reps, 3), 1
  if not groups or groups[0] <= 0:
    raise SystemExit(f"--groups={args.groups!r}: need at least one positive group size")
  if 1 not in groups:
    groups = [1, *groups]  # the baseline of time(G) / time(1)
  for name in ("prompt_len", "max_new_tokens", "reps"):
    if getattr(args, name) <= 0:
      raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.warmup < 1:
    raise SystemExit(f"--warmup must be >= 1 (the first call compiles), got {args.warmup}")
  cfg = MODELS[args.model]()
  if args.prompt_len + args.max_new_tokens > cfg.max_seq_len:
    raise SystemExit(f"--prompt-len + --max-new-tokens must be <= {cfg.max_seq_len}")

  graphdef, params = make_model(cfg, seed=SEED)
  rng = np.random.default_rng(SEED)
  prompt = rng.integers(3, cfg.vocab_size, args.prompt_len).astype(np.int32)
  g_max = max(groups)
  total = args.prompt_len + args.max_new_tokens
  # Naive takes the most pages: G unshared copies of the prompt and completion.
  engine = Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=g_max,
    num_pages=g_max * -(-total // PAGE_SIZE),
    page_size=PAGE_SIZE,
    max_prefill_length=args.prompt_len,
    # One prefill bucket: the whole (power-of-two-padded) prompt in one chunk.
    prefill_chunk_size=max(8, 1 << (args.prompt_len - 1).bit_length()),
    max_target_length=total,
  )

  results, first_tokens = [], {}
  for g in groups:
    for path, make in PATHS.items():
      print(f"[{args.model}] G={g:<3} {path}: running ...", flush=True)
      times, first = time_path(
        engine, make(engine, params, prompt, g, args.max_new_tokens), args.warmup, args.reps
      )
      first_tokens[(path, g)] = first
      med = statistics.median(times)
      results.append({"G": g, "path": path, "median_s": med, "times_s": times})
      print(f"[{args.model}] G={g:<3} {path}: {1e3 * med:8.2f} ms (median of {args.reps})")
    # Same keys, same prompt: both paths must draw the same G first tokens.
    if not np.array_equal(first_tokens[("group", g)], first_tokens[("naive", g)]):
      raise RuntimeError(f"G={g}: group and naive prefill drew different first tokens")

  base = {r["path"]: r["median_s"] for r in results if r["G"] == 1}
  for r in results:
    r["over_G1"] = r["median_s"] / base[r["path"]]
    other = next(x for x in results if x["G"] == r["G"] and x["path"] != r["path"])
    if r["path"] == "group":
      r["naive_over_group"] = other["median_s"] / r["median_s"]

  head = f"{'group ms':>10} {'group/G1':>9} {'naive ms':>10} {'naive/G1':>9} {'naive/group':>12}"
  print(f"\n{'G':>3} {head}")
  for g in groups:
    gr = next(r for r in results if r["G"] == g and r["path"] == "group")
    nv = next(r for r in results if r["G"] == g and r["path"] == "naive")
    print(
      f"{g:3d} {1e3 * gr['median_s']:10.2f} {gr['over_G1']:9.2f} {1e3 * nv['median_s']:10.2f} "
      f"{nv['over_G1']:9.2f} {gr['naive_over_group']:12.2f}"
    )
  print("first tokens identical in both paths for every G")

  report = {
    "benchmark": "group_prefill",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions(),
    "settings": {
      "model": args.model,
      "groups": groups,
      "prompt_len": args.prompt_len,
      "max_new_tokens": args.max_new_tokens,
      "page_size": PAGE_SIZE,
      "reps": args.reps,
      "warmup": args.warmup,
      "quick": args.quick,
      "sampling": "temperature 1.0",
      "dtype": "float32",
      "model_config": dataclasses.asdict(cfg),
    },
    "results": results,
    "first_tokens_identical": True,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
