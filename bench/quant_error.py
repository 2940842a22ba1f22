"""Where a quantized sampler's error comes from: weights or activations (QUADS's ablation).

For each warm-started policy (an SFT checkpoint of configs/grpo_arith.py per seed), 256 of its
own sampled completions (64 prompts x 4, temperature 1) are scored by the float policy and by
fake-quantized copies (jaxrl.fake_quant.FakeQuant) that round
  both         the weights and the activations, as the sampler's W8A8 einsum does
  weights      only the weights (activations float: what QUADS's asymmetric QAT trains with)
  activations  only the activations, grouped as the sampler groups them (weights float)
for every mode of rl.rollout.quantize. Reported per (mode, part), mean over seeds with the
range: the mean and p99 of |logp_quant - logp_float| over the completion tokens and the k3
estimate of KL(float || quant). "both" is checked against the real quantized params
(quantize_params) once per mode: they are the same numbers, up to float summation order.

  .venv/bin/python bench/quant_error.py --sft-sweep=runs/sweep/careless2d --seeds=0-2
  XLA_FLAGS=--xla_cpu_max_isa=AVX2 .venv/bin/python bench/quant_error.py --seeds=0-2 \
      --out=bench/results/quant_error_avx2.json --png=/tmp/quant_error_avx2.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine, versions  # noqa: E402

from jaxrl.config import config_module, validate  # noqa: E402
from jaxrl.fake_quant import FAKE_QUANT_PARTS, fake_quant_params  # noqa: E402
from jaxrl.models.transformer import token_logprobs  # noqa: E402
from jaxrl.quant import QUANT_MODES, quantize_params  # noqa: E402
from jaxrl.rl.batch import rollout_columns  # noqa: E402
from jaxrl.rl.experience import build_sampler  # noqa: E402
from jaxrl.rl.run import Run, restore_params  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "quant_error.json"


def _seeds(text: str) -> list[int]:
  if "-" in text:
    lo, hi = text.split("-")
    return list(range(int(lo), int(hi) + 1))
  return [int(s) for s in text.split(",")]


def _errors(logq, logp, mask) -> dict:
  d = (logq - logp)[mask]  # log pi_quant / pi_float on the completion tokens
  gap = np.abs(d)
  return {
    "abs_logp_mean": float(gap.mean()),
    "abs_logp_p99": float(np.quantile(gap, 0.99)),
    # k3 of KL(pi_float || pi_quant) from samples of pi_float: e^{-d'} - 1 + d', d' = -d.
    "kl_k3": float(np.mean(np.exp(d) - 1 - d)),
  }


def measure(sweep: Path, seed: int, prompts: int, group: int) -> dict:
  c = config_module(REPO / "configs" / "grpo_arith.py").get_config()
  c.workdir, c.log.progress = str(sweep / "work" / f"native_seed{seed}"), False
  run = Run.build(validate(c))
  _, _, params = restore_params(run, "sft")
  records = next(iter(run.task.train_dataset(seed=10_000 + seed, batch_size=prompts)))
  rollout, _ = build_sampler(run)(params, run.encode(records), group_size=group, seed=seed)
  cols = rollout_columns(rollout)
  tokens, valid = jnp.asarray(cols["tokens"]), jnp.asarray(cols["valid"])
  mask = cols["mask"] > 0
  graphdef = run.graphdef
  score = jax.jit(lambda p: token_logprobs(graphdef, p, tokens, valid))
  logp = np.asarray(score(params))
  out = {}
  for mode in QUANT_MODES:
    logq = {}
    for part in FAKE_QUANT_PARTS:
      fake = jax.jit(lambda p, mode=mode, part=part: score(fake_quant_params(p, mode, part)))
      logq[part] = np.asarray(fake(params))
      out[f"{mode}/{part}"] = _errors(logq[part], logp, mask)
    real = np.asarray(score(quantize_params(params, mode)))
    out[f"{mode}/both"]["real_vs_fake_max"] = float(np.abs(real - logq["both"])[mask].max())
  return out


def plot(summary: dict, path: Path) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 3.2))
  ax = fig.add_subplot()
  parts = ("weights", "activations", "both")
  width = 0.27
  for j, part in enumerate(parts):
    means = [summary[f"{m}/{part}"]["abs_logp_mean"] for m in QUANT_MODES]
    y = [v["mean"] for v in means]
    err = [[v["mean"] - v["min"] for v in means], [v["max"] - v["mean"] for v in means]]
    xs = [i + (j - 1) * width for i in range(len(QUANT_MODES))]
    ax.bar(xs, y, width, yerr=err, capsize=2, label=f"{part} rounded")
  ax.set_xticks(range(len(QUANT_MODES)), QUANT_MODES)
  ax.set_yscale("log")
  ax.set_ylabel("mean |logp_q - logp_float|")
  ax.set_title(
    "Quantized vs float log-probs on the policy's samples (mean, range over seeds)", fontsize=9
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  FigureCanvasAgg(fig).print_png(str(path))


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--sft-sweep", default="runs/sweep/careless2d", help="a launch.sweep OUT")
  ap.add_argument("--seeds", default="0-2")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--out", default=str(DEFAULT_OUT))
  ap.add_argument("--png", default=str(REPO / "docs" / "quant_error.png"))
  args = ap.parse_args(argv)
  per_seed = {}
  for seed in _seeds(args.seeds):
    per_seed[seed] = measure(Path(args.sft_sweep), seed, args.prompts, args.group)
    print(f"[bench] seed {seed} done", flush=True)
  keys = next(iter(per_seed.values()))
  summary = {}
  for key in keys:
    summary[key] = {}
    for metric in ("abs_logp_mean", "abs_logp_p99", "kl_k3"):
      vals = [per_seed[s][key][metric] for s in per_seed]
      summary[key][metric] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
  result = {
    "date": datetime.date.today().isoformat(),
    "command": "bench/quant_error.py " + " ".join(argv or sys.argv[1:]),
    "machine": machine(),
    "versions": versions(),
    "seeds": list(per_seed),
    "per_seed": per_seed,
    "summary": summary,
  }
  Path(args.out).write_text(json.dumps(result, indent=1))
  plot(summary, Path(args.png))
  print("| mode | part | mean abs dlogp | p99 abs dlogp | KL k3 |")
  print("|---|---|---|---|---|")
  for key, m in summary.items():
    mode, part = key.split("/")
    cells = [
      f"{m[x]['mean']:.2e} [{m[x]['min']:.1e}, {m[x]['max']:.1e}]"
      for x in ("abs_logp_mean", "abs_logp_p99", "kl_k3")
    ]
    print(f"| {mode} | {part} | " + " | ".join(cells) + " |")
  return result


if __name__ == "__main__":
  main()
