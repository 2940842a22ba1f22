"""Continuous vs static batching in one jaxrl engine, on a long-tailed completion-length workload.

Requests draw target lengths from a log-normal (seeded), clipped to [1, --max-new-tokens]; each
stops exactly there (per-request max_new_tokens, no EOS), so both modes do identical useful work.
Continuous: the Driver refills a slot as soon as its sequence finishes. Static: the same Driver
with `batching="static"` admits a batch of `--slots` requests only once the previous batch has
wholly finished. Reported: useful tokens/s, slot utilisation, and continuous / static ratios.

  .venv/bin/python bench/continuous_batching.py            # full run: 128 requests, 3 reps
  .venv/bin/python bench/continuous_batching.py --quick    # sanity run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

from _common import MODELS, machine, versions  # noqa: E402

from jaxrl.models.transformer import make_model  # noqa: E402
from jaxrl.rollout.driver import BATCHING_MODES, Driver, Request  # noqa: E402
from jaxrl.rollout.engine import Engine  # noqa: E402
from jaxrl.rollout.kv_cache import pages_for  # noqa: E402
from jaxrl.rollout.sampling import SamplingParams  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "continuous_batching.json"
SEED = 0
PAGE_SIZE = 16


def draw_lengths(n: int, median: float, sigma: float, max_new: int, seed: int) -> np.ndarray:
  """[n] int completion lengths: log-normal(log median, sigma), rounded, clipped to [1, max_new]."""
  rng = np.random.default_rng(seed)
  raw = np.exp(rng.normal(np.log(median), sigma, n))
  return np.clip(np.rint(raw), 1, max_new).astype(np.int64)


def make_requests(lengths: np.ndarray, prompt_len: int, vocab: int, seed: int) -> list[Request]:
  rng = np.random.default_rng(seed + 1)
  # Byte tokens (ids 3..vocab-1), so no prompt holds pad / bos / eos.
  prompts = rng.integers(3, vocab, (len(lengths), prompt_len))
  sampling = SamplingParams(temperature=1.0)
  return [
    Request(prompt=p.tolist(), request_id=i, sampling=sampling, max_new_tokens=int(n))
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
  ]


def run_mode(engine, params, requests, mode: str, args) -> dict:
  """`--warmup` untimed then `--reps` timed `Driver.run`s; returns timings, stats and outputs."""
  # No eos_id and no tokenizer: each request stops at its own max_new_tokens.
  driver = Driver(engine, steps_per_call=args.steps_per_call, eos_id=None, batching=mode)
  times, stats, out = [], None, None
  for i in range(args.warmup + args.reps):
    t0 = time.perf_counter()
    res = driver.run(params, requests, seed=SEED)  # returns host numpy: all work is done
    dt = time.perf_counter() - t0
    if res.partial or res.unstarted or len(res.finished) != len(requests):
      raise RuntimeError(f"{mode}: {len(res.finished)}/{len(requests)} requests finished")
    stats, out = res.stats, {c.request_id: c for c in res.finished}
    if i >= args.warmup:
      times.append(dt)
      print(f"  {mode}: rep {i - args.warmup + 1}/{args.reps} {dt:.3f} s", flush=True)
  return {"times_s": times, "stats": stats, "completions": out}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small", help=f"from {', '.join(MODELS)}")
  ap.add_argument("--requests", type=int, default=128)
  ap.add_argument("--slots", type=int, default=16, help="engine max_concurrent_decodes")
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--max-new-tokens", type=int, default=256, help="length clip (and page budget)")
  ap.add_argument("--median-len", type=float, default=32.0, help="log-normal median length")
  ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (tail weight)")
  ap.add_argument("--steps-per-call", type=int, default=8, help="decode steps per device call")
  ap.add_argument("--reps", type=int, default=3, help="timed runs per mode (median reported)")
  ap.add_argument("--warmup", type=int, default=1, help="untimed runs per mode (compilation)")
  ap.add_argument("--quick", action="store_true", help="sanity run: 32 requests, 64 tokens max")
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = ap.parse_args(argv)
  if args.model not in MODELS:
    raise SystemExit(f"--model={args.model!r}: unknown; allowed: {', '.join(MODELS)}")
  if args.quick:
    args.requests, args.max_new_tokens = min(args.requests, 32), min(args.max_new_tokens, 64)
    args.median_len, args.reps = min(args.median_len, 12.0), min(args.reps, 1)
  for name in ("requests", "slots", "prompt_len", "max_new_tokens", "steps_per_call", "reps"):
    if getattr(args, name) <= 0:
      raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.median_len <= 0 or args.sigma < 0:
    raise SystemExit(
      f"--median-len must be > 0 and --sigma >= 0, got {args.median_len}, {args.sigma}"
    )
  if args.warmup < 0:
    raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
  cfg = MODELS[args.model]()
  if args.prompt_len + args.max_new_tokens > cfg.max_seq_len:
    raise SystemExit(f"--prompt-len + --max-new-tokens must be <= {cfg.max_seq_len}")

  lengths = draw_lengths(args.requests, args.median_len, args.sigma, args.max_new_tokens, SEED)
  useful = int(lengths.sum())
  print(
    f"{args.requests} requests, lengths: min {lengths.min()} median {int(np.median(lengths))} "
    f"mean {lengths.mean():.1f} p90 {int(np.percentile(lengths, 90))} max {lengths.max()}; "
    f"{useful} useful tokens",
    flush=True,
  )
  graphdef, params = make_model(cfg, seed=SEED)
  requests = make_requests(lengths, args.prompt_len, cfg.vocab_size, SEED)
  # Pages for every slot's longest possible sequence: only the slot count limits admission.
  engine = Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=args.slots,
    num_pages=args.slots * pages_for(args.prompt_len + args.max_new_tokens, PAGE_SIZE),
    page_size=PAGE_SIZE,
    max_prefill_length=args.prompt_len,
    max_target_length=args.prompt_len + args.max_new_tokens,
  )

  runs, results = {}, []
  for mode in BATCHING_MODES:
    print(f"[{args.model}] {mode}: running ...", flush=True)
    runs[mode] = r = run_mode(engine, params, requests, mode, args)
    med = statistics.median(r["times_s"])
    steps = r["stats"]["decode_steps"]
    results.append(
      {
        "mode": mode,
        "median_s": med,
        "useful_tokens_per_s": useful / med,
        "decode_steps": steps,
        "slot_utilisation": useful / (steps * args.slots),
        "times_s": r["times_s"],
        "stats": r["stats"],
      }
    )
    print(f"[{args.model}] {mode}: {useful / med:9.1f} useful tok/s (median {med:.3f} s)")
  cont, stat = results
  ratios = {
    "tokens_per_s_continuous_over_static": cont["useful_tokens_per_s"]
    / stat["useful_tokens_per_s"],
    "utilisation_continuous_over_static": cont["slot_utilisation"] / stat["slot_utilisation"],
  }
  # Same seed, same request ids: the two modes must sample the very same tokens.
  a, b = (runs[m]["completions"] for m in BATCHING_MODES)
  identical = all(
    np.array_equal(a[i].tokens, b[i].tokens) and len(a[i].tokens) == lengths[i] for i in a
  )
  if not identical:
    raise RuntimeError("continuous and static batching produced different tokens")

  print(
    f"\n{'mode':11} {'useful tok/s':>13} {'median s':>9} {'decode steps':>13} {'slot util':>10}"
  )
  for r in results:
    print(
      f"{r['mode']:11} {r['useful_tokens_per_s']:13.1f} {r['median_s']:9.3f} "
      f"{r['decode_steps']:13d} {r['slot_utilisation']:10.3f}"
    )
  print(
    f"continuous / static: {ratios['tokens_per_s_continuous_over_static']:.2f}x tokens/s, "
    f"{ratios['utilisation_continuous_over_static']:.2f}x slot utilisation; "
    "outputs identical in both modes"
  )

  report = {
    "benchmark": "continuous_batching",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions(),
    "settings": {
      "model": args.model,
      "requests": args.requests,
      "slots": args.slots,
      "prompt_len": args.prompt_len,
      "max_new_tokens": args.max_new_tokens,
      "length_distribution": f"lognormal(median={args.median_len}, sigma={args.sigma}), clipped",
      "steps_per_call": args.steps_per_call,
      "page_size": PAGE_SIZE,
      "reps": args.reps,
      "warmup": args.warmup,
      "quick": args.quick,
      "sampling": "temperature 1.0, EOS stopping off, per-request max_new_tokens",
      "dtype": "float32",
      "model_config": dataclasses.asdict(cfg),
    },
    "workload": {
      "useful_tokens": useful,
      "lengths": lengths.tolist(),
    },
    "results": results,
    "ratios": ratios,
    "outputs_identical": identical,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
