"""Partial vs synchronous rollouts on the long-tailed chain task (configs/grpo_chain.py):
completed groups per second of the RL rollout phase, over seeds, in one process.

Each mode runs `--steps` rollout phases of 64 groups x 8 samples after `--warmup` phases
(compiles excluded) with the same warm-started params (an SFT checkpoint of grpo_chain), the
same data stream and the same sampling seeds per seed:
  sync            every group started in a step finishes in it (the engine holds all 512)
  partial         the config's :partial (rl.partial): 1.5x the groups in flight, the phase ends
                  once 64 are complete, the rest carried (max_age 2); the slots held at
                  sync's 512, the 96 groups queue for them (CoPRIS's fixed concurrency)
  partial_all_slots  the same with a slot for every sample in flight (768)
  sync_pow2, partial_pow2  sync / partial with rl.rollout.prefill_batch_prompts=0: each
                  batched prefill padded to the power of two above its prompt count (a
                  program per count) instead of the config's calls of exactly 16 prompts
A phase's time is wall seconds of sampling and scoring (what the RL loop waits for). The params
stay fixed, so this measures the rollout mechanism alone; the versions still advance per step,
so carried sequences age and max_age restarts happen as in training. Reported per mode: groups
per second, decode steps and generated tokens per phase, and the mean completion length and
reward of the groups a phase returns (partial rollouts favour short completions within a step:
the bias is part of the result). Ratios against sync are paired by seed.

  .venv/bin/python bench/partial_rollouts.py --sft-workdir=runs/grpo_chain_sync --seeds=0-4
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
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

import numpy as np  # noqa: E402
from _common import machine, versions  # noqa: E402
from _compile_log import CompileLog  # noqa: E402

from jaxrl.config import config_module, validate  # noqa: E402
from jaxrl.rl.experience import Experience, build_sampler  # noqa: E402
from jaxrl.rl.partial import PartialRollouts  # noqa: E402
from jaxrl.rl.run import Run, restore_params  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "partial_rollouts.json"
MODES = ("sync", "partial", "partial_all_slots", "sync_pow2", "partial_pow2")


def _seeds(text: str) -> list[int]:
  if "-" in text:
    lo, hi = text.split("-")
    return list(range(int(lo), int(hi) + 1))
  return [int(s) for s in text.split(",")]


def _config(mode: str, workdir: str):
  c = config_module(REPO / "configs" / "grpo_chain.py").get_config(
    "partial" if mode.startswith("partial") else ""
  )
  c.workdir = workdir
  c.log.progress = False
  if mode == "partial_all_slots":
    c.rl.rollout.slots = 0  # every in-flight sample
  if mode.endswith("_pow2"):
    c.rl.rollout.prefill_batch_prompts = 0
  return validate(c)


def _phases(exp: Experience, run: Run, params, mode: str, seed: int, n: int, offset: int):
  """n rollout phases of one mode on seed's data stream: one dict per phase."""
  it = iter(run.task.train_dataset(seed=seed, batch_size=run.cfg.rl.prompts_per_step))
  if exp.partial is not None:
    exp.partial = PartialRollouts(exp.sampler, run.encode, rl=run.cfg.rl)  # empty per seed
  g = run.cfg.rl.group_size
  out = []
  for i in range(n):
    step = offset + i
    with CompileLog() as log:
      t0 = time.perf_counter()
      if exp.partial is None:
        rollout, r, _, engine = exp.sample(step, 0, params, next(it))
        stats = {}
      else:
        rollout, r, _, engine, stats = exp.sample_partial(
          step, params, next(it), lambda: next(it), version=step
        )
      wall = time.perf_counter() - t0
    compile_s = sum(log.totals.values())
    out.append(
      {
        "wall_s": wall,
        # A prefill or insert of a new (prompts, samples, length) bucket compiles mid-run.
        "compiles": sum(log.counts.values()),
        "compile_s": compile_s,
        "groups": rollout.tokens.shape[0] // g,
        "decode_steps": engine["decode_steps"],
        "prefill_calls": engine["prefill_calls"],
        "batch_tokens": int(rollout.lengths.sum()),
        "response_length": float(rollout.lengths.mean()),
        "reward": float(np.mean(r)),
        **{k.split("/")[1]: v for k, v in stats.items()},
      }
    )
  return out


