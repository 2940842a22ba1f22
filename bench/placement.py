"""Placements on 8 simulated CPU devices: colocated vs split sampler/learner sub-meshes
(rl.placement), on the default job's RL step (configs/grpo_arith.py: 64 prompts x 8 samples).

Each mode trains `--warmup` + `--steps` RL steps from a 4-step warm-start (the step's shapes,
not its learning, are measured) per seed, modes interleaved by seed:
  colocated      max_staleness 0: one 8-device mesh, sampler and learner take turns, zero copy
  colocated_k1   max_staleness 1 on the same mesh: every version is copied (the copy's cost)
  split_k1       4 learner + 4 sampler devices, the sampler in its own thread one step off
  split_k1_probe split_k1, and before every other version's push a plain `device_put` of the
                 same params to the same shardings is timed (the push that follows it is
                 not counted): a plain put at the push's own moment, right after an update
                 with the sampler thread running, for the push's time on the other versions
Reported per mode over the measured steps: wall seconds per step (rollout wait + batch build +
update + publish), the learner's and the sampler's busy share of the wall-clock, the push
time, and the host share of the colocated step (detokenising and scoring: what overlapping
host work with the device could hide at most). After the split runs the same process times a
plain `jax.device_put` of the learner's params onto the sampler's sub-mesh (median of
`--puts`) against the pipeline's push.

The 8 devices share this machine's cores: simulated devices run concurrently only as far as
the cores allow, so on a 2-core host the split's two sides mostly take turns on the CPU.

  .venv/bin/python bench/placement.py --seeds=0-2
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

import jax  # noqa: E402
from _common import HostClock, print_modes, write_modes_report  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxrl.config import config_module, validate  # noqa: E402
from jaxrl.metrics import read_jsonl  # noqa: E402
from jaxrl.rl.loop import Trainer  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "placement.json"
MODES = {
  "colocated": {},
  "colocated_k1": {"max_staleness": 1},
  "split_k1": {"kind": "split", "max_staleness": 1},
  "split_k1_probe": {"kind": "split", "max_staleness": 1},
}


def _seeds(text: str) -> list[int]:
  if "-" in text:
    lo, hi = text.split("-")
    return list(range(int(lo), int(hi) + 1))
  return [int(s) for s in text.split(",")]


def _config(mode: str, seed: int, steps: int, workdir: str):
  c = config_module(REPO / "configs" / "grpo_arith.py").get_config()
  c.seed, c.workdir = seed, workdir
  c.log.progress, c.log.tensorboard = False, False
  c.sft.steps, c.sft.warmup_steps = 4, 0
  c.rl.steps = steps
  c.rl.placement = MODES[mode]
  c.eval = dict(every=0, num_examples=64, num_samples=0)
  c.checkpoint.every = 10_000  # only the final, forced save
  return validate(c)


def _probe_puts(trainer: Trainer, warmup: int) -> dict:
  """Patch the trainer's pipeline: before the push of every odd version past the warm-up,
  time a plain device_put of the same params onto the same shardings (the push after it is
  not counted: the probe warmed it); the even versions' pushes are counted as they are."""
  pipe, record = trainer.pipeline, {"probe_put": [], "push": []}
  publish = pipe.publish

  def probed(version: int, params) -> None:
    probe = None
    if version > warmup and version % 2 == 1 and pipe._push_to is not None:
      jax.block_until_ready(params)  # as the push does before its clock starts
      t0 = time.perf_counter()
      jax.block_until_ready(jax.device_put(pipe.experience.sampler_params(params), pipe._push_to))
      probe = time.perf_counter() - t0
    pushed = pipe._push_s
    publish(version, params)
    if pipe._push_s is pushed:  # no push for this version (no batch reads it)
      return
    if probe is not None:
      record["probe_put"].append(probe)
    elif version > warmup:
      record["push"].append(pipe._push_s)

  pipe.publish = probed
  return record


