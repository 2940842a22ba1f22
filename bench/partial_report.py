"""Partial vs synchronous rollouts over training on the long-tailed chain task
(`configs/grpo_chain.py`): per seed, held-out greedy accuracy after RL paired against the
synchronous run on the same warm-start, completed groups per second of rollout time (all steps,
and from step `--steady` on, once the resume buckets have compiled), decode steps, and the
tokens generated. Reads sweeps made with `python -m launch.sweep run ...`; a cell may span
several sweep directories (seeds split across them). Writes a markdown table to stdout, a PNG
(accuracy over cumulative rollouts and over cumulative trained tokens) and the per-seed numbers
as JSON.

  .venv/bin/python bench/partial_report.py \
      --sync runs/sweep/chain1_sync_a,runs/sweep/chain1_sync_b \
      --partial runs/sweep/chain1_partial_a,runs/sweep/chain1_partial_b \
      --png=docs/partial_chain.png --json=bench/results/partial_chain.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from staleness_report import _rollouts_per_step, paired, plot_accuracy, span  # noqa: E402


def runs_of(outs: list[Path], isa: str, steady: int) -> dict[int, dict]:
  """seed -> final accuracy, throughput and the per-eval curve (step, cumulative rollouts,
  cumulative trained tokens, accuracy) of each finished run in the sweep directories `outs`."""
  got = {}
  for out in outs:
    for path in sorted((out / "runs").glob(f"{isa}_seed*.json")):
      run = json.loads(path.read_text())
      if not run.get("ok"):
        continue
      if run["seed"] in got:
        raise SystemExit(f"seed {run['seed']} appears twice (in {out} and before)")
      rows = [json.loads(x) for x in (out / "work" / path.stem / "metrics.jsonl").open()]
      rows = [r for r in rows if r.get("phase") == "rl"]
      # Every step trains on prompts_per_step complete groups, synchronous or partial.
      per_step = _rollouts_per_step(run)
      rollouts, tokens, evals = 0, 0.0, []
      for r in rows:
        rollouts += per_step
        tokens += per_step * r["rl/response_length"]
        if "eval/accuracy" in r:
          evals.append((r["step"], rollouts, tokens, r["eval/accuracy"]))
      groups = [per_step / run_group_size(run) for _ in rows]
      secs = [r["time/rollout_s"] for r in rows]
      late = [i for i, r in enumerate(rows) if r["step"] >= steady]
      got[run["seed"]] = {
        "acc": run["summary"]["accuracy_after_rl"],
        "acc_sft": run["summary"]["accuracy_after_sft"],
        "groups_per_s": sum(groups) / sum(secs),
        "steady_groups_per_s": sum(groups[i] for i in late) / sum(secs[i] for i in late),
        "decode_steps": sum(r["rollout/decode_steps"] for r in rows),
        "rollout_s": sum(secs),
        "stale_token_frac": statistics.fmean(r.get("partial/stale_token_frac", 0.0) for r in rows),
        "evals": evals,
      }
  return got


def run_group_size(run: dict) -> int:
  from jaxrl.config import config_module

  return int(config_module(REPO / run["config"]).get_config().rl.group_size)


def _plot(cells: dict[str, dict], png: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name, runs in cells.items():
    for ax, col in zip(axes, (1, 2), strict=True):
      plot_accuracy(ax, name, runs, col)
  axes[0].set(xlabel="cumulative rollouts trained on", ylabel="held-out greedy accuracy")
  axes[1].set(xlabel="cumulative completion tokens trained on", ylabel="held-out greedy accuracy")
  axes[0].set_title("chain task: mean, range over seeds")
  for ax in axes:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--sync", required=True, help="comma-separated sweep directories")
  ap.add_argument("--partial", required=True, help="comma-separated sweep directories")
  ap.add_argument("--isa", default="native")
  ap.add_argument("--steady", type=int, default=11, help="first step of the steady-state rate")
  ap.add_argument("--png", default=None)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  cells = {
    name: runs_of([Path(p) for p in dirs.split(",")], args.isa, args.steady)
    for name, dirs in (("synchronous", args.sync), ("partial", args.partial))
  }
  seeds = sorted(set(cells["synchronous"]) & set(cells["partial"]))
  if not seeds:
    raise SystemExit("no seed finished in both cells")
  cells = {name: {s: runs[s] for s in seeds} for name, runs in cells.items()}
  sync, part = cells["synchronous"], cells["partial"]
  print(
    "| cell | seeds | accuracy after RL, mean (min–max) | − synchronous, paired [95% CI] | "
    "groups / s (all steps) | groups / s (steady) | decode steps | stale tokens |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for name, runs in cells.items():
    acc = [runs[s]["acc"] for s in seeds]
    m, lo, hi = paired([sync[s]["acc"] for s in seeds], acc)
    col = lambda k, d, runs=runs: span([runs[s][k] for s in seeds], d)  # noqa: E731
    print(
      f"| {name} | {','.join(map(str, seeds))} | {span(acc, 3)} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] "
      f"| {col('groups_per_s', 2)} | {col('steady_groups_per_s', 2)} | {col('decode_steps', 0)} "
      f"| {col('stale_token_frac', 3)} |"
    )
  print()
  for key, label in (("groups_per_s", "all steps"), ("steady_groups_per_s", "steady state")):
    ratio = [part[s][key] / sync[s][key] for s in seeds]
    print(f"- partial / synchronous groups per second, {label}: {span(ratio, 2)}")
  ratio = [part[s]["decode_steps"] / sync[s]["decode_steps"] for s in seeds]
  print(f"- partial / synchronous decode steps: {span(ratio, 2)}")
  if args.json:
    Path(args.json).write_text(json.dumps(cells, indent=1) + "\n")
  if args.png:
    _plot(cells, args.png)
    print(f"\nplot: {args.png}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