def _summary(values: list[float]) -> dict:
  return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--sft-workdir", required=True, help="a grpo_chain run with an SFT checkpoint")
  ap.add_argument("--seeds", default="0-4")
  ap.add_argument("--steps", type=int, default=10, help="measured phases per seed and mode")
  ap.add_argument("--warmup", type=int, default=3, help="phases before measuring (compiles)")
  ap.add_argument("--out", default=str(DEFAULT_OUT))
  args = ap.parse_args(argv)
  seeds = _seeds(args.seeds)

  built = {}
  for mode in MODES:
    run = Run.build(_config(mode, args.sft_workdir))
    _, sft_step, params = restore_params(run, "sft")
    exp = Experience(run, build_sampler(run))
    _phases(exp, run, params, mode, 10_000, args.warmup, 10_000)  # compiles, not measured
    built[mode] = (exp, run, params)
    print(f"[bench] {mode}: warmed up ({args.warmup} phases)", flush=True)

  per_seed = {mode: {} for mode in MODES}
  for seed in seeds:
    for mode in MODES:  # interleaved by seed: a drift in machine speed hits every mode alike
      exp, run, params = built[mode]
      phases = _phases(exp, run, params, mode, seed, args.steps, 1000 * seed)
      per_seed[mode][seed] = phases
      gps = sum(p["groups"] for p in phases) / sum(p["wall_s"] for p in phases)
      print(f"[bench] seed {seed} {mode}: {gps:.2f} groups/s", flush=True)
    print(f"[bench] seed {seed} done ({seeds.index(seed) + 1}/{len(seeds)})", flush=True)

  def agg(mode, key, fn):
    return [fn(per_seed[mode][s], key) for s in seeds]

  def rate(ph, _):
    return sum(p["groups"] for p in ph) / sum(p["wall_s"] for p in ph)

  def rate_warm(ph, _):  # compile time taken out: the steady state once every bucket compiled
    return sum(p["groups"] for p in ph) / sum(p["wall_s"] - p["compile_s"] for p in ph)

  def mean_of(ph, key):
    return statistics.fmean(p[key] for p in ph)

  result = {
    "benchmark": "partial_rollouts",
    "date": datetime.date.today().isoformat(),
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax")),
    "config": "configs/grpo_chain.py (sync) / :partial",
    "sft_step": sft_step,
    "seeds": seeds,
    "steps": args.steps,
    "warmup": args.warmup,
    "modes": {},
  }
  sync_rate, sync_warm = agg("sync", None, rate), agg("sync", None, rate_warm)
  for mode in MODES:
    r, w = agg(mode, None, rate), agg(mode, None, rate_warm)
    result["modes"][mode] = {
      "groups_per_s": _summary(r),
      "ratio_vs_sync": _summary([a / b for a, b in zip(r, sync_rate, strict=True)]),
      "groups_per_s_without_compiles": _summary(w),
      "ratio_vs_sync_without_compiles": _summary(
        [a / b for a, b in zip(w, sync_warm, strict=True)]
      ),
      "compiles_per_phase": _summary(agg(mode, "compiles", mean_of)),
      "compile_s_per_phase": _summary(agg(mode, "compile_s", mean_of)),
      "decode_steps_per_phase": _summary(agg(mode, "decode_steps", mean_of)),
      "batch_tokens_per_phase": _summary(agg(mode, "batch_tokens", mean_of)),
      "response_length": _summary(agg(mode, "response_length", mean_of)),
      "reward": _summary(agg(mode, "reward", mean_of)),
      "wall_s_per_phase": _summary(agg(mode, "wall_s", mean_of)),
    }
    if mode.startswith("partial"):
      for key in ("carried_sequences", "restarted_groups", "staleness_mean", "stale_token_frac"):
        result["modes"][mode][key] = _summary(agg(mode, key, mean_of))
  result["per_seed"] = per_seed
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
  for mode, m in result["modes"].items():
    x, y = m["ratio_vs_sync"], m["ratio_vs_sync_without_compiles"]
    print(
      f"{mode:14s} groups/s {m['groups_per_s']['mean']:.2f}  x sync {x['mean']:.3f} "
      f"({x['min']:.3f}-{x['max']:.3f}); without compiles x {y['mean']:.3f} "
      f"({y['min']:.3f}-{y['max']:.3f})  compiles/phase {m['compiles_per_phase']['mean']:.1f}  "
      f"decode steps {m['decode_steps_per_phase']['mean']:.1f}  "
      f"length {m['response_length']['mean']:.2f}  reward {m['reward']['mean']:.3f}"
    )
  return result


if __name__ == "__main__":
  main()
