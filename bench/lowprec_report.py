"""Low-precision rollouts on the default job: held-out accuracy after RL paired by seed against
the float32 baseline, and the sampler-learner mismatch over training (mismatch/abs_logp_mean,
mismatch/kl_k3, the activations rounded to zero, the TIS-truncated token fraction). Reads sweeps
made with `python -m launch.sweep run ... --sft-from=<the baseline sweep>` (same warm-starts),
writes a markdown table to stdout, a PNG (accuracy over cumulative rollouts; KL(sampler ||
learner) over RL steps) and the per-seed numbers as JSON. `--stored NAME=JSON` adds a cell from
an earlier report's JSON (its sweep's directory gone; paired by seed with the baseline as the
others are, so the baseline must be the same runs). Sweeps of an MoE policy that record
the sampler's experts (rl.rollout.routes) add the learner's routing agreement with the sampler
(moe/route_agree, all layers and per layer) as columns and a third panel.

  .venv/bin/python bench/lowprec_report.py --baseline=runs/sweep/careless2d \
      --sweep fp8=runs/sweep/fp8_block_kv --sweep fp8_tis=runs/sweep/fp8_block_kv_tis \
      --png=docs/lowprec_arith.png --json=bench/results/lowprec_arith.json
  .venv/bin/python bench/lowprec_report.py --baseline=runs/sweep/careless2d --isa=avx2 \
      --sweep "fp8+TIS+fake-quant learner=runs/sweep/fp8_amd_tis_fq" \
      --stored "fp8+TIS=bench/results/lowprec_arith_amd_avx2path.json" \
      --contrast "fp8+TIS+fake-quant learner,fp8+TIS"
  .venv/bin/python bench/lowprec_report.py --baseline=runs/sweep/moe_record \
      --baseline-name="routes recorded" --sweep "R3 replay=runs/sweep/moe_replay" \
      --png=docs/moe_r3_arith.png --json=bench/results/moe_r3_arith.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from staleness_report import paired, plot_accuracy, runs_of, span  # noqa: E402

MISMATCH = ("mismatch/abs_logp_mean", "mismatch/kl_k3", "mismatch/act_underflow_frac")


def mismatch_of(out: Path, isa: str) -> dict[int, dict]:
  """seed -> per-step mismatch curves and means over the RL steps (0 where not logged: float)."""
  got = {}
  for path in sorted((out / "runs").glob(f"{isa}_seed*.json")):
    run = json.loads(path.read_text())
    if not run.get("ok"):
      continue
    rows = [json.loads(x) for x in (out / "work" / path.stem / "metrics.jsonl").open()]
    rows = [r for r in rows if r.get("phase") == "rl"]
    curves = {k: [r.get(k, 0.0) for r in rows] for k in MISMATCH}
    curves["truncated"] = [r.get("offpolicy/clipped_frac", 0.0) for r in rows]
    for k in sorted({k for r in rows for k in r if k.startswith("moe/route_agree")}):
      curves[k] = [r[k] for r in rows if k in r]
    got[run["seed"]] = {
      "curves": curves,
      **{k: statistics.fmean(v) for k, v in curves.items()},
    }
  return got


def _route_keys(mism) -> list[str]:
  """The routing-agreement metrics every run of every cell logged ([] for dense sweeps)."""
  keys = [set(m) for runs in mism.values() for m in runs.values()]
  common = set.intersection(*keys) if keys else set()
  return sorted(k for k in common if k.startswith("moe/route_agree"))


def _plot(cells, mism, png):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  routes = _route_keys(mism)
  fig, axes = plt.subplots(1, 3 if routes else 2, figsize=(16 if routes else 11, 4))
  for name, runs in cells.items():
    seeds = sorted(runs)
    color = plot_accuracy(axes[0], name, runs, 1)
    kl = np.array([mism[name][s]["curves"]["mismatch/kl_k3"] for s in seeds]).mean(0)
    if kl.any():
      smooth = np.convolve(kl, np.ones(10) / 10, mode="valid")
      axes[1].plot(range(10, 10 + len(smooth)), smooth, color=color, label=name)
    if routes:
      agree = np.array([mism[name][s]["curves"]["moe/route_agree"] for s in seeds]).mean(0)
      axes[2].plot(range(1, len(agree) + 1), agree, color=color, label=name)
  if routes:
    axes[2].set(xlabel="RL step", ylabel="learner's experts = sampler's (fraction)")
    axes[2].set_title("routing agreement, all layers (seed mean)")
    axes[2].legend(fontsize=8)
  axes[0].set(xlabel="cumulative rollouts", ylabel="held-out greedy accuracy")
  axes[0].set_title("accuracy: mean, range over seeds")
  axes[1].set(xlabel="RL step", ylabel="KL(sampler || learner), k3 per token")
  axes[1].set_title("mismatch (seed mean, 10-step average)")
  axes[0].legend(fontsize=8)
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--baseline", required=True, help="the float32 sweep")
  ap.add_argument("--baseline-name", default="float32 (baseline)")
  ap.add_argument("--sweep", action="append", default=[], metavar="NAME=OUT")
  ap.add_argument("--stored", action="append", default=[], metavar="NAME=JSON")
  ap.add_argument(
    "--contrast", action="append", default=[], metavar="A,B", help="also print A - B, paired"
  )
  ap.add_argument("--isa", default="native")
  ap.add_argument("--png", default=None)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  outs = {args.baseline_name: Path(args.baseline)}
  outs.update(dict(item.split("=", 1) for item in args.sweep))
  cells = {name: runs_of(Path(out), args.isa) for name, out in outs.items()}
  mism = {name: mismatch_of(Path(out), args.isa) for name, out in outs.items()}
  for item in args.stored:
    name, path = item.split("=", 1)
    report = json.loads(Path(path).read_text())
    # Pairing needs the same baseline runs: the stored report's baseline must match seed by seed.
    for s, r in report.get(args.baseline_name, {}).items():
      have = cells[args.baseline_name].get(int(s))
      if have is not None and have["acc"] != r["acc"]:
        msg = f"its baseline's seed {s} ended at {r['acc']}, this one's at {have['acc']}"
        raise SystemExit(f"{path}: {msg}: not the same runs, so not paired")
    stored = {int(s): r for s, r in report[name].items()}  # seed -> {acc, evals, mismatch...}
    cells[name] = {s: {"acc": r["acc"], "evals": r["evals"]} for s, r in stored.items()}
    drop = ("acc", "evals")
    mism[name] = {s: {k: v for k, v in r.items() if k not in drop} for s, r in stored.items()}
  base = cells[args.baseline_name]
  seeds = sorted(set.intersection(*(set(r) for r in cells.values())))
  cells = {name: {s: runs[s] for s in seeds} for name, runs in cells.items()}
  routes = _route_keys(mism)
  print(
    "| cell | seeds | accuracy after RL, mean (min–max) | − baseline, paired mean [95% CI] | "
    "mean abs dlogp | KL k3 | activations rounded to 0 | TIS-truncated tokens |"
    + "".join(f" {k.removeprefix('moe/')} |" for k in routes)
  )
  print("|---|---|---|---|---|---|---|---|" + "---|" * len(routes))
  for name, runs in cells.items():
    acc = [runs[s]["acc"] for s in seeds]
    m, lo, hi = paired([base[s]["acc"] for s in seeds], acc)
    col = lambda k, d=4, name=name: span([mism[name][s][k] for s in seeds], d)  # noqa: E731
    print(
      f"| {name} | {','.join(map(str, seeds))} | {span(acc, 3)} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] "
      f"| {col('mismatch/abs_logp_mean')} | {col('mismatch/kl_k3', 5)} "
      f"| {col('mismatch/act_underflow_frac', 5)} | {col('truncated', 5)} |"
      + "".join(f" {col(k)} |" for k in routes)
    )
  for item in args.contrast:
    a, b = item.rsplit(",", 1)
    m, lo, hi = paired([cells[b][s]["acc"] for s in seeds], [cells[a][s]["acc"] for s in seeds])
    print(f"\n{a} − {b}, paired by seed ({len(seeds)}): {m:+.3f} [{lo:+.3f}, {hi:+.3f}]")
  if args.json:
    raw = {
      name: {
        str(s): {"acc": cells[name][s]["acc"], "evals": cells[name][s]["evals"], **mism[name][s]}
        for s in seeds
      }
      for name in cells
    }
    Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
  if args.png:
    _plot(cells, mism, args.png)
    print(f"\nplot: {args.png}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
