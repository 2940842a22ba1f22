"""Prompt selection and rollout allocation against uniform GRPO (experiment 2 of the rollout-
efficiency work): GRESO's pre-rollout skipping and VIGOR's variance-greedy allocation, each on
the same fixed prompt pool (rl.prompt_pool) and the same warm-starts as a uniform run. Every
cell spends prompts_per_step * group_size rollouts a step, so cumulative rollouts are
steps * that; the question is how many it takes to reach a held-out accuracy.

Per cell: rollouts to the target (the first evaluation at or above it; a run that never gets
there counts as its whole budget, marked >=), the mean held-out accuracy over the run's
evaluations (the area under the curve), final accuracy, each paired by seed with the baseline
(mean and 95% t interval), and the share of groups that carried a gradient (rewards not all
tied). Writes a markdown table, a PNG (accuracy against cumulative rollouts, the paired
difference, the informative-group share) and the per-seed numbers as JSON.

  .venv/bin/python bench/selection_report.py --target=0.85 \
      --baseline=runs/sweep/pool512_uniform --sweep greso=runs/sweep/pool512_greso \
      --sweep vigor=runs/sweep/pool512_vigor --png=docs/selection_arith.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from staleness_report import paired, runs_of, span  # noqa: E402


def _cell(out: Path, isa: str, target: float) -> dict[int, dict]:
  """runs_of's per-seed numbers plus rollouts to `target`, the accuracy area and the share of
  informative groups (per step and mean)."""
  runs = runs_of(out, isa)
  for seed, run in runs.items():
    evals = run["evals"]  # (step, cumulative rollouts, tokens, accuracy)
    hit = next((e for e in evals if e[3] >= target), None)
    run["reached"] = hit is not None
    run["to_target"] = hit[1] if hit else evals[-1][1]
    run["auc"] = statistics.fmean(e[3] for e in evals)
    rows = [json.loads(x) for x in (out / "work" / f"{isa}_seed{seed}" / "metrics.jsonl").open()]
    rows = [r for r in rows if r.get("phase") == "rl"]
    run["informative_curve"] = [1.0 - r["rl/zero_adv_groups"] for r in rows]
    run["informative"] = statistics.fmean(run["informative_curve"])
    run["skipped"] = (
      statistics.fmean(
        r["prompts/skipped"] / r["prompts/drawn"] for r in rows if "prompts/drawn" in r
      )
      if any("prompts/drawn" in r for r in rows)
      else 0.0
    )
  return runs


def _plot(cells: dict[str, dict], target: float, png: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from launch.sweep_report import t_quantile

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  base = next(iter(cells.values()))
  for c, (name, runs) in enumerate(cells.items()):
    color, seeds = colors[c % len(colors)], sorted(runs)
    at = {s: {e[0]: e for e in runs[s]["evals"]} for s in seeds}
    steps = sorted(set.intersection(*(set(a) for a in at.values())))  # evaluated by every seed
    x = [at[seeds[0]][t][1] for t in steps]
    acc = np.array([[at[s][t][3] for t in steps] for s in seeds])
    axes[0].plot(x, acc.mean(0), marker=".", color=color, label=f"{name} (n={len(seeds)})")
    axes[0].fill_between(x, acc.min(0), acc.max(0), color=color, alpha=0.08)
    both = [s for s in seeds if s in base]
    if c > 0 and len(both) > 1:
      b = {s: {e[0]: e[3] for e in base[s]["evals"]} for s in both}
      steps = [t for t in steps if all(t in b[s] for s in both)]
      x = [at[seeds[0]][t][1] for t in steps]
      d = np.array([[at[s][t][3] - b[s][t] for t in steps] for s in both])
      half = t_quantile(0.975, len(both) - 1) * d.std(0, ddof=1) / np.sqrt(len(both))
      axes[1].plot(x, d.mean(0), marker=".", color=color, label=name)
      axes[1].fill_between(x, d.mean(0) - half, d.mean(0) + half, color=color, alpha=0.12)
    inf = np.array([runs[s]["informative_curve"] for s in seeds]).mean(0)
    smooth = np.convolve(inf, np.ones(10) / 10, mode="valid")
    axes[2].plot(runs[seeds[0]]["steps"][9:], smooth, color=color, label=name)
  axes[0].axhline(target, color="k", lw=0.8, ls=":")
  axes[0].set(
    xlabel="cumulative rollouts", ylabel="held-out greedy accuracy", title="accuracy: mean, range"
  )
  axes[0].legend(fontsize=7)
  axes[1].axhline(0.0, color="k", lw=0.8)
  axes[1].set(
    xlabel="cumulative rollouts",
    ylabel="accuracy − uniform (same seed)",
    title="paired difference: mean, 95% t-CI",
  )
  axes[2].set(
    xlabel="RL step",
    ylabel="groups whose rewards differ",
    title="informative-group share (seed mean, 10-step avg)",
  )
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--baseline", required=True, help="the uniform GRPO sweep on the same pool")
  ap.add_argument("--baseline-name", default="uniform (baseline)", help="its label")
  ap.add_argument("--sweep", action="append", default=[], metavar="NAME=OUT")
  ap.add_argument("--target", type=float, required=True, help="held-out accuracy to reach")
  ap.add_argument("--isa", default="native")
  ap.add_argument("--png", default=None)
  ap.add_argument("--json", default=None, help="write the per-seed numbers here")
  args = ap.parse_args(argv)
  base = _cell(Path(args.baseline), args.isa, args.target)
  cells = {args.baseline_name: base}
  for item in args.sweep:
    name, out = item.split("=", 1)
    cells[name] = _cell(Path(out), args.isa, args.target)
  print(
    f"| cell | seeds | rollouts to {args.target:g}, mean (min–max) | reached | − baseline, "
    "paired [95% CI] | mean accuracy over evals | − baseline | final accuracy | − baseline "
    "| informative groups | prompts skipped |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for name, runs in list(cells.items()):
    seeds = sorted(set(runs) & set(base))
    if not seeds:
      del cells[name]
      continue
    row = [name, ",".join(map(str, seeds))]
    to = [runs[s]["to_target"] for s in seeds]
    reached = sum(runs[s]["reached"] for s in seeds)
    pre = "" if reached == len(seeds) else "≥ "
    row += [pre + span(to, 0), f"{reached}/{len(seeds)}"]
    m, lo, hi = paired([base[s]["to_target"] for s in seeds], to)
    row.append(f"{m:+.0f} [{lo:+.0f}, {hi:+.0f}]")
    for key in ("auc", "acc"):
      vals = [runs[s][key] for s in seeds]
      m, lo, hi = paired([base[s][key] for s in seeds], vals)
      row += [span(vals, 3), f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"]
    row += [span([runs[s]["informative"] for s in seeds], 3)]
    row += [span([runs[s]["skipped"] for s in seeds], 3)]
    print("| " + " | ".join(row) + " |")
  if args.json:
    keep = ("acc", "auc", "to_target", "reached", "informative", "skipped", "evals")
    raw = {
      name: {str(s): {k: runs[s][k] for k in keep} for s in sorted(runs)}
      for name, runs in cells.items()
    }
    Path(args.json).write_text(json.dumps({"target": args.target, "cells": raw}, indent=1) + "\n")
  if args.png:
    _plot(cells, args.target, args.png)
    print(f"\nplot: {args.png}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
