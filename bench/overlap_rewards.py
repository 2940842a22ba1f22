"""Colocated RL steps with and without scoring overlapped with decoding
(`rl.rollout.overlap_rewards`), on the default job and on the code task.

With the overlap on, each completion is detokenised and scored as soon as it finishes, in the
driver's thread, while the engine's next decode call runs on the device (JAX dispatches it
asynchronously); with it off, the whole batch is scored after the last token. The step's
wall-clock (rollout + update) is compared mode against mode, paired by seed, the modes
interleaved seed by seed. `host_share` is the share of the synchronous step spent detokenising
and scoring: what overlapping could hide at most.

Jobs: `arith` (configs/grpo_arith.py: exact-match reward, cheap) and `code`
(configs/grpo_code.py: every completion runs in a sandboxed process, `reward.sandbox.workers` at
a time). Each run: a `--sft-steps` warm-start (so completions have the trained model's shapes),
then `--warmup` + `--steps` RL steps; the measured steps are the last `--steps`.

  .venv/bin/python bench/overlap_rewards.py --seeds=0-2
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

from _common import HostClock, machine, versions  # noqa: E402

from jaxrl.config import config_module, validate  # noqa: E402
from jaxrl.metrics import read_jsonl  # noqa: E402
from jaxrl.rl.loop import Trainer  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "overlap_rewards.json"
JOBS = {"arith": "grpo_arith.py", "code": "grpo_code.py"}
MODES = {"sync": False, "overlap": True}


def _seeds(text: str) -> list[int]:
  if "-" in text:
    lo, hi = text.split("-")
    return list(range(int(lo), int(hi) + 1))
  return [int(s) for s in text.split(",")]


def _config(job: str, overlap: bool, seed: int, args, workdir: str):
  c = config_module(REPO / "configs" / JOBS[job]).get_config()
  c.seed, c.workdir = seed, workdir
  c.log.progress, c.log.tensorboard = False, False
  c.sft.steps, c.sft.warmup_steps = args.sft_steps, min(c.sft.warmup_steps, args.sft_steps // 2)
  c.rl.steps = args.warmup + args.steps
  c.rl.rollout.overlap_rewards = overlap
  c.eval = dict(every=0, num_examples=32, num_samples=0)
  c.checkpoint.every = 10_000  # only the final, forced save
  return validate(c)


def _run(job: str, mode: str, seed: int, args) -> dict:
  """Seconds per measured RL step and, without the overlap, the host work's share of it."""
  with tempfile.TemporaryDirectory() as wd:
    trainer = Trainer(_config(job, MODES[mode], seed, args, wd), log=lambda *_: None)
    clock = HostClock(trainer)
    try:
      trainer.run()
    finally:
      trainer.close()
    rows = [r for r in read_jsonl(Path(wd) / "metrics.jsonl") if r["phase"] == "rl"]
  rows, host_s = rows[args.warmup :], clock.per_step()[args.warmup :]
  walls = [r["time/rollout_s"] + r["time/train_s"] for r in rows]
  out = {
    "step_s": statistics.fmean(walls),
    "rollout_s": statistics.fmean(r["time/rollout_s"] for r in rows),
    "reward": statistics.fmean(r["rl/reward_mean"] for r in rows),
    "response_length": statistics.fmean(r["rl/response_length"] for r in rows),
  }
  if mode == "sync":
    out["host_s"] = statistics.fmean(host_s)
    out["host_share"] = out["host_s"] / out["step_s"]
  return out


def _summary(values: list[float]) -> dict:
  return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seeds", default="0-2")
  ap.add_argument("--jobs", default="arith,code")
  ap.add_argument("--sft-steps", type=int, default=100, help="warm-start steps per run")
  ap.add_argument("--steps", type=int, default=6, help="measured RL steps per run")
  ap.add_argument("--warmup", type=int, default=2, help="RL steps before measuring (compiles)")
  ap.add_argument("--out", default=str(DEFAULT_OUT))
  args = ap.parse_args(argv)
  seeds, jobs = _seeds(args.seeds), args.jobs.split(",")
  unknown = sorted(set(jobs) - set(JOBS))
  if unknown:
    ap.error(f"--jobs: unknown {unknown}; allowed: {sorted(JOBS)}")
  per_seed = {job: {mode: {} for mode in MODES} for job in jobs}
  for seed in seeds:
    for job in jobs:
      for mode in MODES:  # interleaved by seed: a drift in machine speed hits both modes alike
        out = _run(job, mode, seed, args)
        per_seed[job][mode][seed] = out
        print(f"[bench] seed {seed} {job} {mode}: {json.dumps(out)}", flush=True)

  result = {
    "benchmark": "overlap_rewards",
    "date": datetime.date.today().isoformat(),
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax")),
    "config": {job: f"configs/{JOBS[job]}, sft.steps={args.sft_steps}" for job in jobs},
    "seeds": seeds,
    "steps": args.steps,
    "warmup": args.warmup,
    "jobs": {},
    "per_seed": per_seed,
  }
  for job in jobs:
    sync = [per_seed[job]["sync"][s] for s in seeds]
    over = [per_seed[job]["overlap"][s] for s in seeds]
    result["jobs"][job] = {
      "sync_step_s": _summary([r["step_s"] for r in sync]),
      "overlap_step_s": _summary([r["step_s"] for r in over]),
      "overlap_vs_sync": _summary(
        [o["step_s"] / s["step_s"] for o, s in zip(over, sync, strict=True)]
      ),
      "host_share": _summary([r["host_share"] for r in sync]),
    }
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
  for job, m in result["jobs"].items():
    x, h = m["overlap_vs_sync"], m["host_share"]
    print(
      f"{job:6s} sync {m['sync_step_s']['mean']:.3f}s  overlap {m['overlap_step_s']['mean']:.3f}s"
      f"  overlap / sync {x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f})"
      f"  host share {h['mean']:.3f} ({h['min']:.3f}-{h['max']:.3f})"
    )
  return result


if __name__ == "__main__":
  main()
