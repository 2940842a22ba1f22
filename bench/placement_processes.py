"""Placements over two processes (jax.distributed on this machine, gloo between them), 4
simulated CPU devices each: colocated vs the split placement, on the default job's RL step
(configs/grpo_arith.py: 64 prompts x 8 samples).

  colocated   one 8-device mesh over both processes; sampler and learner take turns
  split_k1    max_staleness 1: each process gives 2 devices to the learner (a 4-device
              sub-mesh over both processes) and 2 to its own engine, which samples its half
              of every batch's prompts; the main thread samples the next batch while the
              learner's devices run the update, then pushes the new version

Each mode trains `--warmup` + `--steps` + 1 RL steps from a 4-step warm-start per seed, modes
interleaved by seed (the last step is not measured: the split has no batch left to sample
during its update). Reported over the measured steps: wall seconds per step (the host's
rollout wait + batch build + update + publish, from process 0's metrics), and for the split
the host's sampling during the update (`time/sample_ahead_s`), its wait for the update after
that (`time/update_wait_s`) and the push. The two processes and their 8 devices share this
machine's cores: on a 2-core host the two sides mostly take turns on the CPU, so the ratio
says what the lockstep costs or saves here, not on chips of their own.

  .venv/bin/python bench/placement_processes.py --seeds=0-2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

DEFAULT_OUT = BENCH_DIR / "results" / "placement_processes.json"
MODES = {"colocated": {}, "split_k1": {"kind": "split", "max_staleness": 1}}
PROCESSES, DEVICES_EACH = 2, 4


def _child(args) -> None:
  """One process of a run: join, train, leave the metrics in the workdir (process 0)."""
  from jaxrl import distributed

  distributed.initialize(args.coordinator, PROCESSES)
  from jaxrl.config import config_module, validate
  from jaxrl.rl.loop import Trainer

  c = config_module(REPO / "configs" / "grpo_arith.py").get_config()
  c.seed, c.workdir = args.seed, args.workdir
  c.log.progress, c.log.tensorboard = False, False
  c.sft.steps, c.sft.warmup_steps = 4, 0
  c.rl.steps = args.rl_steps
  c.rl.placement = MODES[args.mode]
  c.eval = dict(every=0, num_examples=64, num_samples=0)
  c.checkpoint.every = 10_000  # only the final, forced save
  trainer = Trainer(validate(c), log=lambda *_: None)
  try:
    trainer.run()
  finally:
    trainer.close()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(mode: str, seed: int, steps: int, warmup: int) -> dict:
  from jaxrl.metrics import read_jsonl

  with tempfile.TemporaryDirectory() as wd:
    env = os.environ | {
      "XLA_FLAGS": (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES_EACH}"
      ).strip(),
      "JAX_PLATFORMS": "cpu",
    }
    cmd = [sys.executable, __file__, "--child", f"--coordinator=127.0.0.1:{_free_port()}",
           f"--mode={mode}", f"--seed={seed}", f"--rl-steps={warmup + steps + 1}",
           f"--workdir={wd}"]  # fmt: skip
    procs = [
      subprocess.Popen(
        cmd,
        env=env | {"JAXRL_PROCESS_ID": str(i)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )  # fmt: skip
      for i in range(PROCESSES)
    ]
    logs = [p.communicate()[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
      if p.returncode:
        raise RuntimeError(f"{mode} seed {seed}: a process failed:\n{log[-3000:]}")
    # The run's last step has no next batch to sample during its update: left out (a run
    # has one more step than is measured, in both modes).
    rows = [r for r in read_jsonl(Path(wd) / "metrics.jsonl") if r["phase"] == "rl"]
    rows = rows[warmup:-1]
  out = {
    "step_s": statistics.fmean(r["time/rollout_s"] + r["time/train_s"] for r in rows),
    "steps": len(rows),
    "reward": statistics.fmean(r["rl/reward_mean"] for r in rows),
    "staleness_max": max(r["async/staleness_max"] for r in rows),
  }
  if mode == "split_k1":
    for key in ("sample_ahead_s", "update_wait_s", "push_s"):
      out[key] = statistics.median(r[f"time/{key}"] for r in rows)
  return out


def _seeds(text: str) -> list[int]:
  if "-" in text:
    lo, hi = text.split("-")
    return list(range(int(lo), int(hi) + 1))
  return [int(s) for s in text.split(",")]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seeds", default="0-2")
  ap.add_argument("--steps", type=int, default=8, help="measured RL steps per seed and mode")
  ap.add_argument("--warmup", type=int, default=3, help="RL steps before measuring (compiles)")
  ap.add_argument("--out", default=str(DEFAULT_OUT))
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", help=argparse.SUPPRESS)
  ap.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
  ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--rl-steps", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--workdir", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    _child(args)
    return {}
  from _common import print_modes, write_modes_report

  seeds = _seeds(args.seeds)
  per_seed = {mode: {} for mode in MODES}
  for seed in seeds:
    for mode in MODES:  # interleaved by seed: a drift in machine speed hits every mode alike
      per_seed[mode][seed] = out = _run(mode, seed, args.steps, args.warmup)
      print(f"[bench] seed {seed} {mode}: {json.dumps(out)}", flush=True)
  result = write_modes_report(
    Path(args.out),
    "placement_processes",
    f"configs/grpo_arith.py, sft.steps=4, {PROCESSES} processes x {DEVICES_EACH} simulated devices",
    per_seed,
    seeds,
    steps=args.steps,
    warmup=args.warmup,
  )
  print_modes(result["modes"], ("sample_ahead_s", "update_wait_s", "push_s"), width=10)
  return result


if __name__ == "__main__":
  main()
