"""Kill a training run with SIGKILL at random moments, restart it each time, and check that it
ends where an uninterrupted run ends: the same final checkpoint, bit for bit, and every metric
row once with the same values.

  python -m launch.fault_inject --config=configs/grpo_arith.py:smoke --kills=20 --out=/tmp/fi

Kills are keyed on the try's progress, in turn: one inside a checkpoint write (when an orbax
temporary directory appears), one inside the start-up (a random share of the quickest start-up
seen so far: imports, compiles, the restore, up to a first checkpoint), and one a random delay
after the try has committed a checkpoint of its own (so the series moves forward between
kills). A job with C checkpoints therefore takes about 3C kills before it can finish; a try
that finishes before its kill ends the series (the report counts the kills that landed).
Writes OUT/report.json; exits 1 if the runs differ.

With a persistent compilation cache (JAX_COMPILATION_CACHE_DIR), as a production restart has,
the uninterrupted run fills it and every try loads its programs from it: a try's start-up is
then shorter than the uninterrupted run's, which is why start-up kills are scaled from the
start-ups of the tries themselves (the first try is killed inside a checkpoint write, so its
start-up is seen before any start-up kill).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _command(config: str, workdir: Path, overrides: list[str]) -> list[str]:
  return [
    sys.executable,
    "-m",
    "launch.train",
    f"--config={config}",
    f"--config.workdir={workdir}",
    "--config.log.progress=False",
    *(f"--config.{o}" for o in overrides),
  ]


def _writes(workdir: Path) -> set[Path]:
  """The checkpoint writes under way (orbax's temporary directories; a killed try's stay behind
  until the next try cleans them up)."""
  return set(workdir.glob("checkpoints/*/*.orbax-checkpoint-tmp*"))


def _committed(workdir: Path) -> set[str]:
  """The checkpoints committed so far, as "phase/step"."""
  return {f"{p.parent.name}/{p.name}" for p in workdir.glob("checkpoints/*/*") if p.name.isdigit()}


KINDS = ("checkpoint write", "start-up", "after a checkpoint")


def _run_and_kill(cmd, workdir: Path, log, kind: str, delay: float, limit: float) -> dict:
  """Start `cmd` and SIGKILL it: after `delay` seconds ("start-up"), inside its first
  checkpoint write ("checkpoint write"), or `delay` seconds after it commits its first
  checkpoint ("after a checkpoint"); at `limit` seconds whatever happened. What happened,
  with the seconds the try took to its first checkpoint write or commit ("started_s", None
  if it was killed before either)."""
  before, stale = _committed(workdir), _writes(workdir)
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  t0 = time.monotonic()
  caught, kill_at, started = False, delay if kind == "start-up" else None, None
  while proc.poll() is None:
    now = time.monotonic() - t0
    if now >= limit or (kill_at is not None and now >= kill_at):
      break
    writing = bool(_writes(workdir) - stale)
    if started is None and (writing or _committed(workdir) - before):
      started = now
    if kind == "checkpoint write" and writing:
      caught = True
      break
    if kind == "after a checkpoint" and kill_at is None and _committed(workdir) - before:
      kill_at = now + delay
    time.sleep(0.002 if kind == "checkpoint write" else 0.01)
  finished = proc.poll() is not None
  if not finished:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  return {
    "kind": kind,
    "after_s": round(time.monotonic() - t0, 3),
    "inside_checkpoint_write": caught,
    "finished_before_the_kill": finished,
    "returncode": proc.returncode,
    "started_s": None if started is None else round(started, 3),
  }


def _final_state(workdir: Path) -> tuple[int, dict]:
  """(step, {leaf path: numpy array}) of the newest RL checkpoint."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from absl import logging

  logging.set_verbosity(logging.ERROR)  # orbax warns of a metadata file it does not need
  ckpts = workdir / "checkpoints" / "rl"
  step = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
  path = ckpts / str(step) / "state"
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(path).item_metadata
  # Onto one local device, whatever mesh the run saved from (this process may see fewer).
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), getattr(meta, "tree", meta)
  )
  tree = checkpointer.restore(path, target)
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return step, {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _metric_rows(workdir: Path) -> list[dict]:
  """metrics.jsonl without the timings (they differ run to run)."""
  rows = []
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    if line.strip():
      r = json.loads(line)
      rows.append({k: v for k, v in r.items() if not k.startswith("time/")})
  return rows


def compare(full: Path, killed: Path) -> list[str]:
  """What differs between the two runs' final checkpoints and metric rows (empty: nothing)."""
  import numpy as np

  problems = []
  step_a, a = _final_state(full)
  step_b, b = _final_state(killed)
  if step_a != step_b:
    problems.append(f"final RL checkpoint step {step_b}, uninterrupted {step_a}")
  if a.keys() != b.keys():
    problems.append(f"checkpoint leaves differ: {sorted(a.keys() ^ b.keys())[:5]}")
  for k in sorted(a.keys() & b.keys()):
    if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k]):
      problems.append(f"checkpoint leaf {k} differs")
  rows_a, rows_b = _metric_rows(full), _metric_rows(killed)
  # A step may log more than one row (SFT's last step: its loss, then the evaluation); a key
  # seen more often than in the uninterrupted run is a row written again after a restart.
  seen_a = collections.Counter((r.get("phase"), r["step"]) for r in rows_a)
  seen_b = collections.Counter((r.get("phase"), r["step"]) for r in rows_b)
  dupes = sorted(k for k, n in seen_b.items() if n > seen_a[k])
  if dupes:
    problems.append(f"metric rows written twice: {dupes[:5]}")
  if rows_a != rows_b:
    problems.append(f"metric rows differ ({len(rows_b)} rows vs {len(rows_a)} uninterrupted)")
  return problems


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", required=True, help="configs/*.py[:variant]")
  ap.add_argument("--kills", type=int, default=20, help="SIGKILLs before the run may finish")
  ap.add_argument("--out", required=True, help="a new directory: the two runs and report.json")
  ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="sft.steps=10")
  args = ap.parse_args(argv)
  if args.kills < 0:
    ap.error(f"--kills must be >= 0, got {args.kills}")
  out = Path(args.out)
  if out.exists() and any(out.iterdir()):
    ap.error(f"--out={str(out)!r} is not empty: pick a new directory")
  out.mkdir(parents=True, exist_ok=True)
  rng = random.Random(args.seed)
  with open(out / "full.log", "w") as log:
    t0 = time.monotonic()
    proc = subprocess.Popen(
      _command(args.config, out / "full", args.set), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    ready = None  # start-up: until the first checkpoint is committed
    seen: set[str] = set()  # every checkpoint committed (older ones are deleted as it goes)
    while proc.poll() is None:
      seen |= _committed(out / "full")
      if ready is None and seen:
        ready = time.monotonic() - t0
      time.sleep(0.02)
    seen |= _committed(out / "full")
    rc, wall = proc.returncode, time.monotonic() - t0
    ready = wall / 2 if ready is None else ready
  if rc:
    print(f"the uninterrupted run failed (exit {rc}); see {out / 'full.log'}", file=sys.stderr)
    return 2
  checkpoints = max(len(seen), 1)
  print(
    f"[fault_inject] uninterrupted run: {wall:.1f}s, {ready:.1f}s to its first of "
    f"{len(seen)} checkpoints"
  )
  # The time between two checkpoints of the uninterrupted run bounds the delay after one.
  gap = max(wall - ready, 0.1) / checkpoints
  kills = []
  cmd = _command(args.config, out / "killed", args.set)
  with open(out / "killed.log", "w") as log:
    for i in range(args.kills):
      kind = KINDS[i % len(KINDS)]
      delay = rng.uniform(0.2, 1.0) * ready if kind == "start-up" else rng.uniform(0.0, gap)
      kill = _run_and_kill(cmd, out / "killed", log, kind, delay, limit=2 * wall)
      if kill["started_s"] is not None:  # the quickest start-up seen scales the next ones
        ready = min(ready, kill["started_s"])
      kills.append(kill)
      print(f"[fault_inject] kill {i + 1}/{args.kills}: {kill}", flush=True)
      if kill["finished_before_the_kill"]:  # nothing left to interrupt: a longer job for more
        break
    rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
  if rc:
    print(f"the restarted run failed (exit {rc}); see {out / 'killed.log'}", file=sys.stderr)
    return 2
  problems = compare(out / "full", out / "killed")
  report = {
    "config": args.config,
    "overrides": args.set,
    "kills": kills,
    "kills_landed": sum(not k["finished_before_the_kill"] for k in kills),
    "kills_inside_checkpoint_writes": sum(k["inside_checkpoint_write"] for k in kills),
    "kills_by_kind": {
      kind: sum(k["kind"] == kind and not k["finished_before_the_kill"] for k in kills)
      for kind in KINDS
    },
    "identical": not problems,
    "problems": problems,
  }
  (out / "report.json").write_text(json.dumps(report, indent=2))
  outcome = "identical to the uninterrupted run" if not problems else "; ".join(problems)
  n, n_in = report["kills_landed"], report["kills_inside_checkpoint_writes"]
  print(f"[fault_inject] {n} kills landed ({n_in} inside checkpoint writes): {outcome}")
  return 0 if not problems else 1


if __name__ == "__main__":
  sys.exit(main())
