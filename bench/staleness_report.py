"""Training under injected staleness (rl.placement.max_staleness = k, colocated) on the default
job: held-out accuracy after RL and the clipped-token fraction, per off-policy method and k,
paired by seed against the synchronous baseline (k = 0, PPO-clip). Reads sweeps made with
`python -m launch.sweep run ... --sft-from=<the baseline sweep>` (the same warm-starts), writes a
markdown table to stdout and a PNG.

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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launch.sweep_report import t_quantile  # noqa: E402


def _runs(out: Path, isa: str) -> dict[int, dict]:
  """seed -> (run JSON, mean rl/clip_frac over its RL steps, its metric rows) of `isa`'s runs."""
  got = {}
  for path in sorted((out / "runs").glob(f"{isa}_seed*.json")):
    run = json.loads(path.read_text())
    if not run.get("ok"):
      continue
    rows = []
    metrics = out / "work" / path.stem / "metrics.jsonl"
    for line in metrics.read_text().splitlines():
      r = json.loads(line)
      if r.get("phase") == "rl":
        rows.append(r)
    clip = statistics.fmean(r["rl/clip_frac"] for r in rows) if rows else float("nan")
    got[run["seed"]] = {"acc": run["summary"]["accuracy_after_rl"], "clip": clip, "rows": rows}
  return got


def _paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
  """Mean of b - a and its 95% t interval."""
  d = [y - x for x, y in zip(a, b, strict=True)]
  m = statistics.fmean(d)
  if len(d) < 2:
    return m, float("nan"), float("nan")
  half = t_quantile(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
  return m, m - half, m + half


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--baseline", required=True, help="the k = 0, PPO-clip sweep")
  ap.add_argument("--sweep", action="append", default=[], metavar="NAME=OUT")
  ap.add_argument("--isa", default="native")
  ap.add_argument("--png", default=None)
  args = ap.parse_args(argv)
  base = _runs(Path(args.baseline), args.isa)
  cells = {"k0_ppo (baseline)": base}
  for item in args.sweep:
    name, out = item.split("=", 1)
    cells[name] = _runs(Path(out), args.isa)
  print(
    "| cell | seeds | accuracy after RL, mean (min–max) | − baseline, paired mean [95% CI] | "
    "clipped tokens, mean (min–max) |"
  )
  print("|---|---|---|---|---|")
  for name, runs in cells.items():
    seeds = sorted(set(runs) & set(base))
    acc = [runs[s]["acc"] for s in seeds]
    clip = [runs[s]["clip"] for s in seeds]
    if not seeds:
      continue
    m, lo, hi = _paired([base[s]["acc"] for s in seeds], acc)
    print(
      f"| {name} | {','.join(map(str, seeds))} | {statistics.fmean(acc):.3f} "
      f"({min(acc):.3f}–{max(acc):.3f}) | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
      f"{statistics.fmean(clip):.4f} ({min(clip):.4f}–{max(clip):.4f}) |"
    )
  if args.png:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, (name, runs) in enumerate(cells.items()):
      color = colors[c % len(colors)]
      for i, s in enumerate(sorted(runs)):
        rows = runs[s]["rows"]
        evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        kw = {"label": name, "color": color} if i == 0 else {"color": color}
        if evals:
          axes[0].plot(*zip(*evals, strict=True), alpha=0.6, marker=".", **kw)
        axes[1].plot([r["step"] for r in rows], [r["rl/clip_frac"] for r in rows], alpha=0.3, **kw)
    axes[0].set(xlabel="RL step", ylabel="held-out greedy accuracy", title="accuracy (per seed)")
    axes[1].set(xlabel="RL step", ylabel="clipped-token fraction", title="PPO clipping")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"\nplot: {args.png}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
