"""Seed-sweep results: run records, Student-t statistics, summary tables, plots, paired diffs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

METRICS = (
  "accuracy_init",
  "accuracy_after_sft",
  "accuracy_after_rl",
  "rl_gain",
  "sampled_accuracy_after_sft",
  "sampled_accuracy_after_rl",
  "sampled_rl_gain",
  "wall_s",
)
# after_rl - after_sft, of greedy and of sampled (eval.num_samples > 0) held-out accuracy.
GAINS = {"rl_gain": "accuracy", "sampled_rl_gain": "sampled_accuracy"}
# Accuracies are multiples of 1/num_examples, but a gain is a difference of two floats.
TIE_TOL = 1e-9


class SweepError(ValueError):
  """A bad argument, run record or OUT directory; the message says what is wrong and allowed."""


# ------------------------------------------------------------------------------------ statistics


def _betacf(a: float, b: float, x: float) -> float:
  """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
  tiny = 1e-300
  c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
  d = 1.0 / (d if abs(d) > tiny else tiny)
  h = d
  for m in range(1, 1000):
    for num in (
      m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
      -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
    ):
      d = 1.0 + num * d
      d = 1.0 / (d if abs(d) > tiny else tiny)
      c = 1.0 + num / c
      c = c if abs(c) > tiny else tiny
      h *= d * c
    if abs(d * c - 1.0) < 1e-15:
      break
  return h


def betainc(a: float, b: float, x: float) -> float:
  """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
  if x <= 0.0:
    return 0.0
  if x >= 1.0:
    return 1.0
  log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
  log_front += a * math.log(x) + b * math.log1p(-x)
  # The continued fraction converges fast only on this side of the mean; use symmetry otherwise.
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(log_front) * _betacf(a, b, x) / a
  return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with `df` degrees of freedom."""
  tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
  return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
  """The `p` quantile of Student's t with `df` degrees of freedom (bisection on t_cdf)."""
  if not 0.0 < p < 1.0:
    raise ValueError(f"p={p} must be in (0, 1)")
  if not df > 0:
    raise ValueError(f"df={df} must be > 0")
  if p < 0.5:
    return -t_quantile(1.0 - p, df)
  lo, hi = 0.0, 1.0
  while t_cdf(hi, df) < p:
    lo, hi = hi, 2.0 * hi
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if t_cdf(mid, df) < p:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-12 * hi:
      break
  return 0.5 * (lo + hi)


def describe(values) -> dict:
  """n, mean, min, max, sample std (ddof=1) and the 95% Student-t CI of the mean.

  Undefined statistics are None: everything for n = 0, std and CI for n = 1.
  """
  xs = [float(v) for v in values]
  n = len(xs)
  out = {"n": n, "mean": None, "min": None, "max": None, "std": None, "ci95": None}
  if n == 0:
    return out
  mean = math.fsum(xs) / n
  out.update(mean=mean, min=min(xs), max=max(xs))
  if n >= 2:
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.975, n - 1) * std / math.sqrt(n)
    out.update(std=std, ci95=[mean - half, mean + half])
  return out


# ---------------------------------------------------------------------------------- run records


def run_name(isa: str, seed: int) -> str:
  return f"{isa}_seed{seed}"


def ident_of(run_or_manifest: dict) -> dict:
  """What every run of one sweep shares: config file, its variant and the overrides."""
  return {k: run_or_manifest.get(k) for k in ("config", "variant", "overrides")}


def eval_curve(records: list[dict]) -> tuple[list[list[float]], int | None]:
  """([global_step, eval/accuracy] sorted by step, the last SFT global step) of metrics records."""
  curve, sft_end = [], None
  for r in records:
    x = r.get("global_step", r.get("step"))
    if r.get("phase") == "sft" and x is not None:
      sft_end = x if sft_end is None else max(sft_end, x)
    if "eval/accuracy" in r and x is not None:
      curve.append([x, float(r["eval/accuracy"])])
  return sorted(curve), sft_end


