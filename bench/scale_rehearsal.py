"""Scale rehearsal: the GSM8K job end to end on a real architecture at its real size, locally.

Builds, without any model hub or network, an HF checkpoint directory of a real architecture
(Qwen3-0.6B by default; `--arch` for Qwen3-1.7B, Llama-3.2-1B, Gemma-3-1B) with seeded random
weights saved by transformers as bfloat16 sharded safetensors, a byte-level BPE tokenizer with
the family's special tokens and chat template trained on generated GSM8K-format problems, and
runs the project's real job (`python -m launch.train --config=configs/grpo_gsm8k.py`) on it: a
few SFT steps, GRPO steps through the engine, held-out evaluation; then SIGKILLs a second run
after its first RL checkpoint, resumes it and compares it with the uninterrupted one bit for
bit; exports the final weights (`python -m launch.export`) and reloads them with transformers,
comparing logits with jaxrl's own forward. Every phase records its wall time, the peak RSS of
its process, and what the run logs (compile time, `time/*`, decode tokens/s, summary.json).

  .venv/bin/python bench/scale_rehearsal.py                    # Qwen3-0.6B, ~30 min on 2 cores
  .venv/bin/python bench/scale_rehearsal.py --smoke --out /tmp/sr   # the same at a tiny size
  .venv/bin/python bench/scale_rehearsal.py --arch gemma-3-1b --peers

`--peers` adds decode tokens/s of jaxrl's engine vs HF `generate`, and one GRPO step of jaxrl vs
TRL's GRPOTrainer, on the rehearsal's checkpoint (helpers of decode_throughput.py, grpo_step.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

import _scale_checkpoint as ck  # noqa: E402
from _common import versions, write_report  # noqa: E402

from launch import fault_inject  # noqa: E402

CONFIG = "configs/grpo_gsm8k.py"
# How the rehearsal's run computes: compute in bfloat16 over float32 master weights, a chunked
# log-prob head (its [tokens, vocab] logits never whole), every block rematerialised on the
# backward pass and the blocks run as one scan (compile time flat in depth).
PRECISION = ["model.dtype=bfloat16", "model.param_dtype=float32", "model.logits_chunk=1024"]
EXECUTION = ["model.remat=full", "model.scan_layers=True"]
# Checkpoints written before the next step: an asynchronous write's host copy of the state
# (6.7 GiB at 0.6B) beside a step's working set does not fit 24 GiB (the run's estimate says so).
CHECKPOINTS = ["checkpoint.async_save=False"]
# Extra overrides to fit a smaller host (none by default). On the 2-core, 24 GiB VM a 0.6B full
# fine-tune with float32 masters and AdamW is at the edge (docs/benchmarks.md, 2026-12-07): the
# uninterrupted run finished at a 22.2 GiB peak RSS, its resumed twin and a run with
# rl.kl.beta=0.0 and model.logits_chunk=256 were killed by the kernel in their first RL step.
MEMORY: list[str] = []
# Step counts and batch sizes: (full size, --smoke). Each is also a flag.
SIZES = {
  "train_problems": (1000, 200),
  "held_out_problems": (64, 16),
  "sft_steps": (4, 2),
  "sft_batch": (4, 2),
  "rl_steps": (3, 2),
  "prompts": (2, 2),
  "group_size": (4, 4),
  "max_new_tokens": (128, 128),
  "microbatches": (1, 2),
  "eval_examples": (8, 4),
  "checkpoint_every": (2, 1),  # the run is killed after its first RL checkpoint
}
PAGE = 16  # rl.max_prompt_len is rounded up to whole KV pages
RELOAD_BOUND = 1e-4  # max |logit difference| allowed between transformers and jaxrl (float32)
# What jax logs of each compile (JAX_LOG_COMPILES=1): tracing, lowering, XLA compilation.
FINISHED = re.compile(
  r"Finished (XLA compilation of|tracing|jaxpr to MLIR module conversion) (.+?) "
  r"(?:for jit )?in ([0-9.eE+-]+) sec"
)


# ------------------------------------------------------------------------------ child processes


def _status_kb(pid: int, field: str) -> int | None:
  try:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
      if line.startswith(field + ":"):
        return int(line.split()[1])
  except (OSError, ValueError):
    pass
  return None


def run_child(cmd, log: Path, *, env=None, watch=None, kill_on=None, poll=0.02) -> dict:
  """Runs `cmd` (cwd: the repo), its output time-stamped into `log`. `watch` {event: predicate}
  is polled; the first time each predicate holds is recorded with the peak RSS so far
  (/proc VmHWM); `kill_on` names an event at which the child gets SIGKILL. The child's own
  peak RSS comes from wait4 (its rusage alone, not this process's other children)."""
  t0 = time.monotonic()
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  lines: list[tuple[float, str]] = []

  def read():
    with open(log, "w") as f:
      for line in proc.stdout:
        lines.append((time.monotonic() - t0, line))
        f.write(f"[{lines[-1][0]:8.2f}] {line}")

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  events, killed = {}, False
  while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
      break
    now = time.monotonic() - t0
    for name, pred in (watch or {}).items():
      if name not in events and pred():
        events[name] = {"t_s": round(now, 2), "peak_rss_mb": _mb(_status_kb(proc.pid, "VmHWM"))}
        if name == kill_on:
          os.kill(proc.pid, signal.SIGKILL)
          killed = True
    time.sleep(poll)
  proc.returncode = os.waitstatus_to_exitcode(status)
  reader.join()
  return {
    "returncode": proc.returncode,
    "wall_s": round(time.monotonic() - t0, 2),
    "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
    "killed": killed,
    "events": events,
    "log": str(log),
    "lines": lines,
  }


def _mb(kb):
  return None if kb is None else round(kb / 1024, 1)


def _checked(result: dict, what: str) -> dict:
  if result["returncode"] != 0 and not result["killed"]:
    tail = "".join(line for _, line in result["lines"][-40:])
    raise RuntimeError(f"{what} failed (exit {result['returncode']}), {result['log']}:\n{tail}")
  return {k: v for k, v in result.items() if k != "lines"}


def call_child(name: str, request: dict, work: Path) -> tuple[dict, dict]:
  """Runs `_CHILDREN[name](request)` in a fresh process of this script: (its answer, run info)."""
  req = work / f"{name}.request.json"
  req.write_text(json.dumps(request))
  cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--request", str(req)]
  info = _checked(run_child(cmd, work / f"{name}.log"), f"the {name} child")
  return json.loads(req.with_suffix(".answer.json").read_text()), info


def compile_times(lines, start: float = 0.0, end: float = float("inf")) -> dict:
  """What jax logged (JAX_LOG_COMPILES) between `start` and `end` seconds: trace, lower and XLA
  compile seconds (a persistent-cache hit counts its load), and the slowest XLA compiles."""
  totals = {"trace_s": 0.0, "lower_s": 0.0, "xla_compile_s": 0.0, "compilations": 0}
  programs: dict[str, float] = {}
  for t, line in lines:
    m = FINISHED.search(line)
    if not m or not start <= t < end:
      continue
    kind, name, sec = m.group(1), m.group(2), float(m.group(3))
    if kind == "tracing":
      totals["trace_s"] += sec
    elif kind.startswith("jaxpr"):
      totals["lower_s"] += sec
    else:
      totals["xla_compile_s"] += sec
      totals["compilations"] += 1
      programs[name] = programs.get(name, 0.0) + sec
  top = sorted(programs.items(), key=lambda kv: -kv[1])[:6]
  return {
    **{k: round(v, 2) for k, v in totals.items()},
    "slowest_xla_compiles_s": {k: round(v, 2) for k, v in top},
  }


# ------------------------------------------------------------------------------------- phases


def phase_data(work: Path, sizes: dict, seed: int) -> dict:
  """GSM8K-format JSONL files of generated word problems: train, and a held-out file whose
  questions are not in it."""
  from jaxrl.data import word_problems

  train = word_problems.generate(sizes["train_problems"], seed=seed)
  seen = {r["question"] for r in train}
  candidates = word_problems.generate(4 * sizes["held_out_problems"], seed=seed + 1)
  held_out = [r for r in candidates if r["question"] not in seen][: sizes["held_out_problems"]]
  paths = {}
  for name, records in (("train", train), ("held_out", held_out)):
    paths[name] = work / f"{name}.jsonl"
    paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
  return {
    "train": str(paths["train"]),
    "held_out": str(paths["held_out"]),
    "records": {"train": len(train), "held_out": len(held_out)},
  }


def phase_tokenizer(arch: ck.Arch, vocab_size: int, ckpt: Path, data: dict) -> dict:
  """The family's tokenizer, trained on the problems and the job's system prompt, saved into
  the checkpoint directory; with the token ids the checkpoint's configs name, and (encoded as
  jaxrl encodes them) the longest chat prompt and demonstration."""
  from jaxrl.config import config_module
  from jaxrl.tokenizer import HFTokenizer

  system = config_module(REPO / CONFIG).SYSTEM_PROMPT
  records = [
    json.loads(line)
    for p in (data["train"], data["held_out"])
    for line in Path(p).read_text().splitlines()
  ]
  texts = [system] + [t for r in records for t in (r["question"], r["answer"])]
  tok = ck.train_tokenizer(arch.family, texts, vocab_size)
  ckpt.mkdir(parents=True, exist_ok=True)
  saved = ck.save_tokenizer(arch.family, tok, ckpt)
  ids = ck.token_ids(arch.family, tok)
  jt = HFTokenizer(ckpt)

  def prompt(r):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": r["question"]}]
    return jt.apply_chat_template(messages, tokenize=True)

  longest_prompt = max(len(prompt(r)) for r in records)
  longest_demo = max(len(jt.encode(r["answer"])) + 1 for r in records)  # + the EOS SFT appends
  return {
    **saved,
    "target_vocab_size": vocab_size,
    "ids": ids,
    "longest_prompt_tokens": longest_prompt,
    "longest_demonstration_tokens": longest_demo,
  }


def as_jaxrl_reads(arch: ck.Arch, ckpt: Path) -> dict:
  """The checkpoint directory's tokenizer as a run reads it (jaxrl.tokenizer.HFTokenizer, with
  generation_config.json's stop ids): EOS, stops, pad, the chat template, a rendered prompt."""
  from tokenizers import Tokenizer

  from jaxrl.tokenizer import HFTokenizer

  tok = HFTokenizer(ckpt)
  backend = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
  end_of_turn = backend.token_to_id(arch.family.end_of_turn)
  return {
    "vocab_size": tok.vocab_size,
    "eos_id": tok.eos_id,
    "eos_ids": list(tok.eos_ids),
    "stop_tokens": [backend.id_to_token(i) for i in tok.eos_ids],
    "bos_id": tok.bos_id,
    "pad_id": tok.pad_id,
    "sft_appends": backend.id_to_token(tok.eos_id),  # SFT ends each demonstration with eos_id
    "end_of_turn_id": end_of_turn,
    "stops_on_end_of_turn": end_of_turn in tok.eos_ids,
    "has_chat_template": tok.chat_template is not None,
    "example_prompt": tok.apply_chat_template(
      [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "QUESTION"}]
    ),
  }


