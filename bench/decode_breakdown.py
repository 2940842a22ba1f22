"""Where an engine decode step's time goes: XLA's own per-op times, bucketed by what each op does.

`decode_throughput.py` times a peer's whole call; this script asks which of the decode program's
operations take that time. For each `--peers` entry (`engine`, `engine-int8`) it builds the
continuous-batching engine as `decode_throughput.py` does (the same model, 16 random byte prompts
of 16 tokens, 128 greedy tokens each, the same Driver at 8 steps per call), warms it up, times
`--reps` whole calls untraced, then runs one more call under `jax.profiler` and reads back the CPU
runtime's event for every executed HLO op of the decode program (`jit__generate_fn`). Each op is
put in one bucket from its optimized HLO (dumped by XLA for this run):

  projection matmul  a dot with no batch dimension (q, k, v, o, gate, up, down; int8 or float)
  output head        that dot where the output is the vocabulary
  attention dots     the batched scores and probabilities-times-values dots of paged attention
  page gather        copying each slot's K/V pages out of the pool (the reference path's gather)
  cache write        the scatter of the new token's K/V into its page
  quantize           ops whose result is int8 / fp8 (activation quantization)
  other              norms, RoPE, softmax, masking, sampling, loop bookkeeping

and reported in ms per token step (the traced call's op time over its 128 tokens, as
`decode_throughput.py` divides a call). Tracing adds time per op, so the buckets are not scaled;
`traced_ms_per_step` and `untraced_ms_per_step` (whole calls, host work included) are reported
side by side. One process per peer (each with its own dump).

  .venv/bin/python bench/decode_breakdown.py                       # medium, engine + engine-int8
  .venv/bin/python bench/decode_breakdown.py --models small --peers engine-int8
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "decode_breakdown.json"
PEERS = ("engine", "engine-int8")
MODULE = "jit__generate_fn"
BUCKETS = (
  "projection matmul",
  "output head",
  "attention dots",
  "page gather",
  "cache write",
  "quantize",
  "other",
)


def _computations(hlo: str) -> tuple[dict[str, str], dict[str, str]]:
  """({computation name: body}, {instruction name: its line}) of an optimized HLO module."""
  comps, lines, cur = {}, {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      cur = head.group(1)
      comps[cur] = []
      continue
    if cur is not None:
      comps[cur].append(line.strip())
    inst = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if inst:
      lines[inst.group(1)] = line.strip()
  return {k: "\n".join(v) for k, v in comps.items()}, lines


def bucket(line: str, comps: dict[str, str], vocab: int) -> str:
  """The BUCKETS entry of one executed op, from its HLO line (and its fused computation)."""
  called = re.search(r"calls=%?([\w.\-]+)", line)
  body = comps.get(called.group(1), "") if called else ""
  text = body or line
  out_type = line.split(" = ", 1)[1].split(" ", 1)[0] if " = " in line else ""
  if " dot(" in text:
    if "batch_dims" in text:
      return "attention dots"
    dims = re.search(r"\[([\d,]*)\]", out_type)
    last = int(dims.group(1).split(",")[-1]) if dims and dims.group(1) else -1
    return "output head" if last == vocab else "projection matmul"
  if " gather(" in text:
    return "page gather"
  if " scatter(" in text or "scatter" in line.split(" = ", 1)[0]:
    return "cache write"
  if re.match(r"\(?(s8|f8e4m3fn|f8e5m2)\[", out_type):
    return "quantize"
  return "other"


def child(args) -> dict:
  """One peer in this process: build, warm up, time, trace one call, bucket its decode ops."""
  dump = tempfile.mkdtemp(prefix="jaxrl-decode-dump-")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_module_re={MODULE}"
  ).strip()
  sys.path.insert(0, str(BENCH_DIR))
  sys.path.insert(0, str(BENCH_DIR.parent))
  import jax
  import numpy as np
  from _common import MODELS
  from decode_throughput import PEERS as RUNNERS
  from decode_throughput import SEED, Workload

  from jaxrl.models.transformer import make_model

  cfg = MODELS[args.model]()
  graphdef, params = make_model(cfg, seed=SEED)
  prompts = np.random.default_rng(SEED).integers(3, cfg.vocab_size, (16, 16), dtype=np.int32)
  w = Workload(args.model, cfg, graphdef, params, None, prompts, args.new_tokens, 1, 0, 1, 8)
  peer = RUNNERS[args.peer](w)
  untraced = sorted(peer.call()[0] for _ in range(args.reps))
  trace_dir = tempfile.mkdtemp(prefix="jaxrl-decode-trace-")
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  traced, _ = peer.call()
  jax.profiler.stop_trace()
  (trace,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
  events = json.load(gzip.open(trace))["traceEvents"]
  op_us = collections.Counter()
  for e in events:
    a = e.get("args", {})
    if e.get("ph") == "X" and a.get("hlo_module") == MODULE and "hlo_op" in a:
      op_us[a["hlo_op"]] += e.get("dur", 0.0)
  files = sorted(glob.glob(f"{dump}/*{MODULE}*cpu_after_optimizations.txt"))
  if len(files) != 1:
    raise SystemExit(f"expected one optimized {MODULE} module in {dump}, found {files}")
  comps, lines = _computations(Path(files[0]).read_text())
  ms, ops = collections.Counter(), collections.Counter()
  for op, us in op_us.items():
    b = bucket(lines.get(op, ""), comps, cfg.vocab_size) if op in lines else "other"
    ms[b] += us / 1e3 / args.new_tokens  # per token step, as decode_throughput.py reports
    ops[b] += 1
  per_step = args.new_tokens
  return {
    "model": args.model,
    "peer": args.peer,
    "untraced_ms_per_step": 1e3 * statistics.median(untraced) / per_step,
    "untraced_calls_s": untraced,
    "traced_ms_per_step": 1e3 * traced / per_step,
    "op_ms_per_step": {b: ms[b] for b in BUCKETS},
    "ops": {b: ops[b] for b in BUCKETS},
    "op_total_ms_per_step": sum(ms.values()),
  }


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--models", default="medium")
  ap.add_argument("--peers", default="engine,engine-int8", help=f"from {', '.join(PEERS)}")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--reps", type=int, default=5, help="untraced calls (median reported)")
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
  ap.add_argument("--child", nargs=2, metavar=("MODEL", "PEER"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    args.model, args.peer = args.child
    print("RESULT " + json.dumps(child(args)))
    return {}
  sys.path.insert(0, str(BENCH_DIR))
  from _common import MODELS, write_report

  models, peers = args.models.split(","), args.peers.split(",")
  bad = [m for m in models if m not in MODELS] + [p for p in peers if p not in PEERS]
  if bad:
    raise SystemExit(f"unknown {bad}; models from {list(MODELS)}, peers from {list(PEERS)}")
  if args.reps <= 0 or args.new_tokens <= 1:
    raise SystemExit("--reps must be positive and --new-tokens at least 2")
  results = []
  for model in models:
    for peer in peers:
      print(f"[{model}] {peer} ...", flush=True)
      cmd = [sys.executable, __file__, "--child", model, peer, "--reps", str(args.reps)]
      cmd += ["--new-tokens", str(args.new_tokens)]
      out = subprocess.run(cmd, capture_output=True, text=True)
      found = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
      if out.returncode or not found:
        raise SystemExit(f"{model}/{peer} failed:\n{out.stderr[-3000:]}")
      results.append(json.loads(found[-1][len("RESULT ") :]))
  for r in results:
    print(
      f"\n{r['model']} {r['peer']}: {r['untraced_ms_per_step']:.2f} ms/step untraced, "
      f"{r['traced_ms_per_step']:.2f} traced, of which XLA ops {r['op_total_ms_per_step']:.2f}"
    )
    for b in BUCKETS:
      print(f"  {b:18} {r['op_ms_per_step'][b]:6.2f} ms/step  ({r['ops'][b]} ops)")
  settings = {"batch": 16, "prompt_len": 16, "new_tokens": args.new_tokens, "reps": args.reps}
  return write_report(args.out, "decode_breakdown", settings, results)


if __name__ == "__main__":
  main()