def _run(mode: str, seed: int, steps: int, warmup: int) -> tuple[dict, Trainer]:
  with tempfile.TemporaryDirectory() as wd:
    trainer = Trainer(_config(mode, seed, steps, wd), log=lambda *_: None)
    clock = HostClock(trainer)  # detokenising and scoring, the host work of a rollout
    probes = _probe_puts(trainer, warmup) if mode == "split_k1_probe" else None
    trainer.run()
    trainer.close()
    rows = [r for r in read_jsonl(Path(wd) / "metrics.jsonl") if r["phase"] == "rl"][warmup:]
  walls = [r["time/rollout_s"] + r["time/train_s"] for r in rows]
  out = {
    "step_s": statistics.fmean(walls),
    "steps": len(rows),
    "reward": statistics.fmean(r["rl/reward_mean"] for r in rows),
    "response_length": statistics.fmean(r["rl/response_length"] for r in rows),
    "staleness_max": max(r["async/staleness_max"] for r in rows),
  }
  if mode == "colocated":
    # Host work per measured step (rollouts are sampled inside the step, in this thread).
    out["host_s"] = statistics.fmean(clock.per_step()[warmup:])
    out["host_share"] = out["host_s"] / out["step_s"]
  else:
    out["push_s"] = statistics.median(r["time/push_s"] for r in rows)
    out["learner_busy"] = statistics.fmean(r["time/learner_busy_frac"] for r in rows)
    out["learner_wait_s"] = statistics.fmean(r["time/learner_wait_s"] for r in rows)
    if mode.startswith("split"):
      out["sampler_busy"] = statistics.fmean(r["time/sampler_busy_frac"] for r in rows)
  if probes is not None:
    out["push_s"] = statistics.median(probes["push"])
    out["same_moment_put_s"] = statistics.median(probes["probe_put"])
    out["push_vs_same_moment_put"] = out["push_s"] / out["same_moment_put_s"]
  return out, trainer


def _plain_put_s(trainer: Trainer, n: int) -> tuple[float, int]:
  """Median seconds of a plain device_put of the learner's params onto the sampler sub-mesh,
  and the bytes moved."""
  params = trainer.state.policy.params
  mesh = trainer.ctx.sampler_mesh
  target = jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), params)
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(jax.device_put(params, target))
    times.append(time.perf_counter() - t0)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  return statistics.median(times), nbytes


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seeds", default="0-2")
  ap.add_argument("--steps", type=int, default=8, help="measured RL steps per seed and mode")
  ap.add_argument("--warmup", type=int, default=3, help="RL steps before measuring (compiles)")
  ap.add_argument("--puts", type=int, default=20, help="plain device_puts timed per seed")
  ap.add_argument("--out", default=str(DEFAULT_OUT))
  args = ap.parse_args(argv)
  assert len(jax.devices()) == 8, jax.devices()
  seeds = _seeds(args.seeds)
  per_seed = {mode: {} for mode in MODES}
  puts = {}
  for seed in seeds:
    for mode in MODES:  # interleaved by seed: a drift in machine speed hits every mode alike
      out, trainer = _run(mode, seed, args.warmup + args.steps, args.warmup)
      if mode.startswith("split"):
        out["plain_put_s"], out["param_bytes"] = _plain_put_s(trainer, args.puts)
        out["push_vs_plain_put"] = out["push_s"] / out["plain_put_s"]
        puts[seed] = out["plain_put_s"]
      per_seed[mode][seed] = out
      print(f"[bench] seed {seed} {mode}: {json.dumps(out)}", flush=True)

  result = write_modes_report(
    Path(args.out),
    "placement",
    "configs/grpo_arith.py, sft.steps=4, 8 simulated devices",
    per_seed,
    seeds,
    steps=args.steps,
    warmup=args.warmup,
  )
  print_modes(
    result["modes"],
    ("host_share", "learner_busy", "sampler_busy", "push_vs_plain_put", "push_vs_same_moment_put"),
  )
  return result


if __name__ == "__main__":
  main()