def train_overrides(ckpt: Path, data: dict, sizes: dict, max_prompt_len: int, seed: int) -> list:
  """The job's config overrides for the rehearsal (launch.train and launch.export take them)."""
  return [
    f"seed={seed}",
    f"model.path={ckpt}",
    f"task.path={data['train']}",
    f"task.held_out_path={data['held_out']}",
    f"sft.steps={sizes['sft_steps']}",
    f"sft.batch_size={sizes['sft_batch']}",
    f"rl.steps={sizes['rl_steps']}",
    f"rl.prompts_per_step={sizes['prompts']}",
    f"rl.group_size={sizes['group_size']}",
    f"rl.max_prompt_len={max_prompt_len}",
    f"rl.max_new_tokens={sizes['max_new_tokens']}",
    f"rl.num_microbatches={sizes['microbatches']}",
    "rl.optim.warmup_steps=0",
    "eval.every=0",  # held-out accuracy at init, after SFT and after RL
    f"eval.num_examples={sizes['eval_examples']}",
    f"checkpoint.every={sizes['checkpoint_every']}",
    "checkpoint.max_to_keep=1",
    "log.tensorboard=False",
    *PRECISION,
    *EXECUTION,
    *CHECKPOINTS,
    *MEMORY,
  ]


def _committed(workdir: Path, phase: str):
  return lambda: any(p.name.isdigit() for p in (workdir / "checkpoints" / phase).glob("*"))