def make_record(
  *,
  ident: dict,
  seed: int,
  isa: str,
  xla_flags: str,
  returncode: int,
  wall_s: float,
  summary: dict | None,
  metrics: list[dict],
  log_tail: list[str] | None = None,
) -> dict:
  """The JSON written for one finished run: identity, outcome, summary.json and the eval curve."""
  curve, sft_end = eval_curve(metrics)
  summary = summary or {}
  ok = returncode == 0 and "accuracy_after_rl" in summary
  gains = {}
  for name, acc in GAINS.items():
    after, before = summary.get(f"{acc}_after_rl"), summary.get(f"{acc}_after_sft")
    gains[name] = None if after is None or before is None else after - before
  record = {
    **ident,
    "seed": seed,
    "isa": isa,
    "xla_flags": xla_flags,
    "returncode": returncode,
    "ok": ok,
    "wall_s": wall_s,
    "summary": summary,
    **gains,
    "eval_curve": curve,
    "sft_end_step": sft_end,
  }
  if not ok:
    record["log_tail"] = log_tail or []
  return record


def metric_value(run: dict, metric: str) -> float | None:
  """A run's value of one of METRICS, or None if the run failed or lacks it."""
  if not run.get("ok"):
    return None
  v = run.get(metric) if metric in GAINS else run.get("summary", {}).get(metric)
  return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _isa_order(isa: str) -> tuple[bool, str]:
  return (isa != "native", isa)  # the baseline first


def run_order(run: dict) -> tuple:
  return (*_isa_order(run["isa"]), run["seed"])


def load_runs(out: str | os.PathLike) -> list[dict]:
  """The run JSONs under OUT/runs, ordered by (isa, seed)."""
  runs_dir = Path(out) / "runs"
  paths = sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else []
  if not paths:
    raise SweepError(f"{str(out)!r} holds no runs ({runs_dir}/*.json); is it a sweep's --out?")
  runs = []
  for path in paths:
    try:
      run = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise SweepError(f"{path}: not valid JSON: {e}") from e
    missing = [k for k in ("isa", "seed", "returncode", "summary") if k not in run]
    if missing:
      raise SweepError(f"{path}: not a sweep run record, it lacks {missing}")
    runs.append(run)
  return sorted(runs, key=run_order)


def summarize_runs(runs: list[dict]) -> dict:
  """Per-ISA and pooled ("all") statistics of METRICS over the successful runs."""
  idents = {json.dumps(ident_of(r), sort_keys=True) for r in runs}
  if len(idents) > 1:
    raise SweepError(f"the runs do not share one config and overrides: {sorted(idents)}")
  runs = sorted(runs, key=run_order)
  ok = [r for r in runs if r.get("ok")]
  isas = sorted({r["isa"] for r in runs}, key=_isa_order)
  groups = {}
  for group in [*isas, "all"]:
    members = [r for r in ok if group in ("all", r["isa"])]
    stats = {}
    for metric in METRICS:
      pairs = [(r, metric_value(r, metric)) for r in members]
      pairs = [(r, v) for r, v in pairs if v is not None]
      stats[metric] = {
        **describe([v for _, v in pairs]),
        "runs": [run_name(r["isa"], r["seed"]) for r, _ in pairs],
        "values": [v for _, v in pairs],
      }
    groups[group] = {
      "runs": [run_name(r["isa"], r["seed"]) for r in members],
      "seeds": [r["seed"] for r in members],
      "metrics": stats,
    }
  return {
    **ident_of(runs[0]),
    "n_runs": len(runs),
    "failed": [run_name(r["isa"], r["seed"]) for r in runs if not r.get("ok")],
    "groups": groups,
  }


def fmt(metric: str, v: float | None, *, spread: bool = False) -> str:
  """A table cell; a gain carries its sign unless it is a spread (a std)."""
  if v is None:
    return "n/a"
  if metric == "wall_s":
    return f"{v:.1f}"
  return f"{v:+.3f}" if metric in GAINS and not spread else f"{v:.3f}"


def _config_label(ident: dict) -> str:
  return ident["config"] + (f":{ident['variant']}" if ident.get("variant") else "")


