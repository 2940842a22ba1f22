"""Rollout seconds per RL step of the default job (configs/grpo_arith.py): the engine the job
runs vs the v0 static sampler it ran before, in one process, on the same params and prompts.

Both samplers take one step's 64 prompts x 8 samples at temperature 1 (the RL round) and the
512 held-out prompts greedily (the evaluation; v0 in batches of 256, as the loop ran it). Times
are wall seconds per call, blocking on the sampled arrays reaching the host (what the loop waits
for), median of `--reps` calls after `--warmup` calls (compilation excluded), the peers' calls
interleaved. The engine's
figure includes its host bookkeeping (admission, page tables, packing the Rollout); v0's does
not need any.

Params: a fresh init (the model rarely stops early, so every row runs to max_new_tokens), or
`--sft-workdir=W`, the final SFT checkpoint of a run of this config (W/checkpoints/sft/<step>),
whose completions stop at EOS as the job's do.

  .venv/bin/python bench/rollout_step.py --sft-workdir=runs/grpo_arith
  .venv/bin/python bench/rollout_step.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine, versions  # noqa: E402

from jaxrl.config import validate  # noqa: E402
from jaxrl.rl.evaluation import GREEDY  # noqa: E402
from jaxrl.rl.experience import build_sampler  # noqa: E402
from jaxrl.rl.run import Run, restore_params  # noqa: E402
from jaxrl.rollout.collect import left_pad  # noqa: E402
from jaxrl.rollout.reference import make_sampler, row_keys  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "rollout_step.json"


def _timed(calls: dict, warmup: int, reps: int) -> dict[str, list[float]]:
  """Wall seconds of each call, `reps` times after `warmup` calls, interleaved (call a, call b,
  a, b, ...) so that a drift in the machine's speed hits every peer alike."""
  for fn in calls.values():
    for _ in range(warmup):
      fn()
  out = {name: [] for name in calls}
  for _ in range(reps):
    for name, fn in calls.items():
      t0 = time.perf_counter()
      fn()
      out[name].append(time.perf_counter() - t0)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--sft-workdir", default=None, help="a grpo_arith run with an SFT checkpoint")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--quick", action="store_true", help="1 warm-up, 2 reps")
  ap.add_argument("--out", default=str(DEFAULT_OUT))
  args = ap.parse_args(argv)
  if args.quick:
    args.warmup, args.reps = 1, 2

  import configs.grpo_arith as grpo_arith

  c = grpo_arith.get_config()
  c.log.progress = False
  c.log.tensorboard = False
  tmp = Path(tempfile.mkdtemp(prefix="rollout_step_"))
  params_from = "fresh init (seed 0)"
  try:
    if args.sft_workdir:
      src = Path(args.sft_workdir) / "checkpoints" / "sft"
      if not src.is_dir():
        raise SystemExit(f"--sft-workdir={args.sft_workdir!r}: no checkpoints/sft there")
      shutil.copytree(src, tmp / "checkpoints" / "sft")  # the source run is left untouched
      params_from = f"SFT checkpoint of {args.sft_workdir}"
    c.workdir = str(tmp)
    cfg = validate(c)
    run = Run.build(cfg)
    params = run.init_params
    if args.sft_workdir:
      _, step, params = restore_params(run, "sft")
      params_from += f" (step {step})"
    rl = cfg.rl
    g = rl.group_size
    rng = np.random.default_rng(0)
    records = [run.task.sample(rng) for _ in range(rl.prompts_per_step)]
    prompts = run.encode(records)
    held_out = run.encode(run.held_out)
    tok = run.tokenizer

    # The engine, as the loop calls it.
    sampler = build_sampler(run)

    def engine_round():
      out, _ = sampler(params, prompts, group_size=g, seed=1, version=0)
      return out

    def engine_eval():
      out, _ = sampler(params, held_out, group_size=1, seed=2, sampling=GREEDY)
      return out

    # The v0 static sampler, as the loop ran it before.
    kw = dict(
      prompt_len=rl.max_prompt_len,
      max_new_tokens=rl.max_new_tokens,
      eos_id=tok.eos_id,
      pad_id=tok.pad_id,
    )
    v0_sample = make_sampler(run.graphdef, run.model_cfg, sampling=sampler.sampling, **kw)
    v0_greedy = make_sampler(run.graphdef, run.model_cfg, sampling=GREEDY, **kw)
    rows = [p for p in prompts for _ in range(g)]
    toks, mask = left_pad(rows, rl.max_prompt_len, tok.pad_id)
    keys = row_keys(jax.random.key(1), np.arange(len(rows)))
    eval_batch = 256
    eval_chunks = [
      left_pad(held_out[i : i + eval_batch], rl.max_prompt_len, tok.pad_id)
      for i in range(0, len(held_out), eval_batch)
    ]
    eval_keys = row_keys(jax.random.key(2), np.arange(eval_batch))

    def v0_round():
      return jax.device_get(v0_sample(params, toks, mask, keys))

    def v0_eval():
      return [jax.device_get(v0_greedy(params, t, m, eval_keys)) for t, m in eval_chunks]

    peers = {
      "engine": {"rl_round": engine_round, "eval": engine_eval},
      "v0_static": {"rl_round": v0_round, "eval": v0_eval},
    }
    flat = {(name, what): fn for name, calls in peers.items() for what, fn in calls.items()}
    timed = _timed(flat, args.warmup, args.reps)
    results = {name: {} for name in peers}
    for (name, what), times in timed.items():
      results[name][what] = {"median_s": statistics.median(times), "times_s": times}
      print(f"{name:10s} {what:9s} {statistics.median(times) * 1e3:9.1f} ms", flush=True)
    lengths = {
      "engine": float(np.mean(engine_round().lengths)),
      "v0_static": float(np.mean(v0_round().lengths)),
    }
    greedy_same = float(
      np.mean(
        np.concatenate([o.tokens for o in v0_eval()])[: len(held_out)] == engine_eval().tokens
      )
    )
    ratios = {
      what: results["v0_static"][what]["median_s"] / results["engine"][what]["median_s"]
      for what in ("rl_round", "eval")
    }
    report = {
      "date": datetime.date.today().isoformat(),
      "machine": machine(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "versions": versions(),
      "config": "configs/grpo_arith.py",
      "params": params_from,
      "shape": {
        "prompts": len(prompts),
        "group_size": g,
        "max_prompt_len": rl.max_prompt_len,
        "max_new_tokens": rl.max_new_tokens,
        "eval_prompts": len(held_out),
        "engine_slots": sampler.engine.max_concurrent_decodes,
      },
      "warmup": args.warmup,
      "reps": args.reps,
      "results": results,
      "mean_completion_tokens": lengths,
      "greedy_token_agreement_engine_vs_v0": greedy_same,
      "v0_over_engine": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"v0_over_engine": ratios, "lengths": lengths}, indent=1))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
