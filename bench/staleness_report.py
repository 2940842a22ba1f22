"""Training under injected staleness (rl.placement.max_staleness = k, colocated) on the default
job: held-out accuracy after RL, the PPO-clipped, masked and IS-truncated (or SAT-contracted)
token fractions, per off-policy method and k, paired by seed against the synchronous baseline
(k = 0, PPO-clip). Reads sweeps made with `python -m launch.sweep run ... --sft-from=<the
baseline sweep>` (the same warm-starts), writes a markdown table to stdout, a PNG whose x-axes
are cumulative rollouts and cumulative generated tokens, and the per-seed numbers as JSON.

  .venv/bin/python bench/staleness_report.py --baseline=runs/sweep/careless2d \
      --sweep k32_ppo=runs/sweep/stale_k32_ppo --sweep k32_m2po=runs/sweep/stale_k32_m2po \
      --png=docs/staleness_arith.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxrl.config import config_module  # noqa: E402
from launch.sweep_report import t_quantile  # noqa: E402


def _rollouts_per_step(run: dict) -> int:
  """prompts_per_step * group_size of the run's config; overrides of either are refused (the
  x-axis would be wrong)."""
  for o in run.get("overrides", []):
    if o.split("=", 1)[0] in ("rl.prompts_per_step", "rl.group_size"):
      raise SystemExit(f"{o}: runs that change the rollouts per step are not supported here")
  cfg = config_module(REPO / run["config"]).get_config()
  return int(cfg.rl.prompts_per_step) * int(cfg.rl.group_size)


def runs_of(out: Path, isa: str) -> dict[int, dict]:
  """seed -> the run's final accuracy, mean clipped / masked fractions over its RL steps, and its
  per-step curves (cumulative rollouts and generated tokens, eval accuracy, clipped fraction)."""
  got = {}
  for path in sorted((out / "runs").glob(f"{isa}_seed*.json")):
    run = json.loads(path.read_text())
    if not run.get("ok"):
      continue
    per_step = _rollouts_per_step(run)
    metrics = out / "work" / path.stem / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rows = [r for r in rows if r.get("phase") == "rl"]
    rollouts, tokens, evals = 0, 0.0, []
    for r in rows:
      rollouts += per_step
      tokens += per_step * r["rl/response_length"]
      if "eval/accuracy" in r:
        evals.append((r["step"], rollouts, tokens, r["eval/accuracy"]))
    got[run["seed"]] = {
      "acc": run["summary"]["accuracy_after_rl"],
      "clip": statistics.fmean(r["rl/clip_frac"] for r in rows),
      "masked": statistics.fmean(r.get("offpolicy/masked_frac", 0.0) for r in rows),
      "corrected": statistics.fmean(r.get("offpolicy/clipped_frac", 0.0) for r in rows),
      "steps": [r["step"] for r in rows],
      "clip_curve": [r["rl/clip_frac"] for r in rows],
      "evals": evals,
    }
  return got


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
  """Mean of b - a and its 95% t interval."""
  d = [y - x for x, y in zip(a, b, strict=True)]
  m = statistics.fmean(d)
  if len(d) < 2:
    return m, float("nan"), float("nan")
  half = t_quantile(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
  return m, m - half, m + half


def span(xs: list[float], digits: int) -> str:
  return f"{statistics.fmean(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def plot_accuracy(ax, name: str, runs: dict[int, dict], col: int = 1, **style):
  """Held-out accuracy of one cell on `ax`: the seeds' mean and a band over their range, at the
  eval points every seed has, against column `col` of the evals (1: cumulative rollouts, 2:
  cumulative tokens). Returns the line's colour, or None when the seeds share no eval point."""
  seeds = sorted(runs)
  at = {s: {e[0]: e for e in runs[s]["evals"]} for s in seeds}
  steps = sorted(set.intersection(*(set(at[s]) for s in seeds)))
  if not steps:
    return None
  acc = np.array([[at[s][t][3] for s in seeds] for t in steps])
  x = [statistics.fmean(at[s][t][col] for s in seeds) for t in steps]
  (line,) = ax.plot(x, acc.mean(1), marker=".", label=f"{name} (n={len(seeds)})", **style)
  ax.fill_between(x, acc.min(1), acc.max(1), color=line.get_color(), alpha=0.1)
  return line.get_color()


