"""What the benchmark scripts share: the benchmark models and the machine/version record.

Every script's JSON carries `machine()` and `versions()`, so a result names the CPU, its vector
extensions (XLA compiles for them, and speeds and float rounding differ with them), the XLA
flags in force and the package versions it was measured with.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from jaxrl.models.config import ModelConfig

# CPU extensions that change what XLA's CPU backend emits (or could): recorded, not required.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


def qwen3_shaped(num_layers: int, embed_dim: int, heads: int, kv_heads: int, mlp: int):
  """A random-weight Qwen3-shaped decoder over the byte vocabulary (head dim 64)."""
  return ModelConfig(
    vocab_size=259,
    num_layers=num_layers,
    embed_dim=embed_dim,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=64,
    mlp_dim=mlp,
    # Tunix's Qwen3 attention hard-codes Qwen3's theta (it ignores its config's rope_theta).
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_embeddings=True,
    max_seq_len=1024,
  )


# The benchmark shapes: small (4L d256, 4/2 heads, MLP 1024) and medium (8L d512, 8/4, 2048).
MODELS: dict[str, Callable[[], ModelConfig]] = {
  "small": lambda: qwen3_shaped(4, 256, 4, 2, 1024),
  "medium": lambda: qwen3_shaped(8, 512, 8, 4, 2048),
}


def num_cores() -> int:
  """Cores this process may run on (its affinity mask, where the OS has one)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_flags() -> list[str]:
  """The ISA_FLAGS this CPU reports (Linux /proc/cpuinfo; empty elsewhere)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          have = set(line.split(":", 1)[1].split())
          return [flag for flag in ISA_FLAGS if flag in have]
  except OSError:
    pass
  return []


def machine() -> dict:
  """CPU model, cores, vector extensions, platform and XLA_FLAGS of this run."""
  model = platform.processor() or "unknown"
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
      if line.startswith("Model name:"):
        model = line.split(":", 1)[1].strip()
  except FileNotFoundError:
    pass
  return {
    "cpu": model,
    "cores": num_cores(),
    "cpu_flags": cpu_flags(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "platform": platform.platform(),
  }


def versions(packages=("jax", "jaxlib", "flax", "torch", "transformers")) -> dict:
  """Python's and `packages`' versions (None where one is not installed)."""
  out = {"python": platform.python_version()}
  for pkg in packages:
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def write_report(out: Path, benchmark: str, settings: dict, results, **extra) -> dict:
  """Write a benchmark's JSON (name, UTC date, `machine()`, jax/jaxlib/flax `versions()`, its
  settings and results, and any `extra` keys) to `out`; returns it."""
  report = {
    "benchmark": benchmark,
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax")),
    "settings": settings,
    "results": results,
    **extra,
  }
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {out}")
  return report


def mean_range(values) -> dict:
  """{'mean', 'min', 'max'} of `values`."""
  values = list(values)
  return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def modes_vs_base(per_seed: dict, seeds, base: str = "colocated", key: str = "step_s") -> dict:
  """Per mode of `per_seed` ({mode: {seed: {result: value}}}): every float result's mean_range
  over `seeds`, and `key` divided by the `base` mode's, paired by seed (`{key}_vs_{base}`)."""
  out = {}
  for mode, by_seed in per_seed.items():
    rows = [by_seed[s] for s in seeds]
    m = {k: mean_range(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
    ratios = (r[key] / per_seed[base][s][key] for r, s in zip(rows, seeds, strict=True))
    m[f"{key}_vs_{base}"] = mean_range(ratios)
    out[mode] = m
  return out


def write_modes_report(out: Path, benchmark: str, config: str, per_seed: dict, seeds, **settings):
  """Write a placement-style benchmark's JSON (name, date, `machine()`, versions, its config,
  seeds and `settings`, `modes_vs_base(per_seed, seeds)` and the per-seed results) to `out`;
  returns it."""
  result = {
    "benchmark": benchmark,
    "date": datetime.date.today().isoformat(),
    "machine": machine(),
    "versions": versions(("jax", "jaxlib", "flax")),
    "config": config,
    "seeds": list(seeds),
    **settings,
    "modes": modes_vs_base(per_seed, seeds),
    "per_seed": per_seed,
  }
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  return result


def print_modes(modes: dict, extra_keys, base: str = "colocated", width: int = 13) -> None:
  """One line per mode of `modes_vs_base`: its step seconds, their ratio to `base`, and the
  mean (min-max) of each of `extra_keys` it has."""
  for mode, m in modes.items():
    x = m[f"step_s_vs_{base}"]
    extra = "  ".join(
      f"{k} {m[k]['mean']:.3g} ({m[k]['min']:.3g}-{m[k]['max']:.3g})" for k in extra_keys if k in m
    )
    print(
      f"{mode:{width}s} step {m['step_s']['mean']:.3f}s  x {base} {x['mean']:.3f} "
      f"({x['min']:.3f}-{x['max']:.3f})  {extra}"
    )


def median_seconds(f: Callable, *args, reps: int) -> float:
  """Median wall seconds of `reps` calls of f(*args) (blocked until ready) after one warm-up
  (compile) call."""
  import jax

  jax.block_until_ready(f(*args))
  out = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    out.append(time.perf_counter() - t)
  return statistics.median(out)


class HostClock:
  """The seconds a Trainer spends on host work, detokenising and scoring (its run's
  `completions` and `score`), read at the start of every RL step. Attach before `run()`."""

  def __init__(self, trainer):
    self.total, self.marks = 0.0, []
    run = trainer.ctx
    for name in ("completions", "score"):
      setattr(run, name, self._timed(getattr(run, name)))
    step_fn = trainer.rl_step

    def spy(step):
      self.marks.append(self.total)
      return step_fn(step)

    trainer.rl_step = spy

  def _timed(self, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.total += time.perf_counter() - t0

    return timed

  def per_step(self) -> list[float]:
    """Host seconds of each RL step but the last (whose span runs into the final evaluation)."""
    return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
