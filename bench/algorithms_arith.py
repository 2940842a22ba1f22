"""Every RL algorithm config on the arithmetic task, from one shared SFT warm-start: curves + table.

The first config's SFT warm-start runs once (in `<root>/sft[_smoke]_seed<seed>`); every config whose
warm-start inputs equal it (`warm_start_key`: model, task, sft, eval, ...) gets a copy of that
checkpoint directory and so starts RL from the identical params, which the script checks by
requiring the same recorded accuracy after SFT for all of them. A config with a different
warm-start runs its own. Each config's `Trainer` then runs in this process, one after another.
Written: a JSON with per-config accuracies, RL wall time and curves (plus machine, versions, date),
a two-panel plot (held-out accuracy and sampled reward vs RL step), and a markdown table.

  .venv/bin/python bench/algorithms_arith.py                    # every configs/*_arith.py, full
  .venv/bin/python bench/algorithms_arith.py --variant smoke    # sanity run, ~1 min per config
  .venv/bin/python bench/algorithms_arith.py --configs grpo_arith,dapo_arith --rl-steps 100
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, versions  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from jaxrl.config import Config, ConfigError, config_module, validate  # noqa: E402
from jaxrl.metrics import read_jsonl  # noqa: E402
from jaxrl.rl.loop import Trainer  # noqa: E402

CONFIG_DIR = REPO / "configs"
FIRST = "grpo_arith"  # the default job: its warm-start is the shared one when it is run
VARIANTS = ("", "smoke")
KEY_FILE = "bench_warm_start.json"  # the warm-start inputs an SFT directory was made from


# Not a reward-driven RL algorithm (its signal is a teacher, exported from grpo_arith's run), and
# its own shorter warm-start: run by name when wanted.
NOT_BY_DEFAULT = ("distill_arith",)


def available_configs() -> list[str]:
  """configs/*_arith.py (but NOT_BY_DEFAULT), grpo_arith first (its SFT is the shared one)."""
  names = sorted(p.stem for p in CONFIG_DIR.glob("*_arith.py") if p.stem not in NOT_BY_DEFAULT)
  return sorted(names, key=lambda n: n != FIRST)


def load_config(name: str, variant: str, *, seed: int, rl_steps: int | None, workdir: Path):
  """configs/<name>.py's `get_config(variant)` with the bench's overrides, validated."""
  c = config_module(CONFIG_DIR / f"{name}.py").get_config(variant or None)
  c.seed = seed
  c.workdir = str(workdir)
  c.resume = True  # what lets a run restore the copied SFT checkpoint instead of training
  c.log.progress = False
  if rl_steps is not None:
    c.rl.steps = rl_steps
  try:
    return validate(c)
  except ConfigError as e:
    raise SystemExit(f"configs/{name}.py:{variant}: {e}") from e


def warm_start_key(cfg: Config) -> dict:
  """Everything the SFT phase and its held-out evaluations read; equal keys, equal warm-starts.

  Beyond the model, task and sft sections: the seed (init, data order, held-out set), the mesh,
  the prompt/completion shapes SFT batches are padded to, and what the recorded accuracy after
  SFT was measured with (reward, eval section, sampler).
  """
  return {
    "seed": cfg.seed,
    "mesh": dataclasses.asdict(cfg.mesh),
    "model": dataclasses.asdict(cfg.model),
    "task": dataclasses.asdict(cfg.task),
    "reward": dataclasses.asdict(cfg.reward),
    "sft": dataclasses.asdict(cfg.sft),
    "eval": dataclasses.asdict(cfg.eval),
    "rl.max_prompt_len": cfg.rl.max_prompt_len,
    "rl.max_new_tokens": cfg.rl.max_new_tokens,
    "rl.rollout.batching": cfg.rl.rollout.batching,
  }


def run_warm_start(cfg: Config) -> dict:
  """SFT only, in cfg.workdir; a finished one there is restored, not retrained."""
  workdir = Path(cfg.workdir)
  key = warm_start_key(cfg)
  key_file = workdir / KEY_FILE
  if key_file.exists() and json.loads(key_file.read_text()) != key:
    raise SystemExit(
      f"{workdir} holds a warm-start made from other settings ({key_file}); delete it or pass "
      "another --workdir-root"
    )
  workdir.mkdir(parents=True, exist_ok=True)
  key_file.write_text(json.dumps(key, indent=2))
  t0 = time.perf_counter()
  trainer = Trainer(cfg, log=lambda *_: None)
  try:
    trainer.run_sft()
  finally:
    trainer.close()  # waits for the last checkpoint to be committed before it is copied
  return {
    "workdir": str(workdir),
    "accuracy_init": trainer.summary.get("accuracy_init"),
    "accuracy_after_sft": trainer.summary["accuracy_after_sft"],
    "wall_s": time.perf_counter() - t0,
  }


def run_config(name: str, cfg: Config, warm_start_dir: Path | None) -> dict:
  """One config's Trainer from a fresh workdir (holding only the copied warm-start, if any)."""
  workdir = Path(cfg.workdir)
  # A leftover RL checkpoint would be resumed, and its curves and timings mixed into this run.
  shutil.rmtree(workdir, ignore_errors=True)
  if warm_start_dir is not None:
    shutil.copytree(warm_start_dir, workdir / "checkpoints" / "sft")
  trainer = Trainer(cfg, log=lambda *_: None)
  rl_wall = {}
  run_rl = trainer.run_rl

  def timed_run_rl(*args, **kwargs):
    t0 = time.perf_counter()
    run_rl(*args, **kwargs)
    rl_wall["s"] = time.perf_counter() - t0

  # run() calls self.run_rl: time the RL phase alone (compiles, evals and checkpoints included),
  # not the SFT restore or, for a config with its own warm-start, the SFT.
  trainer.run_rl = timed_run_rl
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  rl = [r for r in read_jsonl(workdir / "metrics.jsonl") if r.get("phase") == "rl"]
  # Step 0 is the warm-start itself, so every curve starts from the same point.
  eval_curve = [(0, summary["accuracy_after_sft"])]
  eval_curve += [(r["step"], r["eval/accuracy"]) for r in rl if "eval/accuracy" in r]
  return {
    "name": name,
    "seed": cfg.seed,
    "workdir": str(workdir),
    "warm_start": "shared" if warm_start_dir is not None else "own",
    "rl_steps": cfg.rl.steps,
    "accuracy_init": summary.get("accuracy_init"),
    "accuracy_after_sft": summary["accuracy_after_sft"],
    "accuracy_after_rl": summary["accuracy_after_rl"],
    "rl_wall_s": rl_wall["s"],
    # Rollout + update time summed over steps: the RL wall time less compiles, evals, checkpoints.
    "rl_step_s": sum(r.get("time/rollout_s", 0.0) + r.get("time/train_s", 0.0) for r in rl),
    "eval_curve": eval_curve,
    "reward_curve": [(r["step"], r["rl/reward_mean"]) for r in rl if "rl/reward_mean" in r],
    "rl_config": dataclasses.asdict(cfg.rl),
  }


def plot(runs: list[dict], out_png: Path, title: str) -> Path:
  """Held-out accuracy (top) and sampled reward (bottom) vs RL step, one line per config."""
  fig = Figure(figsize=(7.0, 5.6), layout="constrained")
  FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch
  ax_acc, ax_rew = fig.subplots(2, 1, sharex=True)
  for run in runs:
    for ax, key in ((ax_acc, "eval_curve"), (ax_rew, "reward_curve")):
      if run[key]:
        xs, ys = zip(*run[key], strict=True)
        ax.plot(xs, ys, marker="o" if len(xs) <= 50 else None, markersize=3, label=run["name"])
  ax_acc.set_title(f"held-out accuracy (greedy); step 0 = after SFT — {title}")
  ax_rew.set_title("sampled reward (T = rl.sampling.temperature)")
  for ax in (ax_acc, ax_rew):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
  ax_rew.set_xlabel("RL step")
  out_png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out_png, dpi=120)
  return out_png


def markdown_table(runs: list[dict]) -> str:
  rows = [
    "| config | seed | RL steps | held-out after SFT | after RL | RL wall time |",
    "| ------ | ---- | -------- | ------------------ | -------- | ------------ |",
  ]
  for r in runs:
    rows.append(
      f"| `{r['name']}` | {r['seed']} | {r['rl_steps']} | {r['accuracy_after_sft']:.3f} | "
      f"{r['accuracy_after_rl']:.3f} | {r['rl_wall_s']:.0f} s |"
    )
  return "\n".join(rows)


def environment() -> dict:
  return {
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }


def replot(files: list[Path], out_png: Path) -> dict:
  """One plot and table over the runs of several result files (e.g. a config run later from the
  same warm-start); refuses files whose warm-starts differ."""
  results = [json.loads(f.read_text()) for f in files]
  starts = {(r["seed"], r["variant"], r["warm_start"]["accuracy_after_sft"]) for r in results}
  if len(starts) != 1:
    raise SystemExit(f"--replot: the files come from different warm-starts: {sorted(starts)}")
  runs = [run for r in results for run in r["runs"]]
  seed, variant, _ = starts.pop()
  plot(runs, out_png, f"{variant or 'full'}, seed {seed}")
  print(f"plot: {out_png}\n")
  print(markdown_table(runs))
  return {"runs": runs, "plot": str(out_png)}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  known = available_configs()
  ap.add_argument(
    "--configs",
    default=",".join(known),
    help=f"comma-separated names; the first one's SFT is shared (default: {','.join(known)})",
  )
  ap.add_argument("--variant", default="", help="config variant: '' (full) or 'smoke'")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--rl-steps", type=int, default=None, help="override every config's rl.steps")
  ap.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "algorithms_arith.json")
  ap.add_argument("--plot", type=Path, default=REPO / "docs" / "algorithms_arith.png")
  ap.add_argument(
    "--workdir-root",
    type=Path,
    default=REPO / "runs" / "algorithms",
    help="holds the shared warm-start and one workdir per config (replaced on each run)",
  )
  ap.add_argument(
    "--replot",
    default="",
    help="comma-separated result JSONs of earlier invocations (same seed and warm-start): "
    "plot all their runs together into --plot, print one table, run nothing",
  )
  args = ap.parse_args(argv)
  if args.replot:
    return replot([Path(f) for f in args.replot.split(",") if f], args.plot)
  names = [n.strip() for n in args.configs.split(",") if n.strip()]
  bad = [n for n in names if not (CONFIG_DIR / f"{n}.py").exists()]
  if bad or not names:
    raise SystemExit(f"--configs={args.configs!r}: unknown {bad}; allowed: {', '.join(known)}")
  if len(set(names)) != len(names):
    raise SystemExit(f"--configs={args.configs!r} names a config twice")
  if args.variant not in VARIANTS:
    raise SystemExit(f"--variant={args.variant!r}: allowed: '' (full) or 'smoke'")
  if args.seed < 0:
    raise SystemExit(f"--seed must be >= 0, got {args.seed}")
  if args.rl_steps is not None and args.rl_steps <= 0:
    raise SystemExit(f"--rl-steps must be positive, got {args.rl_steps}")
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO

  root = args.workdir_root
  suffix = f"_{args.variant}" if args.variant else ""
  kw = dict(seed=args.seed, rl_steps=args.rl_steps)
  # Every config is loaded and validated before anything runs: a bad one fails in seconds.
  cfgs = {
    n: load_config(n, args.variant, workdir=root / f"{n}{suffix}_seed{args.seed}", **kw)
    for n in names
  }
  shared_cfg = load_config(
    names[0], args.variant, workdir=root / f"sft{suffix}_seed{args.seed}", **kw
  )
  shared_key = warm_start_key(shared_cfg)

  print(
    f"warm-start: {names[0]}{suffix} SFT ({shared_cfg.sft.steps} steps) in {shared_cfg.workdir}"
  )
  warm = run_warm_start(shared_cfg)
  warm["config"] = names[0]
  warm_dir = Path(shared_cfg.workdir) / "checkpoints" / "sft"
  print(
    f"warm-start: held-out accuracy {warm['accuracy_init']:.3f} at init -> "
    f"{warm['accuracy_after_sft']:.3f} after SFT ({warm['wall_s']:.0f} s)",
    flush=True,
  )

  result = {
    "benchmark": "algorithms_arith",
    "variant": args.variant,
    "seed": args.seed,
    "rl_steps_override": args.rl_steps,
    **environment(),
    "warm_start": warm,
    "runs": [],
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  for name, cfg in cfgs.items():
    shared = warm_start_key(cfg) == shared_key
    run = run_config(name, cfg, warm_dir if shared else None)
    # Same warm-start checkpoint, same held-out set: the accuracy after SFT must be identical.
    if shared and run["accuracy_after_sft"] != warm["accuracy_after_sft"]:
      raise RuntimeError(
        f"{name}: accuracy after SFT {run['accuracy_after_sft']} != the shared warm-start's "
        f"{warm['accuracy_after_sft']}: it did not start RL from the shared checkpoint"
      )
    result["runs"].append(run)
    # Written after every run, so a long job that dies midway keeps what it measured.
    args.out.write_text(json.dumps(result, indent=2))
    print(
      f"{name}{suffix} seed {cfg.seed}: held-out {run['accuracy_after_sft']:.3f} after SFT "
      f"({run['warm_start']} warm-start) -> {run['accuracy_after_rl']:.3f} after "
      f"{cfg.rl.steps} RL steps in {run['rl_wall_s']:.0f} s",
      flush=True,
    )

  title = f"{args.variant or 'full'}, seed {args.seed}"
  result["plot"] = str(plot(result["runs"], args.plot, title))
  args.out.write_text(json.dumps(result, indent=2))
  print(f"\nJSON: {args.out}  plot: {args.plot}\n")
  print(markdown_table(result["runs"]))
  return result


if __name__ == "__main__":
  main()