def _plot(cells: dict[str, dict], png: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  if len(cells) > len(colors):  # past the default cycle's 10 colors, one per cell
    colors = [plt.get_cmap("tab20")(i % 20) for i in range(len(cells))]
  base = next(iter(cells.values()))
  for c, (name, runs) in enumerate(cells.items()):
    color = colors[c % len(colors)]
    seeds = sorted(runs)
    at = {s: {e[0]: e for e in runs[s]["evals"]} for s in seeds}
    # Eval points every seed of the cell has (the baseline evaluated more often).
    steps = sorted(set.intersection(*(set(at[s]) for s in seeds)))
    plot_accuracy(axes[0], name, runs, 1, color=color)
    if c > 0:  # the paired difference to the baseline, same seed and step
      b = {s: {e[0]: e[3] for e in base[s]["evals"]} for s in seeds if s in base}
      steps = [t for t in steps if all(t in b[s] for s in b)]
      if steps and len(b) > 1:
        diff = [[at[s][t][3] - b[s][t] for s in b] for t in steps]
        mid = [statistics.fmean(d) for d in diff]
        half = [
          t_quantile(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)) for d in diff
        ]
        x = [statistics.fmean(at[s][t][2] for s in b) for t in steps]
        axes[1].plot(x, mid, marker=".", color=color, label=name)
        axes[1].fill_between(x, np.subtract(mid, half), np.add(mid, half), color=color, alpha=0.12)
    clip = np.array([runs[s]["clip_curve"] for s in seeds]).mean(0)
    smooth = np.convolve(clip, np.ones(10) / 10, mode="valid")
    axes[2].plot(runs[seeds[0]]["steps"][9:], smooth, color=color, label=name)
  axes[0].set(
    xlabel="cumulative rollouts", ylabel="held-out greedy accuracy", title="accuracy: mean, range"
  )
  axes[1].axhline(0.0, color="k", lw=0.8)
  axes[1].set(
    xlabel="cumulative generated tokens",
    ylabel="accuracy − baseline (same seed)",
    title="paired difference: mean, 95% t-CI",
  )
  axes[2].set(
    xlabel="RL step", ylabel="PPO-clipped token fraction", title="clipping (seed mean, 10-step avg)"
  )
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--baseline", required=True, help="the k = 0, PPO-clip sweep")
  ap.add_argument("--baseline-name", default="k0_ppo (baseline)", help="its label")
  ap.add_argument("--sweep", action="append", default=[], metavar="NAME=OUT")
  ap.add_argument("--isa", default="native")
  ap.add_argument("--png", default=None)
  ap.add_argument("--json", default=None, help="write the per-seed numbers here")
  args = ap.parse_args(argv)
  base = runs_of(Path(args.baseline), args.isa)
  cells = {args.baseline_name: base}
  for item in args.sweep:
    name, out = item.split("=", 1)
    cells[name] = runs_of(Path(out), args.isa)
  print(
    "| cell | seeds | accuracy after RL, mean (min–max) | − baseline, paired mean [95% CI] | "
    "PPO-clipped tokens | masked tokens | IS-truncated or SAT-contracted tokens |"
  )
  print("|---|---|---|---|---|---|---|")
  for name, runs in list(cells.items()):
    seeds = sorted(set(runs) & set(base))
    if not seeds:
      del cells[name]
      continue
    acc = [runs[s]["acc"] for s in seeds]
    m, lo, hi = paired([base[s]["acc"] for s in seeds], acc)
    print(
      f"| {name} | {','.join(map(str, seeds))} | {span(acc, 3)} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] "
      f"| {span([runs[s]['clip'] for s in seeds], 4)} "
      f"| {span([runs[s]['masked'] for s in seeds], 4)} "
      f"| {span([runs[s]['corrected'] for s in seeds], 4)} |"
    )
  if args.json:
    keep = ("acc", "clip", "masked", "corrected", "evals")
    raw = {
      name: {str(s): {k: runs[s][k] for k in keep} for s in sorted(runs)}
      for name, runs in cells.items()
    }
    Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
  if args.png:
    _plot(cells, args.png)
    print(f"\nplot: {args.png}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
