"""Seed sweeps of launch.train: run N seeds x ISA variants, summarize with t CIs, compare sweeps.

  python -m launch.sweep run --config=configs/grpo_arith.py:smoke --seeds=0-4 --isa=native,avx2 \
      --out=runs/sweep/NAME [--parallel=1] [--set rl.steps=10 ...] [-- --config.rl.kl.beta=0.0 ...]
  python -m launch.sweep summarize OUT
  python -m launch.sweep compare OUT_A OUT_B [--metric=accuracy_after_rl] [--json=PATH]

Config overrides go to every run, either as `--set KEY=VALUE` (KEY with or without a leading
`config.`) or as `--config.KEY=VALUE` flags after a `--`. `--seeds` takes `0,1,2`, `0-4` or a
mix (`0-2,7`). ISA variants: `native` leaves XLA_FLAGS as the environment has it; `avx2` appends
`--xla_cpu_max_isa=AVX2`. Each run is its own process, since XLA reads its flags when jax is
imported.

Layout of OUT: work/<isa>_seed<S>/ (the run's workdir), logs/<isa>_seed<S>.log (its stdout and
stderr), runs/<isa>_seed<S>.json (its result, written when it ends), sweep.json (the config and
overrides every run shares), summary.json, summary.md and accuracy.png. A run whose JSON records
a success is skipped, so re-running the same command resumes an interrupted sweep; a failed run
is retried. Summary statistics are over successful runs; `wall_s` is the trainer's own time from
its summary.json (the process time, with jax import, is the run JSON's top-level wall_s).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launch.sweep_report import (
  METRICS,
  SweepError,
  compare,
  fmt,
  ident_of,
  make_record,
  metric_value,
  run_name,
  run_order,
  summarize,
  write_json,
)

ROOT = Path(__file__).resolve().parent.parent
# Module-level so that tests can swap in a stand-in trainer that does not import jax.
TRAIN_COMMAND = (sys.executable, "-m", "launch.train")
ISA_FLAGS = {"native": "", "avx2": "--xla_cpu_max_isa=AVX2"}
# Set by the sweep itself: a run's seed and workdir are its identity, and a resumed run must not
# pick up a stale checkpoint.
RESERVED_OVERRIDES = ("seed", "workdir", "resume")
LOG_TAIL_LINES = 40
# Config sections that decide the SFT warm-start: a sweep reusing another's warm-starts
# (--sft-from) must not override them, and the source sweep must not have either.
SFT_SECTIONS = ("sft", "model", "task", "mesh", "reward")

# ------------------------------------------------------------------------------- running a sweep


def parse_seeds(text: str) -> list[int]:
  """'0,1,2', '0-4' or a mix ('0-2,7') -> distinct non-negative seeds, in the order given."""
  seeds: list[int] = []
  for part in text.split(","):
    part = part.strip()
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
    if not m or (m[2] is not None and int(m[2]) < int(m[1])):
      raise SweepError(
        f"--seeds={text!r}: {part!r} is not a seed; allowed: non-negative integers and "
        "ascending ranges, comma-separated (0,1,2 or 0-4 or 0-2,7)"
      )
    for s in range(int(m[1]), int(m[2] or m[1]) + 1):
      if s in seeds:
        raise SweepError(f"--seeds={text!r}: seed {s} is listed twice")
      seeds.append(s)
  return seeds


def parse_isas(text: str) -> list[str]:
  isas = [s.strip() for s in text.split(",")]
  for isa in isas:
    if isa not in ISA_FLAGS:
      raise SweepError(f"--isa={text!r}: {isa!r} is unknown; allowed: {', '.join(ISA_FLAGS)}")
  if len(set(isas)) != len(isas):
    raise SweepError(f"--isa={text!r}: a variant is listed twice")
  return isas


def xla_flags_for(isa: str, base: str) -> str:
  return f"{base} {ISA_FLAGS[isa]}".strip()


def load_config(spec: str):
  """The ConfigDict of 'path.py[:variant]', loaded as launch.train's config flag does."""
  path, _, variant = spec.partition(":")
  if not Path(path).is_file():
    raise SweepError(f"--config={spec!r}: no such file {path!r}")
  try:
    module_spec = importlib.util.spec_from_file_location("_sweep_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()
  except Exception as e:  # the config's own message, e.g. an unknown variant and the valid ones
    raise SweepError(f"--config={spec!r}: {type(e).__name__}: {e}") from e


def normalize_overrides(items: list[str], config) -> list[str]:
  """'[--][config.]a.b=v' items -> 'a.b=v' (last one per key wins), checked against `config`."""
  by_key: dict[str, str] = {}
  fields = config.to_dict()
  for item in items:
    key, sep, value = re.sub(r"^(--)?(config\.)?", "", item).partition("=")
    if not sep or not key:
      raise SweepError(f"override {item!r} is not KEY=VALUE (e.g. rl.steps=10)")
    if key in RESERVED_OVERRIDES:
      raise SweepError(f"override {item!r}: config.{key} is set by the sweep for each run")
    node, parts = fields, key.split(".")
    for i, part in enumerate(parts):
      if not isinstance(node, dict) or part not in node:
        where = ".".join(["config", *parts[:i]])
        have = ", ".join(sorted(node)) if isinstance(node, dict) else "none (not a group)"
        raise SweepError(f"override {item!r}: {where} has no field {part!r}; its fields: {have}")
      node = node[part]
    # type() and not isinstance(): a bool field is not an int one.
    caster = {int: int, float: float}.get(type(node))
    try:
      if caster is not None:
        caster(value)
    except ValueError as e:
      raise SweepError(f"override {item!r}: config.{key} needs a {caster.__name__}") from e
    by_key[key] = value
  return [f"{k}={v}" for k, v in sorted(by_key.items())]


def _check_out_dir(out: Path, ident: dict) -> None:
  """OUT may already hold runs only of this same config and overrides."""
  sources = [out / "sweep.json", *sorted((out / "runs").glob("*.json"))]
  for path in sources:
    if not path.is_file():
      continue
    try:
      theirs = ident_of(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
      raise SweepError(f"--out={str(out)!r}: {path} is not valid JSON: {e}") from e
    if theirs != ident:
      raise SweepError(
        f"--out={str(out)!r} holds runs of another sweep ({path.name}: {theirs}); this one is "
        f"{ident}. Use a new --out, or the same config and overrides to resume it"
      )


def _check_sft_from(src: Path, ident: dict, cfg, names: list[str]) -> None:
  """--sft-from SRC: SRC is a sweep of the same config file whose runs finished the same SFT.

  What is checked: the same config path and variant, no override of an SFT-deciding section on
  either side, and a final SFT checkpoint (step config.sft.steps) in SRC for every run. The
  config file itself may have changed since SRC ran (that is the point: another RL setting);
  that its SFT sections did not is the caller's claim, recorded in each run JSON as sft_from.
  """
  manifest = src / "sweep.json"
  if not manifest.is_file():
    raise SweepError(f"--sft-from={str(src)!r}: no sweep.json there (not a sweep directory)")
  theirs = ident_of(json.loads(manifest.read_text()))
  if (theirs["config"], theirs["variant"]) != (ident["config"], ident["variant"]):
    raise SweepError(
      f"--sft-from={str(src)!r} swept {theirs['config']}:{theirs['variant']}, this sweep "
      f"{ident['config']}:{ident['variant']}; the warm-start must come from the same config"
    )
  for side, overrides in (("this sweep", ident["overrides"]), (str(src), theirs["overrides"])):
    bad = [o for o in overrides if o.split(".", 1)[0] in SFT_SECTIONS]
    if bad:
      raise SweepError(
        f"--sft-from: {side} overrides {bad}, which change the warm-start; allowed with "
        f"--sft-from: overrides outside {SFT_SECTIONS}"
      )
  step = str(cfg.sft.steps)
  missing = [n for n in names if not (src / "work" / n / "checkpoints" / "sft" / step).is_dir()]
  if missing:
    raise SweepError(
      f"--sft-from={str(src)!r} has no final SFT checkpoint (step {step}) for {missing}"
    )


def _log_tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
  try:
    return path.read_text(errors="replace").splitlines()[-n:]
  except OSError:
    return []


def _run_one(
  out: Path, ident: dict, config_path: Path, seed: int, isa: str, sft_from: Path | None = None
) -> dict:
  name = run_name(isa, seed)
  workdir = out / "work" / name
  # A workdir without a run JSON is left by an interrupted or failed try. With resume=False
  # its checkpoints would clash and metrics.jsonl (opened for append) would mix both tries.
  shutil.rmtree(workdir, ignore_errors=True)
  if sft_from is not None:
    # The source run's finished warm-start and its SFT metrics; the trainer then restores SFT
    # (resume=True finds it complete) and runs RL from it, as a full run would.
    src = sft_from / "work" / name
    shutil.copytree(src / "checkpoints" / "sft", workdir / "checkpoints" / "sft")
    lines = (src / "metrics.jsonl").read_text().splitlines()
    sft_lines = [line for line in lines if line.strip() and json.loads(line).get("phase") == "sft"]
    (workdir / "metrics.jsonl").write_text("".join(line + "\n" for line in sft_lines))
  spec = str(config_path) + (f":{ident['variant']}" if ident["variant"] else "")
  cmd = [
    *TRAIN_COMMAND,
    f"--config={spec}",
    f"--config.seed={seed}",
    f"--config.workdir={workdir}",
    f"--config.resume={sft_from is not None}",
    "--config.log.progress=False",
    *(f"--config.{o}" for o in ident["overrides"]),
  ]
  env = dict(os.environ)
  xla_flags = xla_flags_for(isa, env.get("XLA_FLAGS", ""))
  if xla_flags or "XLA_FLAGS" in env:
    env["XLA_FLAGS"] = xla_flags
  log_path = out / "logs" / f"{name}.log"
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    log.write(f"# XLA_FLAGS={xla_flags!r}\n# {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(
      cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
    ).returncode
  wall = time.perf_counter() - t0
  summary, metrics = None, []
  if (workdir / "summary.json").is_file():
    summary = json.loads((workdir / "summary.json").read_text())
  if (workdir / "metrics.jsonl").is_file():
    from jaxrl.metrics import read_jsonl  # imported here: it pulls in jax, which only this needs

    metrics = read_jsonl(workdir / "metrics.jsonl")
  record = make_record(
    ident=ident,
    seed=seed,
    isa=isa,
    xla_flags=xla_flags,
    returncode=rc,
    wall_s=wall,
    summary=summary,
    metrics=metrics,
    log_tail=_log_tail(log_path),
  )
  if sft_from is not None:
    record["sft_from"] = str(sft_from)
  write_json(out / "runs" / f"{name}.json", record)
  return record


def _accuracies(run: dict) -> str:
  shown = [m for m in METRICS if m != "wall_s" and metric_value(run, m) is not None]
  return ", ".join(f"{m} {fmt(m, metric_value(run, m))}" for m in shown)


def run_sweep(
  config: str,
  seeds: str,
  isa: str,
  out: str | os.PathLike,
  *,
  parallel: int = 1,
  overrides: list[str] = (),
  sft_from: str | os.PathLike | None = None,
) -> tuple[list[dict], str]:
  """Runs every (isa, seed) not yet done, then summarizes; returns (all runs, markdown).

  With `sft_from` (another sweep's OUT) each run starts RL from that sweep's finished SFT
  checkpoint of the same (isa, seed) instead of training its own: a paired comparison of RL
  settings on identical warm-starts, at the RL phase's cost only.
  """
  # Everything is checked before OUT is created, so a typo leaves nothing behind.
  seed_list, isa_list = parse_seeds(seeds), parse_isas(isa)
  if parallel < 1:
    raise SweepError(f"--parallel={parallel} is invalid; allowed: an integer >= 1")
  cfg = load_config(config)
  path, _, variant = config.partition(":")
  ident = {
    "config": os.path.normpath(path),
    "variant": variant,
    "overrides": normalize_overrides(list(overrides), cfg),
  }
  out = Path(out)
  _check_out_dir(out, ident)
  if sft_from is not None:
    sft_from = Path(sft_from)
    _check_sft_from(sft_from, ident, cfg, [run_name(i, s) for i in isa_list for s in seed_list])
  for sub in ("runs", "logs", "work"):
    (out / sub).mkdir(parents=True, exist_ok=True)
  write_json(out / "sweep.json", ident)

  jobs, done = [], []
  for i in isa_list:
    for s in seed_list:
      path_json = out / "runs" / f"{run_name(i, s)}.json"
      prev = json.loads(path_json.read_text()) if path_json.is_file() else None
      if prev and prev.get("ok"):
        print(f"[sweep] skip {run_name(i, s)}: done ({_accuracies(prev)})", flush=True)
        done.append(prev)
      else:
        jobs.append((s, i))
  lock = threading.Lock()
  t_start = time.perf_counter()

  def elapsed() -> str:
    return f"{time.perf_counter() - t_start:.0f}s"

  def work(job: tuple[int, str]) -> dict:
    s, i = job
    with lock:
      print(f"[sweep] start {run_name(i, s)} [{elapsed()}]", flush=True)
    run = _run_one(out, ident, Path(path).resolve(), s, i, sft_from)
    with lock:
      if run["ok"]:
        msg = f"done {run_name(i, s)} in {run['wall_s']:.1f}s: {_accuracies(run)}"
      else:
        msg = f"FAILED {run_name(i, s)} (rc={run['returncode']}), log: {out}/logs/"
      print(f"[sweep] {msg} [{elapsed()}]", flush=True)
    return run

  with ThreadPoolExecutor(max_workers=parallel) as pool:
    done += list(pool.map(work, jobs))
  md = summarize(out)
  print(md, end="", flush=True)
  return sorted(done, key=run_order), md


# ------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m launch.sweep", description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  r = sub.add_parser("run", help="run the seeds x isa grid, then summarize")
  r.add_argument("--config", required=True, help="configs/*.py[:variant]")
  r.add_argument("--seeds", required=True, help="0,1,2 or 0-4 or 0-2,7")
  r.add_argument("--isa", default="native", help=f"comma-separated of: {', '.join(ISA_FLAGS)}")
  r.add_argument("--out", required=True, help="the sweep's directory")
  r.add_argument("--parallel", type=int, default=1, help="runs at once")
  r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="rl.steps=10")
  r.add_argument(
    "--sft-from", default=None, help="another sweep's OUT: start RL from its SFT checkpoints"
  )
  s = sub.add_parser("summarize", help="(re)write OUT/summary.{json,md} and OUT/accuracy.png")
  s.add_argument("out")
  c = sub.add_parser("compare", help="paired B - A over the (isa, seed) runs both sweeps have")
  c.add_argument("out_a")
  c.add_argument("out_b")
  c.add_argument("--metric", default="accuracy_after_rl", choices=METRICS)
  c.add_argument("--json", default=None, help="default: OUT_B/compare_<name of OUT_A>.json")
  return p


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # Everything after `--` is config flags for every run: `-- --config.rl.kl.beta=0.0`.
  passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
  argv = argv[: argv.index("--")] if "--" in argv else argv
  args = _parser().parse_args(argv)
  try:
    if passthrough and args.command != "run":
      raise SweepError("flags after `--` apply only to `run`")
    if args.command == "run":
      bad = [a for a in passthrough if not a.startswith("--config.")]
      if bad:
        raise SweepError(f"after `--` only --config.KEY=VALUE flags are allowed, got {bad}")
      runs, _ = run_sweep(
        args.config,
        args.seeds,
        args.isa,
        args.out,
        parallel=args.parallel,
        overrides=[*args.set, *passthrough],
        sft_from=args.sft_from,
      )
      failed = [r for r in runs if not r["ok"]]
      if failed:
        names = ", ".join(f"{run_name(r['isa'], r['seed'])} (rc={r['returncode']})" for r in failed)
        sys.exit(f"error: {len(failed)} of {len(runs)} runs failed: {names}; logs: {args.out}/logs")
    elif args.command == "summarize":
      print(summarize(args.out), end="")
    else:
      print(compare(args.out_a, args.out_b, metric=args.metric, json_path=args.json), end="")
  except SweepError as e:
    sys.exit(f"error: {e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
