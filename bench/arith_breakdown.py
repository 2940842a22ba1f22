"""What GRPO changes on arithmetic, problem by problem: a seeds sweep's held-out breakdown.

Reads the `eval/*` breakdown that `ArithmeticTask.eval_breakdown` adds to every evaluation of a
`launch.sweep` run (accuracy on problems that need a carry or borrow, on those that do not, and
the share of carry problems answered exactly as the careless teacher writes them), and reports
it after the SFT warm-start and after RL, over seeds, per ISA variant, with a plot of the three
curves (mean over seeds, min-max band) against the RL step.

  .venv/bin/python bench/arith_breakdown.py runs/sweep/careless \\
      --out bench/results/grpo_arith_breakdown.json --plot docs/grpo_arith_breakdown.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

METRICS = {
  "eval/accuracy": "all problems",
  "eval/carry_accuracy": "problems with a carry/borrow",
  "eval/no_carry_accuracy": "problems without",
  "eval/careless_answers": "carry problems answered carelessly",
}


def load(sweep: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """{run name: {metric: [(rl step, value)]}}: step 0 is the evaluation after SFT."""
  runs = {}
  for metrics in sorted((sweep / "work").glob("*/metrics.jsonl")):
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    curves: dict[str, list[tuple[int, float]]] = {m: [] for m in METRICS}
    for r in rows:
      step = 0 if r.get("phase") == "sft" else r.get("step")
      if r.get("phase") not in ("sft", "rl") or "eval/accuracy" not in r:
        continue
      for m in METRICS:
        if m in r:
          curves[m].append((int(step), float(r[m])))
    if not curves["eval/careless_answers"]:
      raise SystemExit(f"{metrics}: no eval/careless_answers; was it run with this jaxrl?")
    runs[metrics.parent.name] = {m: sorted(dict(c).items()) for m, c in curves.items()}
  if not runs:
    raise SystemExit(f"no runs under {sweep / 'work'}")
  return runs


def _isa(run: str) -> str:
  return run.split("_seed")[0]


def describe(values: list[float]) -> dict:
  return {
    "n": len(values),
    "mean": statistics.fmean(values),
    "min": min(values),
    "max": max(values),
  }


def report(runs: dict) -> dict:
  out = {}
  for isa in sorted({_isa(r) for r in runs}):
    mine = {r: c for r, c in runs.items() if _isa(r) == isa}
    out[isa] = {
      m: {
        "after_sft": describe([c[m][0][1] for c in mine.values()]),
        "after_rl": describe([c[m][-1][1] for c in mine.values()]),
      }
      for m in METRICS
    }
  return out


def plot(runs: dict, path: Path) -> None:
  fig = Figure(figsize=(11.0, 3.6), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, 3, sharex=True)
  panels = [
    ("eval/accuracy", "held-out accuracy (greedy)"),
    ("eval/carry_accuracy", "accuracy on carry/borrow problems"),
    ("eval/careless_answers", "carry problems answered carelessly"),
  ]
  for ax, (metric, title) in zip(axes, panels, strict=True):
    for isa in sorted({_isa(r) for r in runs}):
      curves = [c[metric] for r, c in runs.items() if _isa(r) == isa]
      steps = sorted(set.intersection(*[{s for s, _ in c} for c in curves]))
      ys = np.array([[dict(c)[s] for s in steps] for c in curves])
      (line,) = ax.plot(steps, ys.mean(0), label=f"{isa} (mean of {len(curves)}, band min-max)")
      ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2, lw=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step (0 = after the SFT warm-start)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8, loc="lower right")
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, format="png", dpi=100)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("sweep", type=Path, help="a launch.sweep --out directory")
  ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
  ap.add_argument("--plot", type=Path, default=None, help="write the curves as PNG here")
  args = ap.parse_args(argv)
  runs = load(args.sweep)
  table = report(runs)
  print("| ISA | metric | after SFT | after RL |\n|---|---|---|---|")
  for isa, rows in table.items():
    for m, d in rows.items():
      a, b = d["after_sft"], d["after_rl"]
      print(
        f"| {isa} | {METRICS[m]} | {a['mean']:.3f} ({a['min']:.3f} – {a['max']:.3f}) | "
        f"{b['mean']:.3f} ({b['min']:.3f} – {b['max']:.3f}) |"
      )
  result = {"sweep": str(args.sweep), "runs": sorted(runs), "table": table}
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
  if args.plot:
    plot(runs, args.plot)
  return result


if __name__ == "__main__":
  main()