def _rows(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  lines = path.read_text().splitlines() if path.exists() else []
  return [json.loads(x) for x in lines if x.strip()]


def rl_report(rows: list[dict], rows_per_step: int) -> dict:
  """Per RL step: reward, response length, truncation, the `time/*` split, generated tokens
  over the rollout time; and the steady-state means (every step but the first, which compiles)."""
  steps = []
  for r in (r for r in rows if r.get("phase") == "rl" and "rl/reward_mean" in r):
    tokens = r["rl/response_length"] * rows_per_step
    steps.append(
      {
        "step": r["step"],
        "reward_mean": r["rl/reward_mean"],
        "response_length": r["rl/response_length"],
        "truncated_frac": r["rl/truncated_frac"],
        "generated_tokens": tokens,
        "rollout_tokens_per_s": tokens / r["time/rollout_s"],
        "time": {k: v for k, v in r.items() if k.startswith("time/")},
        "rollout": {k: v for k, v in r.items() if k.startswith("rollout/")},
        **({"eval_accuracy": r["eval/accuracy"]} if "eval/accuracy" in r else {}),
      }
    )
  steady = steps[1:] or steps
  keys = sorted({k for s in steady for k in s["time"]})
  return {
    "steps": steps,
    "steady": {
      "rollout_tokens_per_s": statistics.fmean(s["rollout_tokens_per_s"] for s in steady),
      "time": {k: statistics.fmean(s["time"].get(k, 0.0) for s in steady) for k in keys},
    },
    "first_step_time": steps[0]["time"] if steps else {},
  }


def phase_runs(ckpt: Path, data: dict, sizes: dict, tok: dict, work: Path, env: dict, seed: int):
  """Run A (uninterrupted: SFT then RL, the measured run); then run B from A's SFT checkpoint,
  SIGKILLed right after its first RL checkpoint commits, and the same command again to the end;
  B must end bit-identical to A (final RL checkpoint, every metric row but the timings)."""
  max_prompt_len = -(-tok["longest_prompt_tokens"] // PAGE) * PAGE
  if tok["longest_demonstration_tokens"] > sizes["max_new_tokens"]:
    raise SystemExit(
      f"the longest demonstration is {tok['longest_demonstration_tokens']} tokens with its EOS; "
      f"--max-new-tokens={sizes['max_new_tokens']} is too short for SFT"
    )
  overrides = train_overrides(ckpt, data, sizes, max_prompt_len, seed)
  a, b = work / "run_uninterrupted", work / "run_killed"
  cmd = fault_inject._command(CONFIG, a, overrides)
  print(f"[rehearsal] run: {' '.join(cmd[1:])}", flush=True)
  full = run_child(
    cmd, work / "run_uninterrupted.log", env=env, watch={"sft_done": _committed(a, "sft")}
  )
  lines = full["lines"]
  full = _checked(full, "the uninterrupted run")
  sft_end = full["events"].get("sft_done", {}).get("t_s", full["wall_s"])
  rows = _rows(a)
  summary = json.loads((a / "summary.json").read_text())
  sft_rows = [r for r in rows if r.get("phase") == "sft"]
  sft = {
    "wall_s": sft_end,  # process start (imports, checkpoint load, evaluation at init) to SFT's end
    "peak_rss_mb": full["events"].get("sft_done", {}).get("peak_rss_mb"),
    "compile": compile_times(lines, 0.0, sft_end),
    "loss": [r["sft/loss"] for r in sft_rows if "sft/loss" in r],
    "accuracy_init": summary.get("accuracy_init"),
    "accuracy_after_sft": summary.get("accuracy_after_sft"),
  }
  rl = {
    "wall_s": round(full["wall_s"] - sft_end, 2),
    "peak_rss_mb": full["peak_rss_mb"],
    "compile": compile_times(lines, sft_end),
    **rl_report(rows, sizes["prompts"] * sizes["group_size"]),
    "accuracy_after_rl": summary.get("accuracy_after_rl"),
  }
  print(
    f"[rehearsal] sft: {sft['wall_s']:.1f} s; rl: {rl['wall_s']:.1f} s, "
    f"{rl['steady']['rollout_tokens_per_s']:.1f} rollout tok/s",
    flush=True,
  )

  # B starts where A's SFT ended: its checkpoint (hard links) and its metric rows.
  shutil.copytree(a / "checkpoints" / "sft", b / "checkpoints" / "sft", copy_function=_link)
  (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
  cmd_b = fault_inject._command(CONFIG, b, overrides)
  t0 = time.monotonic()
  kill = _checked(
    run_child(
      cmd_b,
      work / "run_killed_1.log",
      env=env,
      kill_on="rl_checkpoint",
      watch={"rl_checkpoint": _committed(b, "rl")},
      poll=0.005,
    ),
    "the run to be killed",
  )
  steps = [int(p.name) for p in (b / "checkpoints" / "rl").glob("*") if p.name.isdigit()]
  resumed_from = max(steps, default=None)
  again = run_child(cmd_b, work / "run_killed_2.log", env=env)
  again_lines = again["lines"]
  again = _checked(again, "the resumed run")
  problems = fault_inject.compare(a, b)
  resume = {
    "wall_s": round(time.monotonic() - t0, 2),
    "kill_landed": kill["killed"],
    "resumed_from_step": resumed_from,
    "resumed_line": next((x.strip() for _, x in again_lines if "resumed RL from step" in x), None),
    "peak_rss_mb": max(kill["peak_rss_mb"], again["peak_rss_mb"]),
    "killed_run": {k: kill[k] for k in ("wall_s", "peak_rss_mb")},
    "resumed_run": {k: again[k] for k in ("wall_s", "peak_rss_mb")},
    "resumed_compile": compile_times(again_lines),
    "identical": not problems,
    "problems": problems,
    "first_difference": first_difference(_rows(a), _rows(b), resumed_from or 0),
  }
  print(
    f"[rehearsal] kill -9 after RL step {resumed_from}, resume: identical={not problems}",
    flush=True,
  )
  run_info = {
    "command": cmd[1:],
    "overrides": overrides,
    "max_prompt_len": max_prompt_len,
    "memory_estimate": summary.get("memory", "absent"),
    "summary": summary,
    "uninterrupted_run": full,
  }
  return run_info, sft, rl, resume, overrides


def _link(src, dst):
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)


def first_difference(rows_a: list[dict], rows_b: list[dict], after: int) -> str | None:
  """The first metric (timings aside) of an RL step after `after` that differs between the
  runs, as 'step N key: a vs b'; None if every such row matches."""
  pick = lambda rows: {r["step"]: r for r in rows if r.get("phase") == "rl" and r["step"] > after}
  a, b = pick(rows_a), pick(rows_b)
  for step in sorted(a.keys() | b.keys()):
    if step not in a or step not in b:
      return f"step {step} logged by only one run"
    for k in sorted(a[step].keys() | b[step].keys()):
      if not k.startswith("time/") and a[step].get(k) != b[step].get(k):
        return f"step {step} {k}: {a[step].get(k)!r} uninterrupted vs {b[step].get(k)!r} resumed"
  return None


def phase_export(overrides: list, workdir: Path, out: Path, env: dict, work: Path) -> dict:
  """`python -m launch.export` of the final RL weights, as a user runs it."""
  cmd = [
    sys.executable,
    "-m",
    "launch.export",
    f"--config={CONFIG}",
    f"--out={out}",
    f"--config.workdir={workdir}",
    *(f"--config.{o}" for o in overrides),
  ]
  result = run_child(cmd, work / "export.log", env=env)
  lines = result["lines"]
  result = _checked(result, "launch.export")
  return {
    **{k: result[k] for k in ("wall_s", "peak_rss_mb")},
    "line": next((x.strip() for _, x in lines if "exported" in x), None),
    "files": sorted(p.name for p in out.iterdir()),
    "shard_dtypes": ck.shard_dtypes(out),
  }


# ------------------------------------------------------------------------------------- children


def child_checkpoint(req: dict) -> dict:
  """Builds and saves the checkpoint (torch), then checks that jaxrl reads its config."""
  from jaxrl.models.hf import hf_model_config

  arch = ck.ARCHS[req["arch"]]
  out = Path(req["ckpt"])
  info = ck.build_checkpoint(arch, out, smoke=req["smoke"], seed=req["seed"], ids=req["ids"])
  cfg = hf_model_config(out)
  info["jaxrl_config"] = {
    "vocab_size": cfg.vocab_size,
    "num_layers": cfg.num_layers,
    "embed_dim": cfg.embed_dim,
    "heads": [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim],
    "mlp_dim": cfg.mlp_dim,
    "dtype": cfg.dtype,
    "tie_embeddings": cfg.tie_embeddings,
    "layer_types": None if cfg.layer_types is None else sorted(set(cfg.layer_types)),
  }
  return info


def child_reload(req: dict) -> dict:
  """transformers' float32 forward of the exported directory against jaxrl's forward of the same
  files (load_hf_checkpoint + transformer.apply), on held-out chat prompts, left-padded."""
  import jax
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM

  from jaxrl.models.hf import load_hf_checkpoint
  from jaxrl.models.transformer import apply, positions_from_mask
  from jaxrl.tokenizer import HFTokenizer

  out = Path(req["export"])
  tok = HFTokenizer(out)
  seqs = [
    tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
    for q in req["questions"]
  ]
  width = max(map(len, seqs))
  tokens = np.full((len(seqs), width), tok.pad_id, np.int32)
  valid = np.zeros(tokens.shape, bool)
  for i, s in enumerate(seqs):
    tokens[i, width - len(s) :], valid[i, width - len(s) :] = s, True
  positions = np.asarray(positions_from_mask(valid))
  model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    ref = (
      model(
        input_ids=torch.from_numpy(tokens).long(),
        attention_mask=torch.from_numpy(valid).long(),
        position_ids=torch.from_numpy(positions).long(),
      )
      .logits.float()
      .numpy()
    )
  del model
  cfg, graphdef, params = load_hf_checkpoint(out, dtype="float32")
  ours, _ = jax.jit(apply, static_argnums=0)(graphdef, params, tokens, positions, valid)
  ours = np.asarray(ours, np.float32)[..., : ref.shape[-1]]
  diff = np.abs(ours[valid] - ref[valid])
  return {
    "prompts": len(seqs),
    "tokens": int(valid.sum()),
    "max_abs_diff": float(diff.max()),
    "mean_abs_diff": float(diff.mean()),
    "max_abs_logit": float(np.abs(ref[valid]).max()),
    "argmax_agreement": float(np.mean(ours[valid].argmax(-1) == ref[valid].argmax(-1))),
    "jaxrl_dtype": cfg.dtype,
  }


def child_peers(req: dict) -> dict:
  """Decode tokens/s of jaxrl's engine vs HF `generate` (interleaved calls, after a warm-up
  each), then one GRPO step of jaxrl vs TRL's GRPOTrainer, on the exported checkpoint."""
  import gc

  import decode_throughput as dt
  import grpo_step as gs
  import numpy as np

  from jaxrl.models.hf import load_hf_checkpoint
  from jaxrl.rl.advantages import ESTIMATORS

  ckpt = Path(req["export"])
  cfg, graphdef, params = load_hf_checkpoint(ckpt, dtype="float32")
  rng = np.random.default_rng(0)
  b, p, n, reps = req["batch"], req["prompt_len"], req["new_tokens"], req["reps"]
  prompts = rng.integers(3, req["tokenizer_vocab"], (b, p), dtype=np.int32)
  w = dt.Workload("rehearsal", cfg, graphdef, params, ckpt, prompts, n, 1, reps, req["threads"], 8)
  peers = {"engine": dt.run_engine(w), "hf": dt.run_hf(w)}
  times, tokens = {k: [] for k in peers}, {}
  order = list(peers)
  for rep in range(reps):
    for name in order[rep % 2 :] + order[: rep % 2]:
      time.sleep(0.25)
      seconds, tokens[name] = peers[name].call()
      times[name].append(seconds)
  decode = {
    name: {
      "median_s": statistics.median(t),
      "tokens_per_s": b * n / statistics.median(t),
      "times_s": t,
    }
    for name, t in times.items()
  }
  decode["engine_over_hf"] = decode["engine"]["tokens_per_s"] / decode["hf"]["tokens_per_s"]
  decode["greedy_agreement"] = dt.prefix_agreement(tokens["engine"], tokens["hf"])
  for peer in peers.values():
    peer.close()
  del peers, w
  gc.collect()
  # GRPO: the two peers one after the other (both trainers at once need twice the memory).
  g, num = req["group_size"], req["grpo_prompts"]
  completions = rng.integers(3, req["tokenizer_vocab"], (num * g, n), dtype=np.int32)
  rewards = gs.parity_reward(completions).reshape(num, g)
  adv = np.asarray(ESTIMATORS.get("grpo")(rewards), np.float32).reshape(-1)
  w = gs.Workload(
    cfg,
    graphdef,
    params,
    ckpt,
    prompts[:num],
    g,
    completions,
    adv,
    beta=0.04,
    epsilon=0.2,
    learning_rate=1e-5,
    weight_decay=0.0,
    grad_clip=1.0,
    threads=req["threads"],
  )
  grpo = {}
  for name in ("jaxrl", "trl"):
    try:
      peer = gs.PEERS[name](w)
    except (FileNotFoundError, RuntimeError) as e:
      grpo[name] = {"skipped": str(e)}
      continue
    try:
      first, _ = peer.call("full")
      timed = [peer.call("full")[0] for _ in range(reps)]
      grpo[name] = {"first_s": first, "median_s": statistics.median(timed), "times_s": timed}
    finally:
      peer.close()
      del peer
      gc.collect()
  return {"decode": decode, "grpo_full_step": grpo, "settings": req}


_CHILDREN = {"checkpoint": child_checkpoint, "reload": child_reload, "peers": child_peers}


# ----------------------------------------------------------------------------------------- main


def rehearse(args, sizes: dict, work: Path, env: dict, phases: dict) -> dict:
  """Every phase in turn, each recorded into `phases` as it ends; returns the run's details."""
  arch = ck.ARCHS[args.arch]
  shape = arch.smoke if args.smoke else arch.full
  ckpt, export_dir = work / "checkpoint", work / "export"

  def timed(phase: str, fn, *a):
    t0 = time.monotonic()
    result = fn(*a)
    result.setdefault("wall_s", round(time.monotonic() - t0, 2))
    phases[phase] = result
    print(f"[rehearsal] {phase}: {result['wall_s']:.1f} s", flush=True)
    return result

  def in_child(name: str, request: dict) -> dict:
    answer, info = call_child(name, request, work)
    return {**answer, "wall_s": info["wall_s"], "peak_rss_mb": info["peak_rss_mb"]}

  data = timed("data", phase_data, work, sizes, args.seed)
  tok = timed("tokenizer", phase_tokenizer, arch, shape["vocab_size"], ckpt, data)
  request = {"arch": args.arch, "ckpt": str(ckpt), "smoke": args.smoke, "seed": args.seed}
  timed("checkpoint", in_child, "checkpoint", {**request, "ids": tok["ids"]})
  tok["jaxrl"] = as_jaxrl_reads(arch, ckpt)  # with generation_config.json's stops
  run_info, sft, rl, resume, overrides = phase_runs(ckpt, data, sizes, tok, work, env, args.seed)
  phases.update(sft=sft, rl=rl, resume=resume)
  timed("export", phase_export, overrides, work / "run_killed", export_dir, env, work)
  held = [json.loads(x)["question"] for x in Path(data["held_out"]).read_text().splitlines()[:3]]
  reload = timed("hf_reload", in_child, "reload", {"export": str(export_dir), "questions": held})
  reload.update(bound=RELOAD_BOUND, within_bound=reload["max_abs_diff"] < RELOAD_BOUND)
  if args.peers:
    request = {
      "export": str(export_dir),
      "batch": 8,
      "prompt_len": 16,
      "group_size": sizes["group_size"],
      "grpo_prompts": sizes["prompts"],
      "new_tokens": sizes["max_new_tokens"],
      "reps": args.peer_reps,
      "threads": os.cpu_count(),
      "tokenizer_vocab": tok["vocab_size"],
    }
    timed("peers", in_child, "peers", request)
  return run_info


def print_table(phases: dict) -> None:
  """One line per phase: wall time, peak RSS of its process, and what it found."""
  rl, resume, reload = phases.get("rl", {}), phases.get("resume", {}), phases.get("hf_reload", {})
  found = {
    "tokenizer": f"{phases.get('tokenizer', {}).get('vocab_size')} tokens",
    "checkpoint": f"{len(phases.get('checkpoint', {}).get('shards', []))} shards",
    "sft": f"loss {phases.get('sft', {}).get('loss')}",
    "rl": f"{rl.get('steady', {}).get('rollout_tokens_per_s', 0):.1f} rollout tok/s (steady)",
    "resume": f"identical={resume.get('identical')} {resume.get('first_difference') or ''}",
    "hf_reload": f"max |logit diff| {reload.get('max_abs_diff')}",
  }
  print(f"\n{'phase':11} {'wall s':>8} {'peak RSS MB':>12}  result")
  for name, p in phases.items():
    if isinstance(p, dict):
      rss = p.get("peak_rss_mb")
      rss = "" if rss is None else f"{rss:12.0f}"
      print(f"{name:11} {p.get('wall_s', 0):8.1f} {rss:>12}  {found.get(name, '')}")


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--arch", default="qwen3-0.6b", choices=sorted(ck.ARCHS))
  ap.add_argument("--smoke", action="store_true", help="the same path at a tiny size (~1 min)")
  ap.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="directory for the JSON")
  ap.add_argument("--workdir", type=Path, help="checkpoints and runs (default: a temporary dir)")
  ap.add_argument("--keep", action="store_true", help="keep the temporary dir (--workdir is kept)")
  ap.add_argument("--seed", type=int, default=0)
  for name in SIZES:
    flag = f"--{name.replace('_', '-')}"
    ap.add_argument(flag, type=int, help=f"default {SIZES[name][0]} (--smoke: {SIZES[name][1]})")
  ap.add_argument("--peers", action="store_true", help="also jaxrl vs HF generate and TRL")
  ap.add_argument("--peer-reps", type=int, default=3, help="timed calls per peer")
  ap.add_argument("--child", choices=sorted(_CHILDREN), help=argparse.SUPPRESS)
  ap.add_argument("--request", type=Path, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    answer = _CHILDREN[args.child](json.loads(args.request.read_text()))
    args.request.with_suffix(".answer.json").write_text(json.dumps(answer, indent=2))
    return answer
  sizes = {k: SIZES[k][args.smoke] if getattr(args, k) is None else getattr(args, k) for k in SIZES}
  bad = [k for k, v in sizes.items() if v < 1]
  if bad:
    ap.error(f"{', '.join(bad)} must be >= 1")
  if sizes["checkpoint_every"] >= sizes["rl_steps"]:
    ap.error("--checkpoint-every must be < --rl-steps: the run is killed after an RL checkpoint")
  if sizes["group_size"] < 2:
    ap.error("--group-size must be >= 2 (GRPO)")
  name = "scale_rehearsal" + ("" if args.arch == "qwen3-0.6b" else f"_{args.arch}")
  out = args.out / f"{name}{'_smoke' if args.smoke else ''}.json"
  tmp = None
  if args.workdir is None:
    tmp = tempfile.TemporaryDirectory(prefix="scale-rehearsal-")
    args.workdir = Path(tmp.name)
  work = args.workdir
  work.mkdir(parents=True, exist_ok=True)
  env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONFAULTHANDLER": "1"}
  # A production restart has a compilation cache: run A fills it, B's tries load from it.
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "xla-cache"))
  phases, run_info, error, t0 = {}, {}, None, time.monotonic()
  try:
    run_info = rehearse(args, sizes, work, env, phases)
  except (RuntimeError, SystemExit, OSError) as e:  # recorded: the phases before it are kept
    error = f"{type(e).__name__}: {e}"
  finally:
    if tmp is not None and not args.keep:
      tmp.cleanup()
  settings = {
    "arch": args.arch,
    "smoke": args.smoke,
    "shape": ck.ARCHS[args.arch].smoke if args.smoke else ck.ARCHS[args.arch].full,
    "sizes": sizes,
    "precision": PRECISION,
    "execution": EXECUTION + CHECKPOINTS + MEMORY,
    "config": CONFIG,
    "compilation_cache": env["JAX_COMPILATION_CACHE_DIR"],
    "workdir": str(work) if tmp is None or args.keep else None,
  }
  extra = {
    "phases": phases,
    "error": error,
    "wall_s": round(time.monotonic() - t0, 1),
    "torch_transformers": versions(("torch", "transformers", "tokenizers")),
  }
  report = write_report(out, "scale_rehearsal", settings, run_info, **extra)
  print_table(phases)
  if error:
    raise SystemExit(f"[rehearsal] stopped: {error}")
  return report


if __name__ == "__main__":
  main()