def summary_markdown(summary: dict, runs: list[dict]) -> str:
  """The statistics table, then one row per run."""
  lines = [f"# Sweep of {_config_label(summary)}", ""]
  if summary.get("overrides"):
    lines += ["Overrides: " + " ".join(f"`{o}`" for o in summary["overrides"]), ""]
  lines += [
    "| group | metric | n | mean | std | min | max | 95% CI |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for group, g in summary["groups"].items():
    for metric, s in g["metrics"].items():
      ci = "n/a" if s["ci95"] is None else f"[{fmt(metric, s['ci95'][0])}, "
      ci += "" if s["ci95"] is None else f"{fmt(metric, s['ci95'][1])}]"
      cells = [fmt(metric, s[k], spread=k == "std") for k in ("mean", "std", "min", "max")]
      lines.append(f"| {group} | {metric} | {s['n']} | " + " | ".join(cells) + f" | {ci} |")
  lines += ["", "| run | rc | " + " | ".join(METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
  for r in sorted(runs, key=run_order):
    cells = [fmt(m, metric_value(r, m)) for m in METRICS]
    name = run_name(r["isa"], r["seed"]) + ("" if r.get("ok") else " (failed)")
    lines.append(f"| {name} | {r['returncode']} | " + " | ".join(cells) + " |")
  if summary["failed"]:
    lines += ["", "Failed: " + ", ".join(summary["failed"])]
  return "\n".join(lines) + "\n"


def _curve_points(run: dict) -> list[tuple[float, float]]:
  """The run's eval curve, led by its accuracy at init (step 0: the SFT phase logs one point)."""
  pts = [(float(x), float(y)) for x, y in run.get("eval_curve") or []]
  init = run.get("summary", {}).get("accuracy_init")
  if isinstance(init, int | float) and not any(x == 0 for x, _ in pts):
    pts.insert(0, (0.0, float(init)))
  return pts


def plot_sweep(runs: list[dict], out_png: str | os.PathLike) -> Path:
  """Held-out accuracy vs global step: per ISA the mean over seeds and a min-max band."""
  out_png = Path(out_png)
  ok = [r for r in sorted(runs, key=run_order) if r.get("ok")]
  fig = Figure(figsize=(7.0, 4.0), layout="constrained")
  FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch, safe off the main thread.
  ax = fig.subplots()
  drawn = False
  for isa in sorted({r["isa"] for r in ok}, key=_isa_order):
    curves = [c for c in (_curve_points(r) for r in ok if r["isa"] == isa) if c]
    if not curves:
      continue
    # Seeds of one config evaluate at the same steps; if not, align them by interpolating onto
    # the steps that lie inside every curve's range.
    lo = max(c[0][0] for c in curves)
    hi = min(c[-1][0] for c in curves)
    grid = np.array(sorted({x for c in curves for x, _ in c if lo <= x <= hi}))
    ys = np.stack([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves])
    (line,) = ax.plot(
      grid,
      ys.mean(0),
      marker="o" if len(grid) <= 50 else None,
      markersize=3,
      label=f"{isa} (mean of {len(curves)}; band min-max)",
    )
    ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2, linewidth=0)
    drawn = True
  for x in sorted({r["sft_end_step"] for r in ok if r.get("sft_end_step") is not None}):
    ax.axvline(x, color="gray", linestyle="--", linewidth=1)
    ax.text(x, 1.0, " sft→rl", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
  if drawn:
    ax.legend(fontsize=8, loc="best")
  else:
    ax.text(0.5, 0.5, "no successful runs", transform=ax.transAxes, ha="center", va="center")
  label = _config_label(ident_of(runs[0])) if runs else "?"
  ax.set_title(f"{label}: held-out accuracy, {len({r['seed'] for r in ok})} seeds", fontsize=10)
  ax.set_xlabel("global step")
  ax.set_ylabel("held-out accuracy (greedy)")
  ax.grid(alpha=0.3)
  out_png.parent.mkdir(parents=True, exist_ok=True)
  # Render to a temporary name and rename, so a viewer never sees a half-written PNG.
  tmp = out_png.with_name(out_png.name + ".tmp")
  fig.savefig(tmp, format="png", dpi=100)
  os.replace(tmp, out_png)
  return out_png


def write_json(path: Path, obj) -> None:
  """Writes through a temporary file and a rename, so a reader never sees half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=2) + "\n")
  os.replace(tmp, path)


def summarize(out: str | os.PathLike) -> str:
  """Writes OUT/summary.json, summary.md and accuracy.png; returns the markdown."""
  out = Path(out)
  runs = load_runs(out)
  summary = summarize_runs(runs)
  md = summary_markdown(summary, runs)
  write_json(out / "summary.json", summary)
  tmp = out / "summary.md.tmp"
  tmp.write_text(md)
  os.replace(tmp, out / "summary.md")
  plot_sweep(runs, out / "accuracy.png")
  return md


# ---------------------------------------------------------------------------------- comparison


def compare_runs(runs_a: list[dict], runs_b: list[dict], metric: str = "accuracy_after_rl") -> dict:
  """B - A of `metric` over the (isa, seed) pairs that succeeded in both sweeps."""
  if metric not in METRICS:
    raise SweepError(f"--metric={metric!r} is unknown; allowed: {', '.join(METRICS)}")
  a = {(r["isa"], r["seed"]): metric_value(r, metric) for r in runs_a}
  b = {(r["isa"], r["seed"]): metric_value(r, metric) for r in runs_b}
  a = {k: v for k, v in a.items() if v is not None}
  b = {k: v for k, v in b.items() if v is not None}
  keys = sorted(a.keys() & b.keys(), key=lambda k: (*_isa_order(k[0]), k[1]))
  if not keys:
    raise SweepError(
      f"no (isa, seed) pair has {metric} in both sweeps: A has {[run_name(*k) for k in a]}, "
      f"B has {[run_name(*k) for k in b]}"
    )
  pairs = [
    {"isa": i, "seed": s, "a": a[i, s], "b": b[i, s], "diff": b[i, s] - a[i, s]} for i, s in keys
  ]
  diffs = [p["diff"] for p in pairs]
  stats = describe(diffs)
  return {
    "metric": metric,
    "pairs": pairs,
    "n": stats["n"],
    "mean_diff": stats["mean"],
    "min": stats["min"],
    "max": stats["max"],
    "std": stats["std"],
    "ci95": stats["ci95"],
    "wins": sum(d > TIE_TOL for d in diffs),
    "ties": sum(abs(d) <= TIE_TOL for d in diffs),
    "losses": sum(d < -TIE_TOL for d in diffs),
    "unpaired_a": [run_name(*k) for k in sorted(a.keys() - b.keys())],
    "unpaired_b": [run_name(*k) for k in sorted(b.keys() - a.keys())],
  }


def compare(out_a, out_b, *, metric: str = "accuracy_after_rl", json_path=None) -> str:
  """Pairs two sweeps' runs, writes the comparison JSON and returns a markdown report."""
  runs_a, runs_b = load_runs(out_a), load_runs(out_b)
  result = compare_runs(runs_a, runs_b, metric)
  result["a"] = {"out": str(out_a), **ident_of(runs_a[0])}
  result["b"] = {"out": str(out_b), **ident_of(runs_b[0])}
  path = (
    Path(json_path) if json_path else Path(out_b) / f"compare_{Path(out_a).resolve().name}.json"
  )
  write_json(path, result)
  lines = [
    f"# {metric}: B - A (A = {out_a}, B = {out_b})",
    "",
    "| isa | seed | A | B | B - A |",
    "|---|---|---|---|---|",
  ]
  for p in result["pairs"]:
    lines.append(
      f"| {p['isa']} | {p['seed']} | {fmt(metric, p['a'])} | {fmt(metric, p['b'])} | "
      f"{p['diff']:+.4f} |"
    )
  ci = result["ci95"]
  ci_text = "n/a (one pair)" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"
  lines += [
    "",
    f"n={result['n']} mean diff {result['mean_diff']:+.4f} (min {result['min']:+.4f}, "
    f"max {result['max']:+.4f}), 95% CI {ci_text}; B wins/ties/losses "
    f"{result['wins']}/{result['ties']}/{result['losses']}",
  ]
  if result["unpaired_a"] or result["unpaired_b"]:
    lines.append(f"unpaired: A {result['unpaired_a']}, B {result['unpaired_b']}")
  lines.append(f"written: {path}")
  return "\n".join(lines) + "\n"
